"""MkDocs hooks (mkdocs.yml ``hooks:``):

- the figures of ``results/samples/plots/`` become site files under ``samples/plots/``, so the analysis guide
  shows the committed figures without a second copy in ``docs/``;
- every table of a page is wrapped in a ``<div class="table-scroll">``, which ``docs/css/extra.css`` lets
  scroll sideways: the theme hides what overflows the page, and a wide table was cut at the right edge.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "results" / "samples" / "plots"


def on_files(files, config):
    for png in sorted(FIGURES.glob("*.png")):
        files.append(File.generated(config, f"samples/plots/{png.name}", abs_src_path=str(png)))
    return files


#: the container of every table (docs/css/extra.css: it scrolls when the table is wider than the page)
TABLE_CLASS = "table-scroll"
_TABLE = re.compile(r"<table\b.*?</table>", re.S)


def on_page_content(html, page, config, files):
    return _TABLE.sub(lambda m: f'<div class="{TABLE_CLASS}">{m.group(0)}</div>', html)
