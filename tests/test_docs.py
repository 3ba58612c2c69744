"""The README and the documentation site say what the code does.

- the README is a door: at most about 250 lines, its two commands are the ones ``.ci/run`` runs and the
  site's home page shows;
- every example block shows the command ``docs/examples.py`` runs; the examples that read only committed
  files are rerun here and must print what the pages show;
- the generated reference (``docs/reference.py``) is current;
- ``mkdocs.yml``'s navigation names only pages that exist, and every page is in it.

The site build itself (``mkdocs build --strict``: links, anchors) is a step of ``.ci/run``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys

import pytest
from conftest import REPO


def _load(name):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", REPO / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


examples = _load("examples")
reference = _load("reference")


def readme_commands(path):
    """The two commands of a page's "Two commands on a fresh machine" section."""
    text = (REPO / path).read_text()
    section = text.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```bash\n(.*)\n```$", section, re.M)


def test_the_readme_is_a_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail into docs/"


def _subsequence(parts, line_parts):
    it = iter(line_parts)
    return all(any(p == q for q in it) for p in parts)


def test_ci_runs_the_readme_commands():
    """Every step of README command 1 and 2 is a step of one .ci/run line, in order, up to the constraints
    flag CI adds (``-c constraints.txt``, docs/contributing.md) and steps CI adds between them."""
    commands = readme_commands("README.md")
    assert len(commands) == 2 and commands[0].endswith("fourd-mpi run --gx 2 --gy 2 --gz 2 --model gpt-tiny --steps 10")
    ci = (REPO / ".ci" / "run").read_text().replace(' "${PIPC[@]}"', "").splitlines()
    for command in commands:
        parts = command.split(" && ")
        assert any(_subsequence(parts, line.split(" && ")) for line in ci), f".ci/run does not run {command!r}"
    assert readme_commands("docs/index.md") == commands


def test_every_example_block_shows_the_scripts_command():
    assert examples.check() == []


def test_the_tour_starts_with_readme_command_1():
    """The tour's first output is README command 1's job (the command after its install)."""
    command_1 = readme_commands("README.md")[0]
    assert command_1.endswith(" && " + examples.EXAMPLES["run"].command)
    names = [name for name, _, _ in examples.blocks((REPO / "README.md").read_text())
             if examples.EXAMPLES[name].format != "note"]
    assert names[0] == "run"


def test_a_block_with_another_command_is_caught(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("<!-- example: tune -->\n```console\n$ fourd-mpi tune --ranks 8\nout\n```\n"
                    "<!-- /example: tune -->\n")
    monkeypatch.setattr(examples, "REPO", tmp_path)
    problems = examples.check(["page.md"])
    assert any("example 'tune' shows 'fourd-mpi tune --ranks 8'" in p for p in problems), problems


@pytest.mark.parametrize("name", [n for n, e in examples.EXAMPLES.items() if e.stable])
def test_stable_examples_print_what_the_pages_show(name, tmp_path, monkeypatch):
    """Rerun an example that reads only committed files; its blocks must not change."""
    example = examples.EXAMPLES[name]
    # the same command with this interpreter's fourd_mpi (the tests may run outside .venv)
    command = example.command.replace(".venv/bin/fourd-mpi", f"{sys.executable} -m fourd_mpi")
    output = examples.run(dataclasses.replace(example, command=command))
    shown = 0
    for rel in examples.FILES:
        for block, opts, m in examples.blocks((REPO / rel).read_text()):
            if block == name:
                shown += 1
                assert m.group("body") == examples.render(name, opts, output), \
                    f"{rel}: example {name} is not what it prints now (run python3 docs/examples.py --only {name})"
    assert shown


def test_the_reference_pages_are_current():
    assert reference.stale() == [], "run python3 docs/reference.py and commit docs/reference/"


def test_the_reference_names_every_command_and_run_option():
    from fourd_mpi.run.options import RUN_OPTIONS

    cli = (REPO / "docs" / "reference" / "cli.md").read_text()
    options = (REPO / "docs" / "reference" / "run-options.md").read_text()
    for command in ("run", "verify", "trace recover", "sweep submit", "model calibrate", "bench collectives"):
        assert f"`fourd-mpi {command}`" in cli
    for option in RUN_OPTIONS:
        assert f"| `--{option.name}` |" in options


def test_the_navigation_and_the_pages_agree():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                yield from pages(value)
            else:
                yield value

    listed = list(pages(config["nav"]))
    docs = REPO / "docs"
    on_disk = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md"))
    assert [p for p in listed if not (docs / p).is_file()] == []
    assert sorted(set(listed)) == on_disk


def test_the_readme_links_to_files_that_exist():
    """mkdocs checks the site's links; the README is not a page of it, so its links are checked here."""
    text = (REPO / "README.md").read_text()
    targets = [t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    assert targets and [t for t in targets if t and not (REPO / t).exists()] == []
