"""The output of ``bench collectives`` (pure: no MPI): the formulas the report states (:data:`FORMULAS`), the
nccl-tests style text tables, the CSV rows and the JSON document of a result of
:func:`fourd_mpi.run.collbench.run_bench` (:func:`format_result`), the sums the command exits on
(:func:`total_wrong`, :func:`avg_busbw`), and rank 0's report while the sweep runs (:class:`StreamReport`)."""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from fourd_mpi.core.colltable import ALPHA_BETA_FORMULA, BUSBW_FORMULA_SHORT
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.calibration import Row
from fourd_mpi.run.collbench_plan import PROGRESS_EVERY_S, Item, progress_line, step_message_lines

FORMULAS = [
    "latency: median over iterations on each rank, max over ranks; size S = nccl-tests size "
    "(gathered buffer / full input / buffer)",
    f"algbw = S / latency;  {BUSBW_FORMULA_SHORT}",
    "OSU overlap % = max(0, 100 - 100*(t_ovrl - t_cpu)/t_pure), averaged over ranks",
    "IMB-NBC overlap % = 100*max(0, min(1, (t_pure + t_cpu - t_ovrl)/max(t_pure, t_cpu))), slowest rank's times",
    f"fit: {ALPHA_BETA_FORMULA} (least squares on relative error, nonblocking forms)",
]


#: the column heads of a (communicator, op) block of the text report, two lines (names, units)
TABLE_HEAD = (f"#{'size':>11} {'count':>10} {'type':>6} {'redop':>6} {'root':>5} | {'time':>9} {'algbw':>7} "
              f"{'busbw':>7} {'#wrong':>6} {'iters':>6} | {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} "
              f"{'iters':>6} | {'avg':>9} {'min':>9} {'max':>9}")
TABLE_UNITS = (f"#{'(B)':>11} {'(elements)':>10} {'':>6} {'':>6} {'':>5} | {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} "
               f"{'':>6} {'':>6} | {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'':>6} | {'(us)':>9} {'(us)':>9} "
               f"{'(us)':>9}")


def table_head(result: Dict) -> List[str]:
    """The ``#`` lines that open the text report: ranks, nodes, grids, the formulas, the iteration rule, the
    bound on the whole sweep and the communicators (all known before anything is measured)."""
    lines = ["# fourd-mpi bench collectives: " + f"{result['world_size']} ranks, {result['num_nodes']} node(s), "
             f"grids {', '.join(result['grids'])}; type float (float32), redop sum (none for allgather), root -1"]
    lines += [f"# {f}" for f in FORMULAS]
    if result.get("rule"):
        lines.append(f"# iterations: {result['rule']} (column iters)")
    if result.get("bound"):
        lines.append(f"# bound: {result['bound']}")
    for c in result.get("comms", []):
        also = (f" (measured once for all {len(c['axes'])}: same group size and placement)"
                if len(c["axes"]) > 1 else "")
        lines.append(f"# communicator {' = '.join(c['axes'])}: p = {c['p']}, {c['level']}-node{also}")
    return lines


def table_block_head(row: "Row") -> List[str]:
    """The lines that open the block of one communicator and op (``row``: any row of it)."""
    return ["", f"# {row.op} on {row.axes or row.comm} ({row.level}-node, p = {row.p}):   out-of-place   |   "
                "in-place   |   OSU latency over ranks (out-of-place)", TABLE_HEAD, TABLE_UNITS]


def table_row(placed: Dict[bool, "Row"]) -> str:
    """The line of one size: ``placed`` maps in-place (False/True) to its row (a placement not measured: n/a)."""
    oop, ip = placed.get(False), placed.get(True)

    def cells(r):
        if r is None:
            return f"{'n/a':>9} {'':>7} {'':>7} {'':>6} {'':>6}"
        return f"{r.lat_s * 1e6:>9.2f} {r.algbw:>7.3f} {r.busbw:>7.3f} {r.wrong:>6} {r.iters:>6}"

    ref = oop or ip
    return (f" {ref.size:>11} {ref.count:>10} {'float':>6} {ref.redop:>6} {-1:>5} | {cells(oop)} | "
            f"{cells(ip)} | {ref.avg_s * 1e6:>9.2f} {ref.min_s * 1e6:>9.2f} {ref.max_s * 1e6:>9.2f}")


def block_key(row: "Row") -> Tuple[str, str]:
    """The block of the text report a row belongs to: its communicator (every axis it stands for) and op."""
    return (row.axes or row.comm, row.op)


def table_tail(result: Dict) -> List[str]:
    """The lines after the rows: overlap, synchronization, the step's messages, compute, the closing lines."""
    lines: List[str] = []
    if result["overlap"]:
        w = max([13] + [len(o.get("axes") or o["comm"]) for o in result["overlap"]])
        lines += ["", "# overlap with a calibrated compute phase (NumPy 128x128 GEMMs), times in us:",
                  f"#{'comm':<{w}} {'p':>3} {'op':<16} {'size (B)':>10} {'t_pure':>9} {'t_cpu':>9} "
                  f"{'ovrl none':>9} {'OSU%':>6} {'IMB%':>6} {'ovrl poll':>9} {'OSU%':>6} {'IMB%':>6}"]
        for o in result["overlap"]:
            lines.append(f" {o.get('axes') or o['comm']:<{w}} {o['p']:>3} {o['op']:<16} {o['size']:>10} "
                         f"{o['t_pure'] * 1e6:>9.1f} "
                         f"{o['t_cpu'] * 1e6:>9.1f} {o['t_ovrl_none'] * 1e6:>9.1f} {o['osu_none']:>6.1f} "
                         f"{o['imb_none']:>6.1f} {o['t_ovrl_poll'] * 1e6:>9.1f} {o['osu_poll']:>6.1f} "
                         f"{o['imb_poll']:>6.1f}")
    if result.get("syncs"):
        lines += ["", "# synchronization: extra latency of an 8-byte Iallreduce right after compute "
                      "vs after a barrier:"]
        w = max([14] + [len(y.get("axes") or y["comm"]) for y in result["syncs"]])
        lines += [f"  {y.get('axes') or y['comm']:<{w}} p={y['p']:<3} {y['sync_s'] * 1e6:10.1f} us"
                  for y in result["syncs"]]
    if result.get("step_messages"):
        lines += [""] + step_message_lines(result["step_messages"], **result["step_model"])
    c = result["compute"]
    lines += ["", "# compute (per rank):"]
    for dtype, alone in c["alone"].items():
        lines.append(f"  GEMM {dtype}: {alone * 1e3:.2f} GFLOP/s alone, {c['all'][dtype] * 1e3:.2f} GFLOP/s with all "
                     f"{result['ranks_per_node']} ranks of the node computing (x{alone / c['all'][dtype]:.2f})")
    lines.append(f"  element-wise {c['mem_bandwidth_gbs']['alone']:.2f} GB/s alone; one small NumPy call "
                 f"{c['op_overhead_s']['alone'] * 1e6:.2f} us alone")
    if result.get("skipped_line"):
        lines += ["", f"# left out: {result['skipped_line']}"]
    placements = " and ".join(sorted({"in-place" if r.inplace else "out-of-place" for r in result["rows"]},
                                     reverse=True))
    lines += ["", f"# Out of bounds values : {total_wrong(result)} {'OK' if total_wrong(result) == 0 else 'FAILED'}",
              f"# Avg bus bandwidth    : {avg_busbw(result):.4f} GB/s (mean busbw of all "
              f"{sum(math.isfinite(r.busbw) for r in result['rows'])} rows: "
              f"{placements or 'none'})"]
    return lines


def format_tables(result: Dict) -> str:
    """The text report: nccl-tests-like rows per communicator and op (``#`` header lines with the
    formulas, out-of-place and in-place side by side, ``#wrong``), OSU's avg/min/max latency over
    ranks, the overlap table, compute rates and a closing average bus bandwidth line. Latencies
    in microseconds throughout. :class:`StreamReport` prints the same lines as they are measured:
    :func:`table_head`, then per block :func:`table_block_head` and a :func:`table_row` per size,
    then :func:`table_tail`."""
    lines = table_head(result)
    groups: Dict[Tuple[str, str], Dict[int, Dict[bool, Row]]] = {}
    for r in result["rows"]:
        groups.setdefault(block_key(r), {}).setdefault(r.size, {})[r.inplace] = r
    for by_size in groups.values():
        lines += table_block_head(next(iter(next(iter(by_size.values())).values())))
        lines += [table_row(placed) for _, placed in sorted(by_size.items())]
    return "\n".join(lines + table_tail(result))


def total_wrong(result: Dict) -> int:
    """Wrong result elements of every row (``#wrong``, each already summed over ranks)."""
    return sum(r.wrong for r in result["rows"])


def avg_busbw(result: Dict) -> float:
    """nccl-tests' closing "Avg bus bandwidth": the mean busbw (GB/s) of every row, NaN without rows."""
    busbw = [r.busbw for r in result["rows"] if math.isfinite(r.busbw)]
    return float(np.mean(busbw)) if busbw else float("nan")


def _finite(value):
    """JSON has no NaN or infinity: ``None`` instead (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


#: columns of ``--format csv`` (rows; one per communicator, op, size and placement)
CSV_COLUMNS = ["comm", "axes", "level", "p", "per_node", "op", "placement", "size", "count", "type", "redop", "root",
               "iters", "time_us", "algbw_gbps", "busbw_gbps", "wrong", "avg_lat_us", "min_lat_us", "max_lat_us"]


def csv_head() -> List[str]:
    """The lines that open ``--format csv``: ``#`` lines with the formulas, then the header row."""
    return [f"# {f}" for f in FORMULAS] + [",".join(CSV_COLUMNS)]


def csv_lines(rows: List["Row"]) -> List[str]:
    """One csv line per row (:data:`CSV_COLUMNS`)."""
    import csv
    import io

    buf = io.StringIO()
    csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n").writerows(r.as_dict() for r in rows)
    return buf.getvalue().splitlines()


def format_result(result: Dict, fmt: str) -> str:
    """``table`` (:func:`format_tables`), ``csv`` (:data:`CSV_COLUMNS`, ``#`` lines with the formulas
    first) or ``json`` (rows, overlap, synchronization, compute, formulas, communicators, ``wrong``,
    ``avg_busbw_gbps``, ``bound`` and ``sweep`` (:meth:`Budget.summary`: what the bound left out) and, when the
    command wrote one, ``profile``; NaN as null; times in us)."""
    if fmt == "table":
        return format_tables(result)
    rows = [r.as_dict() for r in result["rows"]]
    if fmt == "json":
        import json

        overlap = [{(f"{k}_us" if k.startswith("t_") else k): (v * 1e6 if k.startswith("t_") else v)
                    for k, v in o.items()} for o in result["overlap"]]
        syncs = [{(k if k != "sync_s" else "sync_us"): (v * 1e6 if k == "sync_s" else v) for k, v in y.items()}
                 for y in result.get("syncs", [])]
        compute = {k: v for k, v in result["compute"].items() if k != "op_overhead_s"}
        compute["op_overhead_us"] = {k: v * 1e6 for k, v in result["compute"]["op_overhead_s"].items()}
        doc = {"world_size": result["world_size"], "num_nodes": result["num_nodes"], "grids": result["grids"],
               "formulas": FORMULAS, "units": "latencies and times in us, bandwidths in GB/s (1e9 B/s), sizes in B",
               "communicators": result.get("comms", []), "rows": rows, "overlap": overlap, "sync": syncs,
               "compute": compute, "wrong": total_wrong(result), "avg_busbw_gbps": avg_busbw(result),
               "iterations": result.get("rule"), "step_model": result.get("step_model"),
               "step_messages": result.get("step_messages", []), "bound": result.get("bound"),
               "sweep": result.get("sweep")}
        if "profile" in result:
            doc["profile"] = result["profile"]
        return json.dumps(_finite(doc), indent=1, allow_nan=False)
    if fmt == "csv":
        return "\n".join(csv_head() + csv_lines(result["rows"]))
    raise ConfigError(f"--format must be table, csv or json, got {fmt!r}")


class StreamReport:
    """Rank 0's output while the sweep runs, as OSU and nccl-tests print: each size's line on ``out`` as soon
    as it is measured (``table``: :func:`table_head` before the first measurement, :func:`table_block_head`
    for each communicator and op, a :func:`table_row` per size, :func:`table_tail` at the end; ``csv``:
    :func:`csv_head`, then the rows; ``json``: one document at the end), flushed; and a progress line on ``err``
    (:func:`progress_line`) at each new communicator and op, before a measurement predicted to take
    ``every`` seconds or more, and otherwise at most every ``every`` seconds (0: none). What ``out`` receives in
    the end is :func:`format_result`'s text."""

    def __init__(self, fmt: str, out=None, err=None, every: float = PROGRESS_EVERY_S, clock=time.monotonic):
        import sys

        self.fmt, self.out, self.err = fmt, out or sys.stdout, err or sys.stderr
        self.every, self.clock = every, clock
        self._block: Optional[Tuple[str, str]] = None
        self._last: Optional[Tuple[float, Tuple]] = None

    def _write(self, lines: List[str]) -> None:
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()

    def begin(self, head: Dict) -> None:
        self._write(table_head(head) if self.fmt == "table" else csv_head() if self.fmt == "csv" else [])

    def rows(self, rows: List[Row]) -> None:
        """The rows of one size (one per placement measured)."""
        if not rows:
            return
        if self.fmt == "csv":
            self._write(csv_lines(rows))
        elif self.fmt == "table":
            lines = []
            if block_key(rows[0]) != self._block:
                self._block = block_key(rows[0])
                lines += table_block_head(rows[0])
            self._write(lines + [table_row({r.inplace: r for r in rows})])

    def note(self, text: str) -> None:
        """A progress line of its own (what runs before the sweep)."""
        if self.every > 0:
            self.err.write(f"fourd-mpi bench: {text}\n")
            self.err.flush()

    def progress(self, item: Item, i: int, total: int, elapsed: float, left: float, predicted: float = 0.0) -> None:
        if self.every <= 0:
            return
        now, key = self.clock(), (item.comm, item.op, item.what)
        if self._last is None or key != self._last[1] or now - self._last[0] >= self.every or predicted >= self.every:
            self.err.write(progress_line(item, i, total, elapsed, left) + "\n")
            self.err.flush()
            self._last = (now, key)

    def end(self, result: Dict) -> None:
        """What is left to print once everything is measured (and the profile is decided)."""
        if self.fmt == "table":
            self._write(table_tail(result))
        elif self.fmt == "json":
            self._write([format_result(result, "json")])
