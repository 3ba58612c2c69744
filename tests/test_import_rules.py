"""The import rules of the package (docs/design.md section 7), checked on the real modules.

1. Nothing outside ``fourd_mpi.cli`` imports ``fourd_mpi.cli``.
2. Offline modules never import ``mpi4py.MPI`` (importing it initializes MPI, which can abort
   on a login node): importing each in a fresh interpreter leaves ``mpi4py.MPI`` out of
   ``sys.modules``.
3. The offline commands work where importing ``mpi4py.MPI`` fails outright.
4. No import circles between modules of ``fourd_mpi``: the graph is built from the AST of every
   module, function-local (lazy) imports and ``TYPE_CHECKING`` imports included, so a lazy import
   cannot hide a circle; a circle is reported by its modules and the lines that import.
5. The package order (:data:`ORDER`): no module imports, lazily or not, a subpackage placed after its own.
"""

from __future__ import annotations

import ast
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import layout_listing

import fourd_mpi

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fourd_mpi"
SAMPLES = ROOT / "results" / "samples"

#: modules that run under mpiexec and may import mpi4py.MPI (at call time or at import)
ONLINE = {
    "fourd_mpi.core.collectives", "fourd_mpi.core.mpicoll", "fourd_mpi.core.mpiutil",
    "fourd_mpi.step.layers", "fourd_mpi.step.model", "fourd_mpi.step.engine", "fourd_mpi.step.schedule",
    "fourd_mpi.run.build", "fourd_mpi.run.session", "fourd_mpi.run.verify", "fourd_mpi.algorithms.tensor4d",
    "fourd_mpi.algorithms.pipeline", "fourd_mpi.core.p2p",
    "fourd_mpi.algorithms.optimus3d", "fourd_mpi.algorithms.optimus_layers",
    "fourd_mpi.run.collbench",
}


def all_modules():
    return sorted(m.name for m in pkgutil.walk_packages(fourd_mpi.__path__, "fourd_mpi."))


def offline_modules():
    return [m for m in all_modules() if m not in ONLINE and m != "fourd_mpi.__main__"]


def import_sites(path: Path, root: Path = ROOT):
    """``(name, line)`` for every module name an ``import``/``from`` statement in ``path`` names, at any
    depth (function-local imports included; relative ones resolved against ``path``'s package under
    ``root``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            yield base, node.lineno
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno


def imported_names(path: Path):
    """Every module name an ``import``/``from`` statement in ``path`` names (relative ones resolved)."""
    for name, _ in import_sites(path):
        yield name


def test_the_walk_finds_the_subpackages():
    names = all_modules()
    for package in ("core", "step", "run", "trace", "analysis", "perf", "jobs", "util", "cli"):
        assert f"fourd_mpi.{package}" in names
    assert len(names) > 40
    assert ONLINE <= set(names), sorted(ONLINE - set(names))


def test_nothing_outside_cli_imports_cli():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).parts
        if rel[0] == "cli" or rel == ("__main__.py",):
            continue
        for name in imported_names(path):
            if name == "fourd_mpi.cli" or name.startswith("fourd_mpi.cli."):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


def test_the_rule_checker_sees_a_violation(tmp_path):
    """The checker above is not vacuous: it finds absolute and relative imports of cli."""
    bad = PACKAGE / "analysis" / "_probe_tmp.py"
    try:
        bad.write_text("from ..cli import main\nimport fourd_mpi.cli.args\n")
        names = set(imported_names(bad))
    finally:
        bad.unlink()
    assert "fourd_mpi.cli" in names and "fourd_mpi.cli.args" in names


# -- no import circles ------------------------------------------------------------------------

def module_files(root: Path, package: str):
    """``module name -> file`` for every module of ``package`` under ``root``, read from the tree (no import)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path = ROOT, package: str = "fourd_mpi"):
    """``module -> {imported module: first line}`` between the modules of ``package``: a name resolves
    to its longest prefix that is a module (``from a.b import c``: ``a.b.c`` if it is a module, else ``a.b``).
    Every import statement counts, at module level or inside a function (lazy) or an ``if``."""
    files = module_files(root, package)
    graph = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for name, line in import_sites(path, root):
            parts = name.split(".")
            for n in range(len(parts), 0, -1):
                target = ".".join(parts[:n])
                if target in files:
                    if target != module:
                        edges.setdefault(target, line)
                    break
    return graph


def import_circles(graph):
    """One circle per strongly connected component of more than one module (Tarjan), each as a list of
    modules ``[a, b, ..., a]`` that follows real edges."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):  # recursive Tarjan: the package graph is shallow (tens of modules deep at most)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    circles = []
    for component in components:  # a shortest way back to the first module, inside the component
        start = min(component)
        paths, frontier = {start: [start]}, [start]
        while frontier:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        circles.append(paths[v] + [start])
                        nxt = frontier = []
                        break
                    if w in component and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if not frontier:
                    break
            frontier = nxt
    return circles


def describe_circle(graph, circle) -> str:
    """``a (line 12) -> b (line 40) -> a``: each module with the line of its import of the next."""
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 40 and graph["fourd_mpi.trace.read"], "the graph is not vacuous"
    circles = [describe_circle(graph, c) for c in import_circles(graph)]
    assert not circles, "import circles between modules (lazy imports count too):\n" + "\n".join(circles)


def test_the_circle_checker_sees_a_lazy_circle(tmp_path):
    """Known answer: a circle closed by a function-local relative import is found and named by its
    modules and lines; a chain without a way back is not a circle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\nfrom pkg.c import helper\n")
    (pkg / "c.py").write_text("def helper():\n    from .a import x\n    return x\n")
    (pkg / "d.py").write_text("from pkg import a\n")  # into the circle, not part of it
    graph = import_graph(tmp_path, "pkg")
    circles = import_circles(graph)
    assert circles == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert describe_circle(graph, circles[0]) == "pkg.a (line 1) -> pkg.sub.b (line 2) -> pkg.c (line 2) -> pkg.a"
    (pkg / "c.py").write_text("def helper():\n    return 1\n")
    assert import_circles(import_graph(tmp_path, "pkg")) == []


# -- the package order ---------------------------------------------------------------------

#: the layers of ``fourd_mpi``, lowest first: every subpackage and top-level module (``__init__`` is the package's
#: own ``__init__.py``). A module imports its own layer and those before it, never one after it
#: (:func:`test_no_import_climbs_the_package_order` says why each sits where it does).
ORDER = ("__init__", "errors", "util", "core", "step", "algorithms", "perf", "results", "trace", "run", "analysis",
         "jobs", "testbed", "cli", "__main__")


def package_units(root: Path, package: str):
    """The layers ``ORDER`` places: the subpackages of ``package`` and its top-level modules (``__init__`` too)."""
    base = root / package
    return {p.name for p in base.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | \
        {p.stem for p in base.glob("*.py")}


def order_climbs(root: Path, package: str, order):
    """``path:line -> module (A imports B, after it in the order)``, once per import statement and layer, for every
    import (module level, function-local, ``TYPE_CHECKING``) of a layer placed after the importing module's own.
    A name below ``package`` that is no layer (``from fourd_mpi import __version__``) belongs to ``__init__``."""
    units = package_units(root, package)
    rank = {unit: i for i, unit in enumerate(order)}
    out = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root / package).parts
        own = rel[0][:-3] if len(rel) == 1 else rel[0]
        seen = set()
        for name, line in import_sites(path, root):
            parts = name.split(".")
            if parts[0] != package:
                continue
            unit = parts[1] if len(parts) > 1 and parts[1] in units else "__init__"
            if rank[unit] > rank[own] and (line, unit) not in seen:
                seen.add((line, unit))
                out.append(f"{path.relative_to(root)}:{line} -> {name} ({own} imports {unit}, after it in the order)")
    return out


def test_no_import_climbs_the_package_order(tmp_path):
    """No module of a layer imports a layer after it in :data:`ORDER`, by any import (function-local and
    ``TYPE_CHECKING`` ones included), and every subpackage and top-level module is placed (a new one fails here
    until it is). The order, lowest first:

    - ``__init__`` (the version), ``errors`` (the exceptions), ``util`` (pure helpers): used everywhere;
    - ``core``: grid, layouts, backends, the collectives; the event recorder is handed to the collectives
      (``Collectives(..., tracer=)``), never imported: ``core`` sits below ``trace``;
    - ``step`` (kernels, layers, model, engine) on ``core``; ``algorithms`` (the registry and what is built on
      ``step``), with the resolved :class:`~fourd_mpi.algorithms.runoptions.RunOptions` the algorithms' checks take;
    - ``perf``: the model only, pure (no trace, no MPI, nothing above it): the micro-benchmark that measures is
      ``run/collbench.py`` (its fits: ``perf/calibration.py``), checks against traces are
      ``analysis/model_check.py``;
    - ``results`` below ``trace``: the index file (its lines, locking, appends, rewrite) reads no trace, and the
      trace package writes into it (a run's spool refuses a foreign index link, ``trace recover`` appends the
      recovered run's line); the lines built from traces and ``reindex`` are ``trace/indexing.py``;
    - ``trace`` (recorder, spool, merge, reader, summary); ``run`` (options, building a run, the traced session,
      the collective micro-benchmark), which wires them; ``analysis`` (tables, figures, exports, comparisons, the
      model against traces) on what runs write;
    - ``jobs`` (sweeps, job scripts) on run options and analysis; ``testbed``; ``cli``, which nothing else
      imports (rule 1); ``__main__``, its entry point.
    """
    pkg = tmp_path / "pkg"  # known answer: a lazy relative import up the order is found, named by file and line
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "b.py").write_text("from pkg.low import a\nfrom pkg import __version__\n")
    (pkg / "low" / "a.py").write_text("import os\n\n\ndef f():\n    from ..high import b, c\n    return b\n")
    assert order_climbs(tmp_path, "pkg", ("__init__", "low", "high")) == [
        "pkg/low/a.py:5 -> pkg.high (low imports high, after it in the order)"]

    units = package_units(ROOT, "fourd_mpi")
    assert {"core", "perf", "trace", "cli", "errors", "__init__", "__main__"} <= units, units
    assert set(ORDER) == units, (f"place every subpackage and top-level module of fourd_mpi in ORDER: not placed "
                                 f"{sorted(units - set(ORDER))}, placed but gone {sorted(set(ORDER) - units)}")
    climbs = order_climbs(ROOT, "fourd_mpi", ORDER)
    assert not climbs, ("imports that climb the package order (" + " < ".join(ORDER) + "; lazy imports count "
                        "too):\n" + "\n".join(climbs))


def test_the_order_is_the_layout_pages():
    """:data:`ORDER` is the order of the tree of docs/layout.md, the one description of the layout: its top-level
    entries, lowest first, after the package's own ``__init__``; a subpackage moved in one and not the other
    fails here."""
    top = [path.split("/")[1] for path in layout_listing() if path.count("/") == 1]
    shown = ("__init__", *(name[:-3] if name.endswith(".py") else name for name in top))
    assert shown == ORDER, f"docs/layout.md lists the top level as {' < '.join(shown)}; ORDER is {' < '.join(ORDER)}"


@pytest.mark.parametrize("module", offline_modules())
def test_offline_module_does_not_import_mpi(module):
    code = f"import sys, importlib; importlib.import_module({module!r}); print('mpi4py.MPI' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False", f"importing {module} imports mpi4py.MPI"


def test_online_module_does_import_mpi():
    """Known answer for the check above: a module that needs MPI is seen importing it."""
    code = "import sys, fourd_mpi.core.collectives; print('mpi4py.MPI' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stdout.strip() == "True", proc.stderr


# -- the offline commands where MPI cannot even be imported ----------------------------------

SHIM = '''
import importlib.abc, sys


class _NoMPI(importlib.abc.MetaPathFinder):
    """As on a login node whose MPI aborts at initialization: importing mpi4py.MPI fails."""

    def find_spec(self, name, path=None, target=None):
        if name == "mpi4py.MPI":
            raise ImportError("mpi4py.MPI is blocked in this test (no MPI library here)")
        return None


sys.meta_path.insert(0, _NoMPI())
'''


@pytest.fixture(scope="module")
def no_mpi_env(tmp_path_factory):
    shim = tmp_path_factory.mktemp("nompi")
    (shim / "sitecustomize.py").write_text(SHIM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(ROOT)]), MPLBACKEND="Agg")
    check = subprocess.run([sys.executable, "-c", "import mpi4py.MPI"], capture_output=True, text=True, env=env)
    assert check.returncode != 0 and "blocked in this test" in check.stderr  # the shim works
    return env


def fourd(args, env, cwd):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_offline_commands_work_without_mpi(no_mpi_env, tmp_path):
    sample = str(SAMPLES / "grid-1x2x2x2-overlap.h5")
    commands = [
        ["--help"],
        ["presets"],
        ["analyze", str(SAMPLES), "--what", "runs,breakdown,comm"],
        ["plot", "breakdown", str(SAMPLES), "-o", str(tmp_path / "b.png")],
        ["plot", "timeline", sample, "-o", str(tmp_path / "t.svg")],
        ["export", "perfetto", sample, "-o", str(tmp_path / "t.json")],
        ["export", "thicket", sample, "-o", str(tmp_path / "t.cali.json")],
        ["trace", "show", sample],
        ["trace", "check", sample],
        ["sweep", "plan", str(ROOT / "jobscripts" / "weak-gpt-tiny.yaml")],
        ["sweep", "render", str(ROOT / "jobscripts" / "weak-gpt-tiny.yaml"), "--site", "perlmutter",
         "--account", "m0000", "--out", str(tmp_path / "sweep")],
        ["tune", "--ranks", "8", "--top", "3"],
        ["tune", "--ranks", "64", "--model", "gpt-small", "--site", "perlmutter", "--top", "2"],
        ["model", "validate", str(SAMPLES)],
        ["model", "predict", "--grid", "1x1x8x1", "--batch", "16", "--profile", "dgx-a100"],
        ["model", "published", "--dataset", "axonn_sc24", "--no-claims"],
        ["results", "reindex", str(ROOT / "results" / "baselines"), "-o", str(tmp_path / "index.jsonl")],
        ["results", "list", "--index", str(tmp_path / "index.jsonl")],
        ["compare", str(ROOT / "results" / "baselines" / "slower-gpt-tiny-np2.h5"), "--baseline",
         "run_id=baseline-gpt-tiny-np2", "--index", str(tmp_path)],
    ]
    for args in commands:
        proc = fourd(args, no_mpi_env, tmp_path)
        assert proc.returncode in (0, 1), (args, proc.stderr)  # 1: a command's own verdict, not a crash
        assert "Traceback" not in proc.stderr and "mpi4py" not in proc.stderr, (args, proc.stderr)
    assert (tmp_path / "b.png").stat().st_size > 0 and (tmp_path / "t.json").stat().st_size > 0
    assert (tmp_path / "sweep" / "manifest.json").exists()


def test_run_without_mpi_fails(no_mpi_env, tmp_path):
    """Known answer for the shim: ``run`` needs MPI, and without it fails naming the import error."""
    proc = fourd(["run", "--steps", "1", "--warmup", "0"], no_mpi_env, tmp_path)
    assert proc.returncode != 0 and "mpi4py.MPI is blocked" in proc.stderr
