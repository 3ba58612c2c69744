"""The user guide's examples that ``docs/examples.py`` does not regenerate are run here:
the config file of the commands page, the sweep spec of the sweeps page, the Python of the traces page,
and the module list of the layout page. Each is read from the page itself, so editing the page edits
the test."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO, layout_listing

DOCS = REPO / "docs"


def fenced(page: str, language: str) -> list:
    """The code blocks of ``page`` (relative to docs/) fenced as ``language``."""
    return re.findall(rf"^```{language}\n(.*?)^```$", (DOCS / page).read_text(), re.M | re.S)


def test_the_config_file_example_is_a_valid_run_config(tmp_path):
    from fourd_mpi.cli.main import build_parser
    from fourd_mpi.run.configfile import config_tokens, load_config_file

    (block,) = fenced("guide/commands.md", "toml")
    path = tmp_path / "run.toml"
    path.write_text(block)
    tokens = config_tokens(load_config_file(str(path)), str(path))
    args = build_parser().parse_args(["run", *tokens])
    assert (args.model, args.steps, args.overlap, args.gx, args.gy) == ("gpt-small", 20, "all", 2, 2)


def test_the_sweep_spec_example_plans(tmp_path):
    (block,) = fenced("guide/sweeps.md", "yaml")
    spec = tmp_path / "weak-gpt-tiny.yaml"
    spec.write_text(block)
    proc = subprocess.run([sys.executable, "-m", "fourd_mpi", "sweep", "plan", str(spec), "--site", "perlmutter"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 4 rank counts x overlap none|all x 2 zipped (prefetch_depth, chunks) pairs
    assert "weak scaling, 16 runs on site perlmutter" in proc.stdout


def test_the_trace_reading_example_runs_on_a_sample_trace():
    (block,) = fenced("guide/traces.md", "python")
    sample = REPO / "results" / "samples" / "grid-1x2x2x2-overlap.h5"
    code = re.sub(r'load_trace\("[^"]+"\)', f"load_trace({str(sample)!r})", block)
    lines = code.splitlines()
    namespace: dict = {}
    exec("\n".join(lines[:-1]), namespace)  # noqa: S102 - the page's own example
    trace = namespace["trace"]
    assert (trace.metadata["grid"], trace.status) == ("1x2x2x2", "complete")
    assert lines[-1].startswith("check_invariants(trace)")
    assert namespace["check_invariants"](trace) == []


def test_every_module_the_layout_page_lists_exists():
    """docs/layout.md, the one description of the layout, lists every subpackage and module of ``fourd_mpi`` and
    nothing that does not exist (a data folder it lists, such as ``perf/published/``, exists too)."""
    listed = layout_listing()
    assert len(listed) > 60 and listed[0] == "fourd_mpi"
    assert [p for p in listed if not (REPO / p).exists()] == [], "docs/layout.md lists what does not exist"
    modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "fourd_mpi").rglob("*.py")
                     if p.name != "__init__.py" and "__pycache__" not in p.parts)
    assert [m for m in modules if m not in listed] == [], "docs/layout.md does not list these modules"
    packages = sorted(p.parent.relative_to(REPO).as_posix() for p in (REPO / "fourd_mpi").rglob("__init__.py")
                      if "__pycache__" not in p.parts)
    assert "fourd_mpi/analysis/tables" in packages
    assert [p for p in packages if p not in listed] == [], "docs/layout.md does not list these subpackages"


def test_the_layout_page_is_the_one_description():
    """The package docstring and the design point to the layout page instead of listing the subpackages again
    (copies that drifted apart: one lacked algorithms/, results/ and testbed/)."""
    import fourd_mpi

    doc = fourd_mpi.__doc__
    assert "docs/layout.md" in doc and ":mod:`fourd_mpi." not in doc
    section = (DOCS / "design.md").read_text().split("## 7. ")[1].split("\n## ")[0]
    assert "(layout.md)" in section and "| `core/` |" not in section
