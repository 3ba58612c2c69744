"""MkDocs hook (mkdocs.yml ``hooks:``): the figures of ``results/samples/plots/`` become site files under
``samples/plots/``, so the analysis guide shows the committed figures without a second copy in ``docs/``."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "results" / "samples" / "plots"


def on_files(files, config):
    for png in sorted(FIGURES.glob("*.png")):
        files.append(File.generated(config, f"samples/plots/{png.name}", abs_src_path=str(png)))
    return files
