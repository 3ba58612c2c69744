"""The model at the paper's scale: GPU memory (mixed precision, recompute, fused
attention, margins), device-driven overlap with compute windows, tune's default memory limit, and
``fourd-mpi model paper``. Known answers computed by hand."""

import os
import subprocess
import sys

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import load_profile
from fourd_mpi.perf.memory import GPU_RUNTIME_RESERVE_BYTES, estimate_memory, parameter_elements
from fourd_mpi.perf.predict import Link, compute_time, predict
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig, resolve_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = ModelConfig("m", "mlp", layers=3, hidden=8, heads=1, ffn_hidden=16, seq=4, batch=4)
GPT = ModelConfig("g", "gpt", layers=2, hidden=16, heads=4, ffn_hidden=64, seq=8, batch=4)


def cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fourd_mpi", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


# --- memory ------------------------------------------------------------------------------------

def test_mixed_precision_adds_an_fp32_master_copy_and_fp32_moments():
    g = GridShape(1, 2, 2, 2)  # fc1 [16, 8] block [8, 4] shard 16; fc2 shard 16: 32 elements per block, 3 blocks
    n = 3 * 32
    bf = estimate_memory(MLP, g, dtype="bfloat16", overlap=OverlapConfig())
    assert (bf.weights, bf.gradients, bf.master, bf.optimizer) == (2 * n, 2 * n, 4 * n, 8 * n)
    f32 = estimate_memory(MLP, g, dtype="float32", overlap=OverlapConfig())
    assert (f32.weights, f32.master, f32.optimizer) == (4 * n, 0, 8 * n)  # float32: no master copy
    pure = estimate_memory(MLP, g, dtype="float16", precision="pure", overlap=OverlapConfig())
    assert (pure.master, pure.optimizer) == (0, 4 * n)
    sgd = estimate_memory(MLP, g, dtype="bfloat16", optimizer="sgd", overlap=OverlapConfig())
    assert (sgd.master, sgd.optimizer) == (4 * n, 0)
    assert bf.total == sum(v for k, v in bf.as_dict().items() if k != "total")


def test_optimizer_sharded_over_data_divides_master_and_moments():
    g = GridShape(4, 1, 2, 1)  # fc1 block [8, 8] = 64, fc2 [8, 8] = 64: 128 elements per block, 3 blocks
    n = 3 * 128
    plain = estimate_memory(MLP, g, dtype="bfloat16", overlap=OverlapConfig())
    shard = estimate_memory(MLP, g, dtype="bfloat16", overlap=OverlapConfig(), shard_optimizer="data")
    assert (plain.master, plain.optimizer) == (4 * n, 8 * n)
    assert (shard.master, shard.optimizer) == (4 * n // 4, 8 * n // 4)
    assert shard.weights == plain.weights and shard.gradients == plain.gradients


def test_activations_with_recompute_by_hand():
    g = GridShape(1, 1, 2, 2)  # m = 4*4 = 16 tokens, h/x = 4, f/y = 8
    m, hx, fy, e = 16, 4, 8, 4
    block = m * (hx + 2 * fy)  # x, u, g
    extra = 2 * m * hx + m * fy  # input + target, one transient [m, f/y]
    none = estimate_memory(MLP, g, overlap=OverlapConfig(), recompute="none").activations
    full = estimate_memory(MLP, g, overlap=OverlapConfig(), recompute="full").activations
    assert none == (3 * block + extra) * e
    assert full == (3 * m * hx + block + extra) * e  # block inputs + one block's working set


def test_attention_probabilities_fused_and_selective():
    g = GridShape(1, 1, 2, 1)  # m = 32 tokens, 4 sequences, 2 heads per rank, s = 8
    probs, lse = 4 * 2 * 8 * 8, 4 * 2 * 8
    e = 4
    unfused = estimate_memory(GPT, g, overlap=OverlapConfig())
    fused = estimate_memory(GPT, g, overlap=OverlapConfig(), attention="fused")
    selective = estimate_memory(GPT, g, overlap=OverlapConfig(), recompute="selective")
    # two blocks keep probabilities (or the log-sum-exp); the unfused transient is an s x s score too:
    # max(probs 512, m*f/y = 32*32 = 1024) = 1024 both ways, so only the saved part differs
    assert unfused.activations - fused.activations == 2 * (probs - lse) * e
    assert unfused.activations - selective.activations == 2 * (probs + 32 * 8) * e  # and the context [m, h/y]
    with pytest.raises(ConfigError, match="unknown recompute 'some'"):
        estimate_memory(GPT, g, recompute="some")


def test_required_adds_the_margin_and_the_gpu_reserve():
    est = estimate_memory(MLP, GridShape(1, 2, 2, 2), overlap=OverlapConfig())
    assert est.required() == -(-est.total * 110 // 100)
    assert est.required(GPU_RUNTIME_RESERVE_BYTES, margin=0.0) == est.total + 2 ** 30


# --- device-driven overlap: the Link ------------------------------------------------------------

def test_link_exposes_exactly_what_its_window_cannot_hide():
    link = Link(efficiency=1.0)
    item = link.issue(("z", "allgather"), 5.0)
    link.compute(3.0)  # a window of 3 s behind a 5 s collective
    link.wait(item)
    assert link.exposed[("z", "allgather")] == pytest.approx(2.0)
    assert link.hidden[("z", "allgather")] == pytest.approx(3.0)
    zero = Link(1.0)
    zero.wait(zero.issue(("y", "allreduce"), 4.0))  # no window: all of it
    assert zero.exposed[("y", "allreduce")] == 4.0
    short = Link(0.5)  # half the compute time is usable: a 1 s collective hides fully behind 2 s
    it = short.issue(("x", "allreduce"), 1.0)
    short.compute(2.0)
    short.wait(it)
    assert short.exposed.get(("x", "allreduce"), 0.0) == 0.0


def test_link_is_first_in_first_out_and_blocking_does_not_advance_it():
    link = Link(1.0)
    first = link.issue(("z", "reduce_scatter"), 2.0)
    second = link.issue(("y", "allreduce"), 1.0)
    link.blocking(("x", "allreduce"), 7.0)  # the rank waits 7 s on a blocking collective: the queue stays
    link.compute(1.5)
    link.wait(second)  # the 0.5 s left of the first is waited for as well
    assert link.exposed[("x", "allreduce")] == 7.0
    assert link.exposed[("z", "reduce_scatter")] == pytest.approx(0.5)
    assert link.exposed[("y", "allreduce")] == pytest.approx(1.0)
    assert first[0] == 0 and not link.queue


def _gpu_profile(tmp_path, beta, efficiency=1.0):
    text = f"""name: gpu-synth
backend: cupy
node: {{ranks_per_node: 4, cores_per_node: 4}}
compute: {{gemm_tflops: {{float32: 0.000001}}, mem_bandwidth_gbs: 1000000.0, op_overhead_s: 0.0, device_memory_gib: 1.0}}
progress: {{overlap_efficiency: {efficiency}, host_driven: false}}
levels:
  intra:
    shared_by: 4
    allgather: {{alpha_s: 0.0, beta_s_per_byte: {beta:.3e}}}
    reduce_scatter: {{alpha_s: 0.0, beta_s_per_byte: {beta:.3e}}}
    allreduce: {{alpha_s: 0.0, beta_s_per_byte: {beta:.3e}}}
"""  # noqa: E501 (its compute: line is one line of YAML that a line break would change)
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    return load_profile(str(path))


def test_device_regime_dp_allreduce_behind_the_backward(tmp_path):
    """Pure data parallelism on 2 GPUs: the gradient all-reduces are the only communication. Without dp all of
    it is exposed; with dp each hides behind the backward of the layers after it, and the last layer's
    (the first in forward order, issued last) is exposed: step = compute + what the windows could not hide."""
    cfg = ModelConfig("m", "mlp", layers=1, hidden=8, heads=1, ffn_hidden=16, seq=4, batch=4)
    grid = GridShape(2, 1, 1, 1)
    prof = _gpu_profile(tmp_path, 1e-6)
    off = predict(cfg, grid, prof, OverlapConfig(), optimizer="sgd")
    on = predict(cfg, grid, prof, OverlapConfig(dp=True), optimizer="sgd")
    comp = compute_time(cfg, grid, prof, OverlapConfig(), "float32", 2, "sgd")
    assert off.exposed_total_s == pytest.approx(off.comm_total_s)
    # fc2 (backward first) issues its all-reduce (t2) before fc1's backward (window w1 = 2 GEMMs of fc1);
    # fc1's all-reduce (t1) has no window left: exposed = max(0, t2 - w1) + t1
    per_flop = comp["gemm_per_flop"]
    m = 2 * 4
    w1 = 2 * 2.0 * m * 16 * 8 * per_flop
    t = 2 * (1 / 2) * 128 * 4 * 1e-6  # ring all-reduce of fc1's (= fc2's) 128 float32 gradients on 2 ranks
    loss = 2 * (1 / 2) * 8 * 1e-6  # the loss (one float64) over data, blocking
    assert on.comm_total_s == pytest.approx(2 * t + loss)
    assert on.exposed_total_s == pytest.approx(max(0.0, t - w1) + t + loss)
    assert w1 > t  # here fc2's all-reduce hides fully
    assert on.step_s == pytest.approx(on.compute_s + on.exposed_total_s)
    free = predict(cfg, grid, _gpu_profile(tmp_path, 0.0), OverlapConfig.parse("all"), optimizer="sgd")
    assert free.exposed_total_s == 0.0


def test_device_regime_full_recompute_costs_a_forward_and_its_allreduces(tmp_path):
    cfg = resolve_model("gpt-tiny", batch=8)
    grid = GridShape(1, 1, 2, 2)
    prof = _gpu_profile(tmp_path, 1e-9)
    none = compute_time(cfg, grid, prof, OverlapConfig(), "float32", 4)
    full = compute_time(cfg, grid, prof, OverlapConfig(), "float32", 4, recompute="full")
    assert full["gemm"] == pytest.approx(none["gemm"] * 4 / 3)
    assert full["total"] == pytest.approx(none["total"] + full["recompute"])
    p_none = predict(cfg, grid, prof, OverlapConfig())
    p_full = predict(cfg, grid, prof, OverlapConfig(), recompute="full")
    fwd = sum(t for (axis, op), t in p_none.comm_s.items() if op == "allreduce")
    assert p_full.comm_total_s > p_none.comm_total_s and p_full.comm_total_s < p_none.comm_total_s + fwd


def test_host_driven_profiles_keep_the_efficiency_times_window_model():
    """CPU profiles take the old path: overlap hides efficiency * min(t, window), nothing with progress none."""
    cfg = resolve_model("gpt-small", layers=2, batch=8)
    prof = load_profile("laptop")
    assert prof.host_driven
    stuck = predict(cfg, GridShape(1, 2, 2, 2), prof, OverlapConfig.parse("all"), progress="none")
    assert stuck.exposed_total_s == pytest.approx(stuck.comm_total_s)


# --- tune's memory limit and model paper --------------------------------------------------------

def test_tune_drops_grids_over_the_device_memory_by_default():
    proc = cli("tune", "--ranks", 8, "--model", "gpt-5b", "--batch", 64, "--site", "frontier", "--dtype", "float16",
               "--recompute", "full", "--top", 2)
    assert proc.returncode == 0, proc.stderr
    assert "memory limit: 64 GiB per rank (profile frontier's device memory" in proc.stdout
    assert "x 1.10 (allocator margin) + 1 GiB (GPU runtime reserve)" in proc.stdout
    assert "2 of 20 grids dropped: 2 memory (e.g. 1x1x1x8: needs " in proc.stdout
    assert "float16 (mixed precision)" in proc.stdout and "need GiB" in proc.stdout
    off = cli("tune", "--ranks", 8, "--model", "gpt-5b", "--batch", 64, "--site", "frontier", "--dtype", "float16",
              "--recompute", "full", "--top", 2, "--memory-limit", "none")
    assert off.returncode == 0 and "memory limit: none (--memory-limit none)" in off.stdout
    assert "all 20 grids are valid" in off.stdout
    bad = cli("tune", "--ranks", 8, "--model", "gpt-small", "--memory-limit", "lots")
    assert bad.returncode == 2 and "--memory-limit" in bad.stderr


def test_paper_percent_of_peak_formula_and_megatron_grid():
    from fourd_mpi.perf.paper import megatron_grid, model_case

    prof = load_profile("perlmutter")
    case = model_case("gpt-5b", 64, prof, 80.0, batch=128)
    best = case.best
    hw = 96 * 128 * 2048 * 24 * 4096 ** 2 * (1 + 2048 / (6 * 4096))
    assert case.hw_flops() == pytest.approx(hw)
    assert case.pct_peak(best) == pytest.approx(100 * hw / (best.step_s * 64 * 312e12))
    assert best.memory.required(2 ** 30) <= 80 * 2 ** 30  # the best grid fits with the margin
    assert megatron_grid(64) == GridShape(16, 1, 4, 1) and case.megatron.grid == GridShape(16, 1, 4, 1)
    params = parameter_elements(case.cfg, GridShape(16, 1, 4, 1))  # sharded over the 16 data replicas
    assert case.megatron.memory.master == 4 * (-(-params // 16))
    with pytest.raises(ConfigError, match="not a multiple"):
        megatron_grid(6)


def test_model_paper_cli_prints_the_flagship_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "weak.png"
    proc = cli("model", "paper", "--series", "gpt-5b", "-o", png)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "predicted best grid (D x Z x Y x X): " in out and "HFU (96 convention, % of peak)" in out
    assert "57 %" in out and "182" in out and "26 %" in out
    assert "no pipeline algorithm yet" not in out and "Megatron-LM-like grid 256x1x4x1" in out
    assert "Megatron-LM with its pipeline (PTD-P" in out
    assert "HFU = 96 B s l h^2 (1 + s/6h) / (t_step * GPUs * peak)" in out and "data sheet" in out
    assert png.stat().st_size > 10_000
    bad = cli("model", "paper", "--series", "gpt-3b")
    assert bad.returncode == 2 and "--series: unknown gpt-3b" in bad.stderr


# --- the compute terms from sourced constants -------------------------------------------------

def test_unfused_attention_bmm_roofline_on_a_gpu_known_answer():
    """Head size d = 64, fp16, A100 (rate 248 TFLOP/s, 1,800 GB/s measured): the batched GEMMs move 6 passes
    of the s x s scores for 12 d s^2 FLOPs per head: factor e rate / (2 d bw) = 2 x 248e12 / (2 x 64 x 1800e9)
    = 2.153."""
    prof = load_profile("dgx-a100")
    g = GridShape(1, 1, 1, 1)
    small = ModelConfig("s", "gpt", layers=2, hidden=512, heads=8, ffn_hidden=2048, seq=1024, batch=2)  # d = 64
    rate, bw = 248.0e12, 1800.0e9
    flops = 2 * 12.0 * small.batch * small.seq * small.seq * small.hidden
    t = compute_time(small, g, prof, OverlapConfig(), "float16", 8, attention="unfused")
    factor = 2 * rate / (2 * 64 * bw)
    assert factor == pytest.approx(2.153, abs=1e-3)
    assert t["attention"] == pytest.approx(flops * factor / rate, rel=1e-12)
    fused = compute_time(small, g, prof, OverlapConfig(), "float16", 8, attention="fused")
    assert fused["attention"] == pytest.approx(flops / rate, rel=1e-12)  # flash attention: compute-bound
    wide = ModelConfig("w", "gpt", layers=2, hidden=2048, heads=8, ffn_hidden=8192, seq=1024, batch=2)  # d = 256
    w = compute_time(wide, g, prof, OverlapConfig(), "float16", 8, attention="unfused")
    assert w["attention"] == pytest.approx(2 * 12.0 * 2 * 1024 * 1024 * 2048 / rate, rel=1e-12)
    cpu = compute_time(small, g, load_profile("laptop"), OverlapConfig(), "float32", 1, attention="unfused")
    assert cpu["attention"] > 0  # CPU profiles keep the GEMM-rate attention (no roofline)


def test_mixed_precision_adam_step_bytes_known_answer():
    """Megatron-LM's fp16 optimizer step moves 60 bytes per parameter (fp32 state); pure precision 14 passes
    of the dtype."""
    from fourd_mpi.perf.memory import parameter_elements
    from fourd_mpi.perf.predict import ADAM_CALLS, MIXED_ADAM_BYTES

    prof = load_profile("dgx-a100")
    g = GridShape(1, 1, 1, 1)
    n = parameter_elements(GPT, g)
    calls = ADAM_CALLS * (4 * GPT.layers + 4 * GPT.layers) * prof.op_overhead_s  # 4 FC + 4 LayerNorm params
    mixed = compute_time(GPT, g, prof, OverlapConfig(), "float16", 8)["optimizer"]
    assert MIXED_ADAM_BYTES == 6 + 8 + 4 + 8 + 28 + 6
    assert mixed == pytest.approx(60 * n / 1800.0e9 + calls, rel=1e-9)
    pure = compute_time(GPT, g, prof, OverlapConfig(), "float16", 8, precision="pure")["optimizer"]
    assert pure == pytest.approx(14 * n * 2 / 1800.0e9 + calls, rel=1e-9)
