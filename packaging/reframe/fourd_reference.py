"""References of the ReFrame check (``fourd_mpi_check.py``): the template a centre fills, read and written here.

No ReFrame import: the project's tests use this module as is, and a centre runs it to fill the template
(``references.yaml`` next to this file) from its own runs::

    python packaging/reframe/fourd_reference.py --system perlmutter:gpu --site perlmutter --grid 1x2x2x2 \\
        'output/perlmutter/gpu/*/FourdMpiRunCheck_*/index.jsonl'

prints the entry to paste under ``references:``: the median of each figure of merit over the runs found, with
the template's tolerances, and a line per figure when the runs themselves spread wider than its tolerance
(then the reference would fail the centre's own runs: measure on quiet nodes, or widen that tolerance).

**Tolerances.** ReFrame's reference tuple is ``(value, lower, upper, unit)``; a measured ``v`` passes when
``value x (1 + lower) <= v <= value x (1 + upper)`` (for ``value > 0``; ``None``: no bound on that side;
ReFrame's ``reframe.utility.sanity.reference_bounds`` and ``assert_reference``, which :func:`bounds`
mirrors). The template's defaults: step time ``(-0.10, +0.05)``, so a run 10 % slower than the reference
fails (and one 10 % faster too: a reference that old is to be measured again); TFLOP/s per rank, % of
measured GEMM and MFU ``(-0.05, +0.10)``, the same 5 % the other way round; exposed communication share
``(-0.20, +0.05)``.

**Figures of merit**, read from the run's JSON line in ``results/index.jsonl`` (written by rank 0 once the
trace is written; ``fourd_mpi/results/index.py``, ``make_entry``), never from the rounded text:

- ``step_time`` (s): ``median_s``: median over the measured steps of the maximum over ranks of the
  step span;
- ``tflops_per_rank`` (TFLOP/s): ``model_tflops_per_rank``: the step's model FLOPs (Narayanan et al.)
  / world size / step time;
- ``gemm_pct`` (%): ``gemm_pct``: % of measured GEMM = model FLOP/s per rank / the standalone TFLOP/s of
  the step's largest local GEMM on the same machine (not MFU);
- ``mfu_pct`` (%), only where the run has a data-sheet peak (a GPU of fourd_mpi/perf/peaks.py, or
  ``--peak-tflops`` in ``extra_options``): MFU = model FLOPs / (step time x ranks x data-sheet peak),
  the figure Megatron-LM reports;
- ``exposed_comm_share`` (%): ``100 * wait_share``: time blocked in communication summed over ranks
  and steps / sum of the step spans.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
#: the template (``FOURD_REFRAME_REFERENCES`` names another file)
TEMPLATE = os.path.join(HERE, "references.yaml")
#: the run id the check gives its run (the line it reads in the stage's results/index.jsonl)
RUN_ID = "fourd-mpi-check"
#: figure of merit -> (index field, scale, unit)
FIELDS = {"step_time": ("median_s", 1.0, "s"), "tflops_per_rank": ("model_tflops_per_rank", 1.0, "TFLOP/s"),
          "gemm_pct": ("gemm_pct", 1.0, "%"), "mfu_pct": ("mfu_pct", 1.0, "%"),
          "exposed_comm_share": ("wait_share", 100.0, "%")}
#: the template's tolerances when it names none: (lower, upper) fractions of the reference, ReFrame's meaning
DEFAULT_TOLERANCES = {"step_time": (-0.10, 0.05), "tflops_per_rank": (-0.05, 0.10), "gemm_pct": (-0.05, 0.10),
                      "mfu_pct": (-0.05, 0.10), "exposed_comm_share": (-0.20, 0.05)}


class ReferenceError(ValueError):
    """A template that cannot be used: one line naming the file and the key."""


def _grid_ranks(grid: str) -> int:
    parts = grid.split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ReferenceError(f"grid {grid!r}: write G_data x G_z x G_y x G_x, e.g. 1x2x2x2")
    return math.prod(int(p) for p in parts)


def load_template(path: str = None) -> dict:
    """The template at ``path`` (default ``$FOURD_REFRAME_REFERENCES``, else :data:`TEMPLATE`), checked:
    ``tolerances`` (figure -> [lower, upper]), ``sites`` (fourd_mpi site -> ``systems`` and ``grids``),
    ``references`` (system:partition -> site -> grid -> figure -> value or [value, lower, upper])."""
    import yaml

    path = path or os.environ.get("FOURD_REFRAME_REFERENCES") or TEMPLATE
    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ReferenceError(f"{path}: the references template is a mapping (tolerances, sites, references)")
    tolerances = dict(DEFAULT_TOLERANCES)
    for fom, pair in (data.get("tolerances") or {}).items():
        if fom not in FIELDS:
            raise ReferenceError(f"{path}: tolerances.{fom}: not a figure of merit ({', '.join(FIELDS)})")
        tolerances[fom] = _pair(pair, f"{path}: tolerances.{fom}")
    sites = data.get("sites") or {}
    if not isinstance(sites, dict) or not sites:
        raise ReferenceError(f"{path}: sites: name at least one fourd_mpi site with its systems and grids")
    for site, entry in sites.items():
        if not isinstance(entry, dict) or not entry.get("grids") or not entry.get("systems"):
            raise ReferenceError(f"{path}: sites.{site}: give systems: [SYSTEM:PARTITION, ...] and grids: [GxGxGxG]")
        for grid in entry["grids"]:
            _grid_ranks(str(grid))
    references = data.get("references") or {}
    for system, by_site in references.items():
        for site, by_grid in (by_site or {}).items():
            if site not in sites:
                raise ReferenceError(f"{path}: references.{system}.{site}: not a site of sites: "
                                     f"({', '.join(sites)})")
            for grid, foms in (by_grid or {}).items():
                for fom, value in (foms or {}).items():
                    if fom not in FIELDS:
                        raise ReferenceError(f"{path}: references.{system}.{site}.{grid}.{fom}: not a figure of "
                                             f"merit ({', '.join(FIELDS)})")
                    _tuple(value, tolerances[fom], f"{path}: references.{system}.{site}.{grid}.{fom}")
    return {"path": path, "tolerances": tolerances, "sites": sites, "references": references}


def _pair(pair, where):
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
        raise ReferenceError(f"{where}: give [lower, upper], fractions of the reference (e.g. [-0.10, 0.05])")
    lower, upper = (None if v is None else float(v) for v in pair)
    if lower is not None and not -1.0 <= lower <= 0.0:
        raise ReferenceError(f"{where}: lower {lower} must be in [-1, 0] (ReFrame's lower threshold)")
    if upper is not None and upper < 0.0:
        raise ReferenceError(f"{where}: upper {upper} must be >= 0 (ReFrame's upper threshold)")
    return lower, upper


def _tuple(value, tolerance, where):
    """``(value, lower, upper)`` of an entry: a number (the template's tolerance) or [value, lower, upper]."""
    if isinstance(value, (list, tuple)):
        if len(value) != 3:
            raise ReferenceError(f"{where}: give a value, or [value, lower, upper]")
        number, (lower, upper) = value[0], _pair(value[1:], where)
    else:
        number, (lower, upper) = value, tolerance
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number <= 0:
        raise ReferenceError(f"{where}: the reference value must be a positive number, got {number!r}")
    return float(number), lower, upper


def reference_of(template: dict, site: str, grid: str) -> dict:
    """ReFrame's ``reference`` of one (site, grid) case: ``{"SYSTEM:PARTITION": {fom: (value, lower, upper,
    unit)}}`` for every system that has values for it; a system without one measures and reports only."""
    out = {}
    for system, by_site in template["references"].items():
        foms = ((by_site or {}).get(site) or {}).get(grid) or {}
        entry = {}
        for fom, value in foms.items():
            number, lower, upper = _tuple(value, template["tolerances"][fom], fom)
            entry[fom] = (number, lower, upper, FIELDS[fom][2])
        if entry:
            out[system] = entry
    return out


def bounds(reference: float, lower, upper):
    """``(low, high)`` that a value must lie in for ``(reference, lower, upper)``: ReFrame's
    ``reference_bounds`` (``reference x (1 + threshold)``, the thresholds negated for a negative reference;
    ``None``: unbounded)."""
    def bound(threshold, infinite):
        if threshold is None:
            return infinite
        if reference == 0:
            return threshold
        return reference * (1 + (-threshold if reference < 0 else threshold))

    return bound(lower, -math.inf), bound(upper, math.inf)


def within(value: float, reference: float, lower, upper) -> bool:
    """Whether ReFrame passes ``value`` against ``(reference, lower, upper)``."""
    low, high = bounds(reference, lower, upper)
    return low <= value <= high


def index_entries(path: str) -> list:
    """The valid JSON lines of one index file (a torn line is skipped)."""
    out = []
    with open(path) as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                out.append(row)
    return out


def fom_of(entry: dict, fom: str):
    """Figure of merit ``fom`` of an index entry, or None when the entry has no number for it."""
    field, scale, _ = FIELDS[fom]
    value = entry.get(field)
    return None if value is None else float(value) * scale


def index_value(path, run_id, fom):
    """Figure of merit ``fom`` of run ``run_id`` from the results index ``path`` (JSON lines; the last line
    of that run wins), or None when the index has no number for it (no data-sheet peak: no MFU)."""
    entry = None
    for row in index_entries(path):
        if row.get("run_id") == run_id:
            entry = row
    if entry is None:
        raise ValueError(f"{path}: no entry for run {run_id}")
    return fom_of(entry, fom)


def reference_from_runs(paths, grid: str, model: str = None, run_id: str = None, tolerances=None):
    """``(values, spreads, count)`` from the runs of ``grid`` (and ``model``, ``run_id`` when given) in the
    index files ``paths``: per figure of merit the median over the runs and the largest relative distance
    of a run from it. Only complete runs count."""
    rows = []
    for path in paths:
        for row in index_entries(path):
            if row.get("grid") != grid or row.get("status", "complete") != "complete":
                continue
            if model is not None and row.get("model") != model:
                continue
            if run_id is not None and row.get("run_id") != run_id:
                continue
            rows.append(row)
    values, spreads = {}, {}
    for fom in FIELDS:
        found = [v for v in (fom_of(r, fom) for r in rows) if v is not None and math.isfinite(v) and v > 0]
        if found:
            median = statistics.median(found)
            values[fom] = median
            spreads[fom] = max(abs(v - median) / median for v in found)
    return values, spreads, len(rows)


def entry_text(system: str, site: str, grid: str, values: dict, count: int) -> str:
    """The YAML lines of one reference entry, to paste under ``references:``."""
    foms = ", ".join(f"{fom}: {values[fom]:.6g}" for fom in FIELDS if fom in values)
    return (f"  # median of {count} run(s)\n  {json.dumps(system)}:\n    {site}:\n      {grid}: {{{foms}}}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="print a reference entry of the ReFrame check from the runs in results index files")
    parser.add_argument("index", nargs="+", help="results index files (index.jsonl) or globs of them: those the "
                                                 "check's output directories keep, or a results directory's")
    parser.add_argument("--system", required=True, help="ReFrame SYSTEM:PARTITION the runs ran on")
    parser.add_argument("--site", required=True, help="the fourd_mpi site of the template's sites:")
    parser.add_argument("--grid", required=True, help="the grid of the runs, G_data x G_z x G_y x G_x")
    parser.add_argument("--model", help="only runs of this model (default any)")
    parser.add_argument("--run-id", help=f"only runs with this id (the check's: {RUN_ID}; default any)")
    parser.add_argument("--references", help="the template whose tolerances apply (default $FOURD_REFRAME_REFERENCES, "
                                             "else packaging/reframe/references.yaml)")
    args = parser.parse_args(argv)
    try:
        _grid_ranks(args.grid)
        template = load_template(args.references)
    except (ReferenceError, OSError) as exc:
        print(f"fourd_reference: error: {exc}", file=sys.stderr)
        return 2
    paths = sorted({p for pattern in args.index for p in (glob.glob(pattern) or [pattern]) if os.path.isfile(p)})
    values, spreads, count = reference_from_runs(paths, args.grid, args.model, args.run_id)
    if not count:
        print(f"fourd_reference: error: no complete run of grid {args.grid} in {len(paths)} index file(s): give the "
              f"index files of the runs (each run's output directory keeps its index.jsonl)",
              file=sys.stderr)
        return 1
    sys.stdout.write(entry_text(args.system, args.site, args.grid, values, count))
    for fom, spread in spreads.items():
        lower, upper = template["tolerances"][fom]
        allowed = min(abs(t) for t in (lower, upper) if t is not None) if (lower, upper) != (None, None) else math.inf
        if spread > allowed:
            print(f"fourd_reference: note: {fom}: the runs lie up to {100 * spread:.1f} % from their median, more than "
                  f"the tolerance {100 * allowed:.0f} %: this reference would fail some of them (measure on quiet "
                  f"nodes, or widen tolerances.{fom})", file=sys.stderr)
    if count < 5:
        print(f"fourd_reference: note: {count} run(s): measure 5 or more for a reference", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
