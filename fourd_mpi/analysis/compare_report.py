"""The outputs of ``fourd-mpi compare``: a plain table, Markdown (for a CI summary or a pull request),
JSON, and JUnit XML (one test case per configuration, a ``failure`` for a regression, ``skipped``
for an unmatched one), each naming the statistics (:meth:`~fourd_mpi.analysis.compare.Settings.statistics_text`).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import List, Sequence

import numpy as np

from fourd_mpi.analysis.compare import VERDICTS, Comparison, Settings, binding_note, exit_status, plural
from fourd_mpi.util.table import markdown_escape
from fourd_mpi.util.table import render as render_table

FORMATS = ("table", "markdown", "json", "junit")
COLUMNS = ("configuration", "new", "baseline", "new median s", "old median s", "ratio", "CI", "p", "samples",
           "verdict")
#: the numbers (median step times, their ratio, p) right, the rest left, whatever the rows hold
ALIGN = tuple("right" if c in ("new median s", "old median s", "ratio", "p") else "left" for c in COLUMNS)


def _num(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}g}" if np.isfinite(value) else "-"


def _runs(side) -> str:
    if side is None:
        return "-"
    runs = side.run_ids[0] if len(side.run_ids) == 1 else f"{len(side.run_ids)} runs"
    return f"{runs} ({len(side.samples)} steps)"


def rows(comparisons: Sequence[Comparison]) -> List[List[str]]:
    out = []
    units = {"run": "runs", "step": "steps"}
    for c in comparisons:
        ci = f"[{_num(c.ci_low)}, {_num(c.ci_high)}]" if np.isfinite(c.ci_low) else "-"
        verdict = c.verdict.upper() if c.regression else c.verdict
        out.append([c.label, _runs(c.new), _runs(c.old), _num(c.new_median_s), _num(c.old_median_s),
                    _num(c.ratio), ci,
                    f"{c.p_value:.2g}" if np.isfinite(c.p_value) else "-",
                    plural(len(c.pairs), "pair") if c.unit == "paired" else units.get(c.unit, "-"),
                    verdict + (f": {c.note}" if c.note and c.verdict != "unmatched" else "")])
    return out


def summary_line(comparisons: Sequence[Comparison], settings: Settings) -> str:
    counts = {v: sum(c.verdict == v for c in comparisons) for v in VERDICTS}
    result = "REGRESSION" if exit_status(comparisons) else "ok"
    inconclusive = f"{counts['inconclusive']} inconclusive, " if counts["inconclusive"] else ""
    return (f"{result}: {counts['slower']} slower, {counts['faster']} faster, {counts['same']} same, {inconclusive}"
            f"{counts['unmatched']} unmatched (threshold {100 * settings.threshold:g}%, alpha {settings.alpha:g})")


def as_table(comparisons: Sequence[Comparison], settings: Settings) -> str:
    lines = render_table(rows(comparisons), COLUMNS, align=ALIGN).splitlines()
    for c in comparisons:
        if c.verdict == "unmatched":
            lines.append(f"unmatched: {c.label}: {c.note}")
    lines += unit_lines(comparisons)
    return "\n".join(lines + ["", settings.statistics_text(), summary_line(comparisons, settings)]) + "\n"


def unit_lines(comparisons: Sequence[Comparison]) -> List[str]:
    """One line per configuration that could only be compared step by step (too few runs), or whose runs were
    paired (the method and the number of pairs); then one line when some runs' ranks were not pinned
    (:func:`~fourd_mpi.analysis.compare.binding_note`)."""
    note = binding_note(comparisons)
    return [f"{c.label}: {c.unit_note}" for c in comparisons if c.unit_note] + ([note] if note else [])


def as_markdown(comparisons: Sequence[Comparison], settings: Settings) -> str:
    lines = render_table(rows(comparisons), COLUMNS, "markdown", align=ALIGN).splitlines()
    notes = [f"- {markdown_escape(text)}" for text in unit_lines(comparisons)]
    return "\n".join([f"**{summary_line(comparisons, settings)}**", ""] + lines + ([""] + notes if notes else [])
                     + ["", f"_{settings.statistics_text()}_"]) + "\n"


def as_json(comparisons: Sequence[Comparison], settings: Settings) -> str:
    return json.dumps({"statistics": settings.statistics_text(), "unit": settings.unit, "threshold": settings.threshold,
                       "alpha": settings.alpha, "confidence": settings.confidence, "resamples": settings.resamples,
                       "seed": settings.seed, "exit_status": exit_status(comparisons),
                       "summary": summary_line(comparisons, settings),
                       "binding_note": binding_note(comparisons) or None,
                       "comparisons": [c.as_dict() for c in comparisons]}, indent=1, allow_nan=False) + "\n"


def as_junit(comparisons: Sequence[Comparison], settings: Settings) -> str:
    """JUnit XML: one ``testsuite`` ``fourd-mpi compare``, one ``testcase`` per configuration (name: the
    configuration, time: the new median step time), ``failure`` on a regression, ``skipped`` when unmatched."""
    failures = sum(c.regression for c in comparisons)
    skipped = sum(c.verdict == "unmatched" for c in comparisons)
    counts = {"tests": str(len(comparisons)), "failures": str(failures), "errors": "0", "skipped": str(skipped)}
    root = ET.Element("testsuites", name="fourd-mpi compare", **counts)
    suite = ET.SubElement(root, "testsuite", name="fourd-mpi compare", **counts)
    props = ET.SubElement(suite, "properties")
    for name, value in (("statistics", settings.statistics_text()), ("unit", settings.unit),
                        ("threshold", f"{100 * settings.threshold:g}%"),
                        ("alpha", f"{settings.alpha:g}"), ("confidence", f"{settings.confidence:g}"),
                        ("resamples", str(settings.resamples)), ("seed", str(settings.seed)),
                        ("binding_note", binding_note(comparisons))):
        if not value:
            continue
        ET.SubElement(props, "property", name=name, value=value)
    for c, r in zip(comparisons, rows(comparisons)):
        case = ET.SubElement(suite, "testcase", classname="fourd_mpi.compare", name=c.label,
                             time=f"{c.new_median_s:.6f}" if np.isfinite(c.new_median_s) else "0")
        detail = ("; ".join(f"{k}: {v}" for k, v in zip(COLUMNS, r)) + f"; config key {c.key}"
                  + (f"; {c.unit_note}" if c.unit_note else ""))
        if c.regression:
            failure = ET.SubElement(case, "failure", type="regression",
                                    message=f"slower: ratio {_num(c.ratio)} (CI {r[6]}, p {r[7]}) beyond "
                                            f"{100 * settings.threshold:g}%")
            failure.text = detail + "\n" + settings.statistics_text()
        elif c.verdict == "unmatched":
            ET.SubElement(case, "skipped", message=f"unmatched: {c.note}")
        ET.SubElement(case, "system-out").text = detail
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def render(comparisons: Sequence[Comparison], settings: Settings, fmt: str) -> str:
    return {"table": as_table, "markdown": as_markdown, "json": as_json, "junit": as_junit}[fmt](comparisons, settings)
