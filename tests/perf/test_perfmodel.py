"""The performance model's pure parts: memory, volumes, machine profiles, predictions."""

import os

import pytest

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.machine import PROFILE_SCHEMA, axis_placement, builtin_profiles, load_profile
from fourd_mpi.perf.memory import estimate_memory
from fourd_mpi.perf.predict import predict
from fourd_mpi.perf.volumes import design_volume_elements, step_collectives, totals
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig, resolve_model

MLP = ModelConfig("m", "mlp", layers=1, hidden=8, heads=1, ffn_hidden=16, seq=4, batch=4)
GRIDS = [GridShape(1, 1, 1, 1), GridShape(1, 2, 2, 2), GridShape(2, 1, 2, 1), GridShape(1, 4, 1, 2),
         GridShape(4, 1, 1, 2), GridShape(1, 1, 4, 2)]


# --- memory --------------------------------------------------------------------------------

def test_memory_of_an_mlp_block_by_hand():
    # 1x2x2x2: m = 4*4/2 = 8 tokens; fc1 [16, 8] block [8, 4] = 32, shard 16; fc2 [8, 16] block [4, 8], shard 16
    est = estimate_memory(MLP, GridShape(1, 2, 2, 2), dtype="float64", optimizer="adam",
                          overlap=OverlapConfig())
    assert est.weights == (16 + 16) * 8
    assert est.gradients == est.weights and est.optimizer == 2 * est.weights
    # saved x [8, 4], u and g [8, 8]; input + target [8, 4] x 2; transient [8, 8]
    assert est.activations == (8 * 4 + 2 * 8 * 8 + 2 * 8 * 4 + 8 * 8) * 8
    # one gathered block (32), one dW block + shard (32 + 16), all-reduce send+recv of [8, 8]
    assert est.comm_buffers == (32 + 32 + 16 + 2 * 8 * 8) * 8
    assert est.total == sum(v for k, v in est.as_dict().items() if k != "total")


def test_memory_sgd_has_no_state_and_cache_keeps_every_block():
    cfg = resolve_model("gpt-tiny")
    g = GridShape(1, 2, 2, 2)
    assert estimate_memory(cfg, g, optimizer="sgd").optimizer == 0
    plain = estimate_memory(cfg, g, overlap=OverlapConfig())
    cached = estimate_memory(cfg, g, overlap=OverlapConfig(cache=True))
    # gpt-tiny blocks: qkv 192*64/4, proj 64*64/4, fc1 256*64/4, fc2 64*256/4 per layer, 2 layers
    blocks = 2 * (3072 + 1024 + 4096 + 4096)
    assert cached.comm_buffers - plain.comm_buffers == (blocks - 4096) * 4
    with pytest.raises(ConfigError, match="unknown optimizer"):
        estimate_memory(cfg, g, optimizer="lamb")


# --- volumes -------------------------------------------------------------------------------

@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_volumes_match_design_formulas(grid):
    cfg = resolve_model("gpt-tiny", batch=8)
    for cache in (False, True):
        colls = [c for c in step_collectives(cfg, grid, OverlapConfig(cache=cache), "float32")
                 if c.role in ("weight_allgather", "dw_reduce_scatter", "fwd_allreduce", "bwd_allreduce",
                               "grad_allreduce")]
        by_axis = {}
        for c in colls:
            by_axis[c.axis] = by_axis.get(c.axis, 0) + c.count * c.message_bytes / 4 * (
                (2 if c.op == "allreduce" else 1) * (c.p - 1) / c.p)
        design = design_volume_elements(cfg, grid, cache)
        for axis in ("x", "y", "z", "data"):
            assert by_axis.get(axis, 0.0) == pytest.approx(design[axis]), (axis, cache)


def test_volumes_by_hand_for_1x2x2x2():
    # MLP block, m = 8: fc1 normal [16, 8]: block [8, 4] = 32 el; fc2 transposed [8, 16]: block [4, 8] = 32 el
    tot = totals(step_collectives(MLP, GridShape(1, 2, 2, 2), OverlapConfig(), "float32"))
    assert tot[("allgather", "z")] == {"messages": 4, "bytes": 4 * 32 * 4, "wire_bytes": 4 * 32 * 4 // 2}
    assert tot[("reduce_scatter", "z")] == {"messages": 2, "bytes": 2 * 32 * 4, "wire_bytes": 2 * 32 * 4 // 2}
    # fwd all-reduce: fc1 over x of [8, 8], fc2 over y of [8, 4]; bwd: fc1 over y of [8, 4], fc2 over x of [8, 8]
    # plus the loss scalars over z and x
    assert tot[("allreduce", "x")]["bytes"] == (64 + 64) * 4 + 8
    assert tot[("allreduce", "y")]["bytes"] == (32 + 32) * 4
    assert ("allreduce", "data") not in tot
    # cache drops the backward all-gathers, chunks split messages but not bytes
    tot2 = totals(step_collectives(MLP, GridShape(1, 2, 2, 2), OverlapConfig(cache=True, od=True, chunks=4)))
    assert tot2[("allgather", "z")]["messages"] == 2
    assert tot2[("allreduce", "x")]["bytes"] == tot[("allreduce", "x")]["bytes"]
    assert tot2[("allreduce", "x")]["messages"] > tot[("allreduce", "x")]["messages"]


# --- profiles ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", builtin_profiles())
def test_builtin_profiles_validate(name):
    """Every shipped profile passes the schema check a profile file gets on load (finite numbers
    included): load_profile skips it for the built-ins (yamlspec.load_yaml's ``shipped``)."""
    from fourd_mpi.util.yamlspec import schema_violations

    p = load_profile(name)
    assert schema_violations(p.data, PROFILE_SCHEMA) == []
    assert p.gemm_tflops("float32") > 0


def _write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


ONE_LEVEL = """name: one
node: {ranks_per_node: 4, cores_per_node: 4}
compute: {gemm_tflops: {float32: 1.0}}
progress: {overlap_efficiency: 0.5}
levels:
  intra:
    shared_by: 4
    allgather: {alpha_s: 1.0e-6, beta_s_per_byte: 1.0e-9}
    reduce_scatter: {alpha_s: 1.0e-6, beta_s_per_byte: 1.0e-9}
    allreduce: {alpha_s: 1.0e-6, beta_s_per_byte: 1.0e-9}
"""


def test_profile_missing_a_level_says_what_to_do(tmp_path):
    prof = load_profile(_write(tmp_path, ONE_LEVEL))
    cfg = resolve_model("gpt-tiny", batch=8)
    predict(cfg, GridShape(1, 1, 2, 2), prof)  # 4 ranks: one node, fine
    with pytest.raises(ConfigError, match="has no 'inter' level.*fallback"):
        predict(cfg, GridShape(2, 1, 2, 2), prof)  # 8 ranks on 4-rank nodes: data crosses nodes
    fb = load_profile(_write(tmp_path, ONE_LEVEL), fallback="perlmutter")
    pred = predict(cfg, GridShape(2, 1, 2, 2), fb)
    assert any("fallback: perlmutter" in n for n in pred.notes)


def test_profile_schema_errors_name_the_key(tmp_path):
    bad = ONE_LEVEL.replace("    shared_by: 4\n", "")
    with pytest.raises(ConfigError, match=r"p.yaml:\d+: levels.intra: 'shared_by' is a required property"):
        load_profile(_write(tmp_path, bad))
    with pytest.raises(ConfigError, match="unknown machine profile 'nowhere'"):
        load_profile("nowhere")
    with pytest.raises(ConfigError, match="no GEMM rate for float64"):
        predict(resolve_model("gpt-tiny"), GridShape(1, 1, 2, 2), load_profile(_write(tmp_path, ONE_LEVEL)),
                dtype="float64")


def test_profile_of_a_subset_of_the_collectives(tmp_path):
    """A calibration of some collectives only (bench collectives --ops): the others come from the
    fallback (noted) or the model refuses saying what to do; a level with no fit at all is refused."""
    part = ONE_LEVEL.replace("    reduce_scatter: {alpha_s: 1.0e-6, beta_s_per_byte: 1.0e-9}\n", "")
    prof = load_profile(_write(tmp_path, part))
    assert prof.missing_fits() == ["intra:reduce_scatter"]
    assert prof.fit("intra", "allreduce", 4)[0].alpha_s == 1e-6
    with pytest.raises(ConfigError,
                       match="no reduce_scatter fit at the 'intra' level.*--ops including ireduce_scatter"):
        prof.fit("intra", "reduce_scatter", 4)
    fb = load_profile(_write(tmp_path, part), fallback="laptop")
    fit, _ = fb.fit("intra", "reduce_scatter", 4)
    assert fit == load_profile("laptop").fit("intra", "reduce_scatter", 4)[0]
    assert any("no reduce_scatter fit" in n and "fallback: laptop" in n for n in fb.notes)
    empty = part.replace("    allgather: {alpha_s: 1.0e-6, beta_s_per_byte: 1.0e-9}\n", "").replace(
        "    allreduce: {alpha_s: 1.0e-6, beta_s_per_byte: 1.0e-9}\n", "")
    with pytest.raises(ConfigError, match=r"levels.intra: .*the fit of at least one of allgather"):
        load_profile(_write(tmp_path, empty))


def test_placement():
    assert axis_placement(GridShape(2, 2, 2, 2), 4) == {"x": "intra", "y": "intra", "z": "inter", "data": "inter"}
    assert axis_placement(GridShape(1, 1, 8, 1), 4) == {"x": "-", "y": "inter", "z": "-", "data": "-"}
    assert axis_placement(GridShape(4, 1, 1, 1), 4)["data"] == "intra"


# --- predictions ---------------------------------------------------------------------------

def _synthetic(tmp_path, intra_beta, inter_beta, efficiency=0.0, host_driven=True):
    text = f"""name: synth
node: {{ranks_per_node: 4, cores_per_node: 4}}
compute: {{gemm_tflops: {{float32: 1.0}}, mem_bandwidth_gbs: 100.0, op_overhead_s: 0.0}}
progress: {{overlap_efficiency: {efficiency}, host_driven: {str(host_driven).lower()}}}
levels:
  intra:
    shared_by: 4
    allgather: {{alpha_s: 0.0, beta_s_per_byte: {intra_beta:.3e}}}
    reduce_scatter: {{alpha_s: 0.0, beta_s_per_byte: {intra_beta:.3e}}}
    allreduce: {{alpha_s: 0.0, beta_s_per_byte: {intra_beta:.3e}}}
  inter:
    shared_by: 4
    allgather: {{alpha_s: 0.0, beta_s_per_byte: {inter_beta:.3e}}}
    reduce_scatter: {{alpha_s: 0.0, beta_s_per_byte: {inter_beta:.3e}}}
    allreduce: {{alpha_s: 0.0, beta_s_per_byte: {inter_beta:.3e}}}
"""
    return load_profile(_write(tmp_path, text, "synth.yaml"))


def test_prediction_is_alpha_beta_of_the_volumes(tmp_path):
    prof = _synthetic(tmp_path, 1e-9, 1e-9)
    cfg = resolve_model("gpt-tiny", batch=8)
    grid = GridShape(1, 2, 2, 1)
    pred = predict(cfg, grid, prof)
    wire = sum(c.wire_bytes for c in step_collectives(cfg, grid))
    assert pred.comm_total_s == pytest.approx(wire * 1e-9, rel=1e-6)
    assert pred.exposed_total_s == pytest.approx(pred.comm_total_s)  # no overlap
    assert pred.step_s == pytest.approx(pred.compute_s + pred.exposed_total_s)


def test_ranking_with_a_slow_network_prefers_data_parallel_inside_nodes(tmp_path):
    """Inter-node bandwidth 1000x worse than intra: the tensor axes must stay inside the 4-rank nodes, so the
    winner of 8 ranks has G_data = 2 and tensor parallelism inside a node, or pure data parallelism."""
    from fourd_mpi.perf.tune import rank_grids

    prof = _synthetic(tmp_path, 1e-12, 1e-6)
    cfg = resolve_model("gpt-small", layers=2, batch=8)
    ranking = rank_grids(cfg, 8, prof)
    best = ranking.predictions[0]
    assert best.placement["x"] in ("intra", "-") and best.placement["y"] in ("intra", "-")
    assert best.placement["z"] in ("intra", "-")
    # every grid that puts a tensor axis across nodes is slower than the best
    for p in ranking.predictions[1:]:
        assert p.step_s >= best.step_s


def test_ranking_free_network_prefers_least_compute(tmp_path):
    """With free communication the fastest grid is the one with the least replicated work per rank."""
    from fourd_mpi.perf.tune import rank_grids

    prof = _synthetic(tmp_path, 0.0, 0.0)
    cfg = resolve_model("gpt-small", layers=2, batch=8)
    ranking = rank_grids(cfg, 8, prof)
    assert ranking.predictions[0].compute_s == min(p.compute_s for p in ranking.predictions)


def test_overlap_hides_only_with_progress(tmp_path):
    prof = _synthetic(tmp_path, 1e-9, 1e-9, efficiency=1.0)
    cfg = resolve_model("gpt-small", layers=2, batch=8)
    grid = GridShape(1, 2, 2, 2)
    none = predict(cfg, grid, prof, OverlapConfig())
    allo = predict(cfg, grid, prof, OverlapConfig.parse("all"), progress="poll")
    stuck = predict(cfg, grid, prof, OverlapConfig.parse("all"), progress="none")
    assert allo.exposed_total_s < none.exposed_total_s
    assert stuck.exposed_total_s == pytest.approx(allo.comm_total_s)
    assert any("progress none" in n for n in stuck.notes)


@pytest.mark.mpi
@pytest.mark.parametrize("nranks, model", [(4, ["gpt-tiny", "batch=8"]),
                                           (6, ["mlp-tiny", "batch=12", "hidden=48", "ffn_hidden=96"])])
def test_memory_matches_the_arrays_of_a_built_run(run_mpi, nranks, model):
    """Weights, gradients, Adam state and saved activations: estimate == sum of the real arrays' bytes."""
    from conftest import REPO

    proc = run_mpi(nranks, model, script=str(REPO / "tests" / "helpers" / "mpi_memory_check.py"), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "memory ok for" in proc.stdout


# -- calibration of the term weights (fourd-mpi model calibrate) ---------------------------

def test_fit_term_weights_recovers_known_weights():
    from fourd_mpi.core.grid import grid_factorizations
    from fourd_mpi.perf.machine import TERMS
    from fourd_mpi.perf.predict import fit_term_weights, term_features

    profile = load_profile("laptop")
    truth = {"gemm": 1.7, "attention": 9.0, "elementwise": 0.5, "calls": 30.0, "comm": 0.8, "sync": 0.0}
    features, measured = [], []
    for preset, batch in (("gpt-tiny", 8), ("gpt-small", 8)):
        cfg = resolve_model(preset, batch=batch)
        for grid in grid_factorizations(8):
            f = term_features(cfg, grid, profile)
            features.append(f)
            measured.append(sum(truth[t] * f[t] for t in TERMS))
    weights, predicted = fit_term_weights(features, measured)
    for term in ("gemm", "attention", "calls", "comm"):
        assert weights[term] == pytest.approx(truth[term], rel=0.02), (term, weights)
    assert max(abs(p - m) / m for p, m in zip(predicted, measured)) < 0.01


def test_fit_term_weights_needs_enough_runs():
    from fourd_mpi.perf.predict import fit_term_weights, term_features

    f = term_features(resolve_model("gpt-tiny"), GridShape(1, 2, 2, 2), load_profile("laptop"))
    with pytest.raises(ConfigError, match="at least"):
        fit_term_weights([f, f], [0.01, 0.01])


def test_model_calibrate_cli_on_sample_traces(tmp_path):
    import subprocess
    import sys

    from conftest import REPO, mpi_env

    samples = sorted(str(p) for p in (REPO / "results" / "samples").glob("*.h5"))
    out = tmp_path / "cal.yaml"
    cmd = [sys.executable, "-m", "fourd_mpi", "model", "calibrate", *samples, "--profile", "laptop", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "left out grid-1x2x2x2-overlap" in done.stderr  # overlapped runs do not fit the additive terms
    calibrated = load_profile(str(out))
    assert set(calibrated.data["step_fit"]["traces"]) == {os.path.basename(s)[:-3] for s in samples} - {
        "grid-1x2x2x2-overlap"}
    assert calibrated.term_weights != load_profile("laptop").term_weights
    # sync is left out of the fit by default (laptop has no sync term: its weight stays 1 and adds nothing)
    assert "fitted terms: gemm, attention, elementwise, calls, comm)" in calibrated.data["step_fit"]["description"]
    again = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=tmp_path)
    assert again.returncode == 2 and "--force" in again.stderr
    bad = subprocess.run(cmd + ["--force", "--terms", "gemm,bogus"], capture_output=True, text=True, env=mpi_env(),
                         cwd=tmp_path)
    assert bad.returncode == 2 and "--terms: unknown bogus" in bad.stderr
    check = subprocess.run([sys.executable, "-m", "fourd_mpi", "model", "validate", *samples, "--profile", str(out)],
                           capture_output=True, text=True, env=mpi_env(), cwd=tmp_path)
    assert check.returncode == 0 and "median |step error|" in check.stdout, check.stderr


def test_profile_base_merges_key_by_key(tmp_path):
    """``base:``: a profile file holding one constant and its source starts from a built-in; mappings are
    merged key by key, anything else replaced; a profile cannot be its own base (one line)."""
    from fourd_mpi.perf.machine import merged

    assert merged({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}}) == {"a": {"x": 1, "y": 3}, "b": 1}
    assert merged({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}
    path = _write(tmp_path, "base: dgx-a100\nname: site-a100\nsources:\n  compute.op_overhead_s: \"measured here\"\n"
                            "compute:\n  op_overhead_s: 5.0e-6\n")
    site, ref = load_profile(path), load_profile("dgx-a100")
    assert site.name == "site-a100" and site.op_overhead_s == 5.0e-6
    assert site.data["compute"]["gemm_tflops"] == ref.data["compute"]["gemm_tflops"]
    assert site.data["network"] == ref.data["network"] and site.mem_bandwidth == ref.mem_bandwidth
    assert site.data["sources"]["compute.op_overhead_s"] == "measured here"
    assert site.data["sources"]["compute.device"] == ref.data["sources"]["compute.device"]
    forty = load_profile("dgx-a100-40gb")
    assert forty.data["compute"]["device_memory_gib"] == 40.0 and forty.mem_bandwidth == 1372e9
    assert forty.data["compute"]["gemm_tflops"] == ref.data["compute"]["gemm_tflops"]
    for text, msg in [("base: me\nname: me\n", "base must name another profile"),
                      ("base: nosuch\nname: x\n", "unknown machine profile 'nosuch'"),
                      ("base: dgx-a100\nname: x\ncompute:\n  mem_bandwidth_gbs: -1\n", "mem_bandwidth_gbs")]:
        with pytest.raises(ConfigError, match=msg):
            load_profile(_write(tmp_path, text, name="me.yaml" if "me\n" in text else "x.yaml"))


def test_profile_base_cycle_is_one_line(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"base: {b}\nname: a\n")
    b.write_text(f"base: {a}\nname: b\n")
    with pytest.raises(ConfigError, match="a cycle"):
        load_profile(str(a))
