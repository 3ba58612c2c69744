"""The algorithm axis in the analysis: every table, the figures' legends and titles, the exports.

Traces written before the algorithm axis (no ``algorithm`` key) read as ``axonn4d``.
"""

from __future__ import annotations

import json

import pytest
from test_analysis import hand_events, step_trace, write_trace

from fourd_mpi.analysis import export, plots
from fourd_mpi.analysis.tables import breakdown, breakdown_wide, collect, comm_table, compare, runs_table, scaling
from fourd_mpi.trace.read import load_trace

G = {"megatron1d": {"data": 1, "z": 1, "y": 8, "x": 1}, "fsdp": {"data": 1, "z": 8, "y": 1, "x": 1},
     "axonn4d": {"data": 1, "z": 2, "y": 2, "x": 2}}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Three 8-rank runs of one model and batch (megatron1d, fsdp, and an old trace without the key),
    a 4-rank megatron1d run (a scaling line) and an op-level megatron1d trace."""
    d = tmp_path_factory.mktemp("algorithms")
    step_trace(d / "m8.h5", 8, 1500, 256, G["megatron1d"], algorithm="megatron1d")
    step_trace(d / "f8.h5", 8, 1200, 256, G["fsdp"], algorithm="fsdp")
    step_trace(d / "old8.h5", 8, 1000, 256, G["axonn4d"])
    step_trace(d / "m4.h5", 4, 1000, 128, {"data": 1, "z": 1, "y": 4, "x": 1}, algorithm="megatron1d")
    op = write_trace(d / "op-m2.h5", hand_events(), world=2, grid={"data": 1, "z": 1, "y": 2, "x": 1},
                     algorithm="megatron1d", label="op")
    traces, problems = collect([str(d)])
    assert not problems
    return {t.metadata["run_id"]: t for t in traces}, load_trace(op)


def test_runs_and_compare_tables_carry_the_algorithm(mixed):
    traces, _ = mixed
    runs = runs_table(list(traces.values())).set_index("run_id")
    assert runs.loc["m8", "algorithm"] == "megatron1d" and runs.loc["f8", "algorithm"] == "fsdp"
    assert runs.loc["old8", "algorithm"] == "axonn4d"  # written before the key existed
    assert runs.loc["m8", "config_key"] == "gpt-tiny/megatron1d/none/poll"
    assert runs.loc["old8", "config_key"] == "gpt-tiny/none/poll"  # the default keeps its old key
    table = compare(runs.reset_index())
    eight = table[table.world_size == 8]
    assert list(eight.algorithm) == ["axonn4d", "fsdp", "megatron1d"]  # one group, fastest first
    assert list(eight.vs_best) == pytest.approx([1.0, 1.2, 1.5])


def test_scaling_lines_are_per_algorithm(mixed):
    traces, _ = mixed
    table = scaling(runs_table(list(traces.values())), "weak")
    line = table[table.config_key == "gpt-tiny/megatron1d/none/poll"]
    assert list(line.world_size) == [4, 8] and set(line.algorithm) == {"megatron1d"}
    assert list(line.efficiency) == pytest.approx([1.0, 1000 / 1500])


def test_breakdown_and_comm_carry_the_algorithm(mixed):
    _, op = mixed
    long = breakdown(op)
    assert set(long.algorithm) == {"megatron1d"}
    assert list(breakdown_wide(long).algorithm) == ["megatron1d"]
    assert set(comm_table(op).algorithm) == {"megatron1d"}


def test_figures_name_the_algorithm_by_its_usual_name(mixed, tmp_path):
    traces, op = mixed
    runs = runs_table(list(traces.values()))
    labels = plots.run_labels(list(runs.run_id), runs)
    assert labels["m8"].startswith("Megatron-LM 1D\n8 ranks, grid 1x1x8x1")
    assert labels["f8"].startswith("FSDP (ZeRO-3)") and labels["old8"].startswith("AxoNN 4D")
    # a figure of axonn4d runs alone keeps its old labels
    only_old = runs[runs.run_id == "old8"]
    assert plots.run_labels(["old8"], only_old)["old8"].startswith("8 ranks, grid 1x2x2x2")
    # titles: one non-default algorithm is named in the title
    assert plots.algorithm_title(runs[runs.algorithm == "megatron1d"]) == ", Megatron-LM 1D"
    assert plots.algorithm_title(runs) == ""
    out = plots.plot_scaling(scaling(runs, "weak"), tmp_path / "weak.png", mode="weak")
    assert (tmp_path / "weak.png").stat().st_size > 0 and out.endswith("weak.png")
    fig, _ = plots.timeline_figure(op)
    assert "Megatron-LM 1D" in fig.axes[0].get_title()


def test_exports_carry_the_algorithm(mixed, tmp_path):
    traces, op = mixed
    perfetto = export.to_perfetto(op)
    assert perfetto["metadata"]["algorithm"] == "megatron1d"
    assert perfetto["metadata"]["algorithm_name"] == "Megatron-LM 1D"
    caliper = export.to_caliper_json(op)
    assert caliper["algorithm"] == "megatron1d" and caliper["algorithm_name"] == "Megatron-LM 1D"
    old = load_trace(write_trace(tmp_path / "old-op.h5", hand_events(), world=2))  # no algorithm key
    export.write_caliper_json(old, str(tmp_path / "old.json"))
    assert json.loads((tmp_path / "old.json").read_text())["algorithm"] == "axonn4d"
