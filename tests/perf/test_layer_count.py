"""The model prices one block and counts it L times: its predictions are the floats of adding every layer's
seconds (tests/helpers/per_layer_model.py, the layer-by-layer model with exact sums), and a prediction of
65,536 layers is as much work as one of a few. Offline: no MPI; nothing here asserts a time."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from fractions import Fraction

import per_layer_model
import pytest
from conftest import REPO, mpi_env

from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf import optimus3d
from fourd_mpi.perf.exact import ExactSum, Sums, expansion
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.predict import Link, predict, replay_blocks
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import resolve_model

LAYERS = [1, 2, 3, 7, 17]
OVERLAPS = [("none", 1), ("all", 1), ("ors,dp", 1), ("oar,dp", 1), ("od", 1), ("ors", 1), ("oag,cache", 5)]


def _synthetic(tmp_path, host_driven: bool, beta: float, name: str):
    """A one-level profile whose network takes ``beta`` seconds per byte: slow enough (1e-3) that a layer's
    reduce-scatter outlasts the backward pass (host-driven: every window counted layer by layer) and the
    device-driven queue grows from block to block (no state repeats: every block runs)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""name: {name}
backend: {"numpy" if host_driven else "cupy"}
node: {{ranks_per_node: 64, cores_per_node: 64}}
compute: {{gemm_tflops: {{float32: 0.001}}, mem_bandwidth_gbs: 10.0, op_overhead_s: 1.0e-6, device_memory_gib: 1.0}}
progress: {{overlap_efficiency: 0.7, host_driven: {str(host_driven).lower()}}}
levels:
  intra:
    shared_by: 4
    allgather: {{alpha_s: 1.0e-6, beta_s_per_byte: {beta:.3e}}}
    reduce_scatter: {{alpha_s: 1.0e-6, beta_s_per_byte: {beta:.3e}}}
    allreduce: {{alpha_s: 1.0e-6, beta_s_per_byte: {beta:.3e}}}
""")
    return load_profile(str(path))


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profiles")
    return {"laptop": load_profile("laptop"), "perlmutter": load_profile("perlmutter"),
            "host-slow": _synthetic(tmp, True, 1e-3, "host-slow"), "gpu-slow": _synthetic(tmp, False, 1e-3, "gpu-slow"),
            "gpu-fast": _synthetic(tmp, False, 1e-12, "gpu-fast")}


def _overlap(text, depth):
    return OverlapConfig.parse(text, prefetch_depth=depth, chunks=3)


def _same(pred, reference):
    comm, exposed, wire, step = reference
    assert pred.comm_s == comm
    assert pred.exposed_s == exposed
    assert pred.wire_bytes == wire
    assert pred.step_s == step


@pytest.mark.parametrize("profile", ["laptop", "perlmutter", "host-slow", "gpu-slow", "gpu-fast"])
@pytest.mark.parametrize("model", ["gpt-tiny", "mlp-tiny"])
def test_tensor4d_is_the_layer_by_layer_prediction(profiles, profile, model):
    prof = profiles[profile]
    for layers, (text, depth), recompute, grid, progress in itertools.product(
            LAYERS, OVERLAPS, ["none", "full"], [(2, 2, 2, 2), (1, 2, 2, 1), (2, 1, 1, 2)], ["poll", "none"]):
        if progress == "none" and not prof.host_driven:
            continue
        cfg, g, overlap = resolve_model(model, layers=layers, batch=16), GridShape(*grid), _overlap(text, depth)
        case = (layers, text, recompute, grid, progress)
        pred = predict(cfg, g, prof, overlap, "float32", progress, recompute=recompute)
        reference = per_layer_model.tensor4d(cfg, g, prof, overlap, "float32", progress, recompute=recompute)
        assert pred.step_s == reference[3], case
        _same(pred, reference)


@pytest.mark.parametrize("profile", ["laptop", "perlmutter", "host-slow", "gpu-slow"])
def test_optimus3d_is_the_layer_by_layer_prediction(profiles, profile):
    prof = profiles[profile]
    for model, layers, (text, depth), recompute, grid, progress in itertools.product(
            ["gpt-tiny", "mlp-tiny"], LAYERS, OVERLAPS, ["none", "selective", "full"], [(2, 2, 2, 2), (1, 4, 4, 4)],
            ["poll", "none"]):
        if progress == "none" and not prof.host_driven:
            continue
        cfg, g, overlap = resolve_model(model, layers=layers, batch=64), GridShape(*grid), _overlap(text, depth)
        pred = optimus3d.predict(cfg, g, prof, overlap, "float32", progress, recompute=recompute)
        reference = per_layer_model.optimus3d(cfg, g, prof, overlap, "float32", progress, recompute=recompute)
        assert pred.step_s == reference[3], (model, layers, text, recompute, grid, progress)
        _same(pred, reference)


def test_optimus3d_comm_buffers_are_the_listed_layers():
    """The buffers of every layer's blocks, counted without listing L copies of a block's."""
    for model, layers, ors in itertools.product(["gpt-tiny", "mlp-tiny"], LAYERS, [False, True]):
        cfg, grid = resolve_model(model, layers=layers, batch=64), GridShape(1, 4, 4, 4)
        q, m = grid.x, optimus3d.local_tokens(cfg, grid)
        blocks = sorted(((k // q) * (n // q) for _, n, k, _ in optimus3d.layers(cfg) * cfg.layers), reverse=True)
        widest = max(n for _, n, _, _ in optimus3d.layers(cfg))
        listed = sum(blocks) + sum(b + b // q for b in (blocks if ors else blocks[:1])) + m * widest + m * (widest // q)
        assert optimus3d.comm_buffer_elements(cfg, grid, OverlapConfig(ors=ors)) == listed


def test_pipeline_wire_bytes_are_stage_zeros_collectives():
    from fourd_mpi.perf.pipeline import PER_MICROBATCH_ROLES, micro_config, predict_pipeline
    from fourd_mpi.perf.volumes import step_collectives

    cfg, grid = resolve_model("gpt-tiny", layers=12, batch=16), GridShape(1, 2, 2, 1)
    for stages, microbatches in [(2, 1), (3, 2), (4, 4)]:
        pred = predict_pipeline(cfg, grid, load_profile("perlmutter"), stages=stages, microbatches=microbatches,
                                overlap=OverlapConfig.parse("all"))
        listed = {}
        for c in step_collectives(micro_config(cfg, stages, microbatches), grid, OverlapConfig.parse("all")):
            if c.role != "loss":
                listed[c.axis] = listed.get(c.axis, 0) + c.wire_bytes * (
                    microbatches if c.role in PER_MICROBATCH_ROLES else 1)
        assert {a: b for a, b in pred.wire_bytes.items() if a != "inter"} == listed


# -- exact sums -----------------------------------------------------------------------------------

@pytest.mark.parametrize("x", [0.1, 1 / 3, 2.0 ** -1074, 1e300, 6.02e23, -7.25e-5])
@pytest.mark.parametrize("n", [1, 3, 1000, 65536, 2 ** 40 + 1])
def test_a_term_added_n_times_is_exact(x, n):
    if not math.isfinite(x * n):
        pytest.skip("beyond the floats")
    s = ExactSum()
    s.add_times(x, n)
    s.add(1.0)
    assert Fraction(sum(Fraction(p) for p in s.parts)) == Fraction(x) * n + 1  # the parts are exact
    assert float(s) == float(Fraction(x) * n + 1)  # and their value correctly rounded


def test_sums_fold_without_losing_a_bit():
    s = ExactSum()
    values = [(-1) ** i * 10.0 ** (i % 37 - 18) / 7 for i in range(20000)]  # folds several times
    for v in values:
        s.add(v)
    assert len(s.parts) <= 4097
    assert float(s) == math.fsum(values)
    assert sum(map(Fraction, expansion(values))) == sum(map(Fraction, values))
    d = Sums()
    d.add("b", 1.0)
    d.add_times("a", 0.1, 10)
    d.add("b", 1e-17)
    assert list(d.floats()) == ["b", "a"] and d.floats()["a"] == math.fsum([0.1] * 10)


# -- the timeline's cost --------------------------------------------------------------------------

def _periodic(blocks, width, depth, queue_grows=False):
    """A timeline of ``blocks`` blocks: each position issues a transfer ``depth`` ahead and waits for its own
    (or, with ``queue_grows``, issues two transfers it never waits for and computes less than they take)."""
    link, issued, runs = Link(0.5), {}, []

    def position(p):
        runs.append(p)
        if queue_grows:
            link.issue(("z", "reduce_scatter"), 0.3)
            link.issue(("data", "allreduce"), 0.2)
            link.compute(0.1 * (1 + p % width))
            return
        for ahead in range(p, min(p + depth + 1, blocks * width)):
            if ahead not in issued:
                issued[ahead] = link.issue(("z", "allgather"), 0.25 + 0.125 * (ahead % width))
        link.wait(issued[p])
        link.compute(0.1 * (1 + p % width))
        link.blocking(("x", "allreduce"), 0.01)

    replay_blocks(link, blocks, width, depth, issued, position)
    link.wait_all()
    return link, runs


@pytest.mark.parametrize("width, depth", [(1, 0), (3, 1), (4, 5), (2, 9)])
def test_a_repeating_timeline_runs_a_few_blocks_and_counts_the_rest(width, depth):
    for blocks in (1, 2, 3, 5, 11, 40):
        fast, runs = _periodic(blocks, width, depth)
        full = Link(0.5)  # the same positions, every one run, for the reference
        issued = {}
        for p in range(blocks * width):
            for ahead in range(p, min(p + depth + 1, blocks * width)):
                if ahead not in issued:
                    issued[ahead] = full.issue(("z", "allgather"), 0.25 + 0.125 * (ahead % width))
            full.wait(issued[p])
            full.compute(0.1 * (1 + p % width))
            full.blocking(("x", "allreduce"), 0.01)
        full.wait_all()
        assert fast.exposed == full.exposed and fast.hidden == full.hidden, (blocks, width, depth)
    _, runs = _periodic(1_000_000, width, depth)
    assert len(runs) <= (4 + -(-depth // width)) * width  # the first blocks, one repeat, the cut tail


def test_a_timeline_whose_queue_grows_runs_every_block():
    link, runs = _periodic(200, 3, 0, queue_grows=True)
    assert runs == list(range(600))
    assert link.exposed and link.hidden


# -- the commands ---------------------------------------------------------------------------------

def fourd(*args):
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=mpi_env(), cwd=REPO)


@pytest.mark.parametrize("profile", ["laptop", "perlmutter"])
def test_tune_and_predict_at_the_largest_layer_count(profile):
    """65,536 layers (the most ``run`` and ``tune`` accept): ``tune`` ranks every algorithm and ``model predict``
    answers; the predicted step grows with the layers as the block's work does."""
    proc = fourd("tune", "--ranks", 16, "--layers", 65536, "--algorithm", "all", "--profile", profile, "--top", 3)
    assert proc.returncode == 0, proc.stderr
    assert "best configuration per algorithm" in proc.stdout
    grid = "2x2x2x2"
    steps = []
    for layers in (1024, 65536):  # laptop has no data-sheet peak for predict's FLOP rates: dgx-a100's
        proc = fourd("model", "predict", "--model", "gpt-tiny", "--layers", layers, "--batch", 16, "--grid", grid,
                     "--profile", "dgx-a100" if profile == "laptop" else profile, "--format", "json")
        assert proc.returncode == 0, proc.stderr
        steps.append(json.loads(proc.stdout)["step_s"])
    assert 32 < steps[1] / steps[0] < 96


def test_a_model_of_the_largest_layer_count_is_the_block_times_l():
    """Communication is per block: at 65,536 layers each (axis, op) is the one-block model's block part times
    65,536 plus the loss, exactly (the sums are exact)."""
    prof = load_profile("laptop")
    grid = GridShape(2, 2, 2, 2)
    big = predict(resolve_model("gpt-tiny", layers=65536, batch=16), grid, prof, OverlapConfig.parse("all"))
    one = predict(resolve_model("gpt-tiny", layers=1, batch=16), grid, prof, OverlapConfig.parse("all"))
    two = predict(resolve_model("gpt-tiny", layers=2, batch=16), grid, prof, OverlapConfig.parse("all"))
    for key, t1 in one.comm_s.items():
        block = Fraction(two.comm_s[key]) - Fraction(t1)  # float rounding: the loss part is tiny against it
        loss = Fraction(t1) - block
        assert big.comm_s[key] == pytest.approx(float(block * 65536 + loss), rel=1e-12)
    assert big.wire_bytes == {a: (two.wire_bytes[a] - one.wire_bytes[a]) * 65535 + one.wire_bytes[a]
                              for a in one.wire_bytes}

