"""The performance model: predicted step time of a (model, grid, overlap) on a machine profile.

Per rank and step (seconds), from :mod:`fourd_mpi.perf.volumes` (every collective of the step) and a
:class:`~fourd_mpi.perf.machine.MachineProfile`:

- **communication** of each collective: alpha-beta by placement level (an axis inside a node
  uses the profile's ``intra`` level, one that crosses nodes ``inter``),
  ``t = count * (k*(p-1)*alpha + k*(p-1)/p*S*beta*share)``, k = 2 for all-reduce; ``share`` =
  ranks of a node in the run / the level's ``shared_by`` (ranks that shared the link when beta
  was measured); plus the profile's synchronization cost per message (``sync_s``: ranks arriving
  apart, measured by the benchmark) where it has one; a profile with a ``network`` section (published
  bandwidths by placement ``ip`` and message size, :meth:`~fourd_mpi.perf.machine.MachineProfile.network_time`)
  costs each message with that instead of alpha-beta;
- **compute**: local GEMM FLOPs (forward ``2*m*(n/G_out)*(k/G_in)`` per 4D layer, backward twice
  that; attention ``12*m*s*h/G_y`` per GPT block, replicated over X) at the profile's sustained
  GEMM rate, element-wise work (LayerNorm, GeLU, softmax, residuals, Adam) at its memory
  bandwidth, and a fixed cost per kernel / NumPy call; all times the oversubscription factor
  (ranks sharing a core compute in turn);
- **exposed communication**: a collective whose overlap option is on (oag: weight all-gathers,
  ors: dW reduce-scatters, oar: backward all-reduces, od: forward all-reduces, dp: data
  all-reduces) hides ``efficiency * min(t, window)``, the window being the compute it can run
  behind (the previous layer's GEMMs for oag, the dW GEMM for oar, the other chunks' GEMMs for
  od, the rest of the backward pass for ors and dp); the total hidden is at most
  ``efficiency * compute``. ``efficiency`` is the profile's; it is 0 on a CPU (host-driven
  progress) with ``--progress none``: MPI does not progress inside a NumPy GEMM (docs/design.md
  section 3);
- **step** = compute + exposed communication; **memory** from :mod:`fourd_mpi.perf.memory`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.step.presets import ModelConfig
from fourd_mpi.errors import ConfigError
from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.machine import MachineProfile, axis_inner_products, axis_placement
from fourd_mpi.perf.memory import MemoryEstimate, block_elements, estimate_memory, fc_weights, local_tokens
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.perf.volumes import OVERLAPS, Collective, step_collectives


@dataclass
class Prediction:
    """What the model says about one configuration (seconds per step, per rank; bytes)."""

    grid: GridShape
    step_s: float
    compute_s: float
    gemm_s: float
    comm_s: Dict[Tuple[str, str], float]          # (axis, op) -> time if nothing overlapped
    exposed_s: Dict[Tuple[str, str], float]       # (axis, op) -> exposed after overlap
    wire_bytes: Dict[str, int]                    # axis -> bytes a rank sends per step
    placement: Dict[str, str]                     # axis -> intra | inter | -
    memory: MemoryEstimate
    notes: List[str] = field(default_factory=list)

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())

    @property
    def exposed_total_s(self) -> float:
        return sum(self.exposed_s.values())

    def exposed_by_axis(self) -> Dict[str, float]:
        out: Dict[str, float] = defaultdict(float)
        for (axis, _), t in self.exposed_s.items():
            out[axis] += t
        return dict(out)


# Element-wise passes over an array (reads + writes of temporaries, counted loosely from the
# NumPy code of kernels.py) and NumPy calls, per layer visit.
_LN_PASSES, _LN_CALLS = 12, 14            # forward + backward of one LayerNorm over [m, h/x]
_GELU_PASSES, _GELU_CALLS = 24, 22        # forward + backward of GeLU over [m, f/y]
_SOFTMAX_PASSES, _SOFTMAX_CALLS = 12, 14  # mask, max, exp, sum, divide; backward over [b, nh, s, s]
_ADAM_PASSES, _ADAM_CALLS = 14, 14        # per parameter


def compute_time(cfg: ModelConfig, grid: GridShape, profile: MachineProfile, overlap: OverlapConfig,
                 dtype: str, ranks_on_node: int, optimizer: str = "adam", weighted: bool = True) -> Dict[str, float]:
    """Seconds of local work per step, by kind: ``gemm`` (4D layers, fwd/bwd separately in
    ``gemm_fwd``/``gemm_bwd``), ``attention``, ``elementwise``, ``calls``, ``total``; each
    scaled by the profile's calibrated term weight unless ``weighted`` is False."""
    e = dtype_bytes(dtype)
    rate = profile.gemm_tflops(dtype) * 1e12
    bw = profile.mem_bandwidth
    call = profile.op_overhead_s
    slow = profile.oversubscription(ranks_on_node)
    m = local_tokens(cfg, grid)
    gemm_flops, calls, passes = 0.0, 0, 0.0
    for _, n, k, transposed in fc_weights(cfg, grid):
        block = block_elements(n, k, transposed, grid)
        gemm_flops += 3 * 2.0 * m * block
        chunks = min(overlap.chunks, m) if overlap.od else 1
        calls += chunks + 2 + 6  # GEMMs, plus reshapes, handles and collective bookkeeping
    gemm_flops *= cfg.layers
    calls *= cfg.layers
    attn_flops = 0.0
    if cfg.kind == "gpt":
        attn_flops = cfg.layers * 12.0 * m * cfg.seq * (cfg.hidden // grid.y)
        probs = (m // cfg.seq) * (cfg.heads // grid.y) * cfg.seq * cfg.seq
        hx = cfg.hidden // grid.x
        passes += cfg.layers * (2 * _LN_PASSES * m * hx + _SOFTMAX_PASSES * probs + 4 * m * hx)
        calls += cfg.layers * (2 * _LN_CALLS + _SOFTMAX_CALLS + 6 + 4)
    fy = cfg.ffn_hidden // grid.y
    passes += cfg.layers * _GELU_PASSES * m * fy
    calls += cfg.layers * _GELU_CALLS
    params = estimate_memory(cfg, grid, dtype, optimizer, overlap=overlap).weights // e
    n_params = len(fc_weights(cfg, grid)) * cfg.layers + (4 * cfg.layers if cfg.kind == "gpt" else 0)
    if optimizer == "adam":
        passes += _ADAM_PASSES * params
        calls += _ADAM_CALLS * n_params
    w = profile.term_weights if weighted else {t: 1.0 for t in profile.term_weights}
    gemm = w["gemm"] * gemm_flops / rate
    attention = w["attention"] * attn_flops / rate
    elementwise = w["elementwise"] * passes * e / bw
    overhead = w["calls"] * calls * call
    total = (gemm + attention + elementwise + overhead) * slow
    fwd_share = 1.0 / 3.0
    return {"gemm": gemm * slow, "gemm_fwd": gemm * slow * fwd_share, "gemm_bwd": gemm * slow * (1 - fwd_share),
            "attention": attention * slow, "elementwise": elementwise * slow, "calls": overhead * slow,
            "total": total, "oversubscription": slow}


def collective_parts(c: Collective, profile: MachineProfile, placement: Dict[str, str],
                     ranks_on_node: int, inner: Optional[Dict[str, int]] = None) -> Tuple[float, float]:
    """``(alpha-beta seconds, synchronization seconds)`` of all ``c.count`` messages (no overlap).
    A profile with a ``network`` section costs them with its published bandwidths by placement
    (``inner``: the axis's inner product ip, :func:`~fourd_mpi.perf.machine.axis_inner_products`)."""
    level = placement[c.axis]
    if inner is not None and profile.has_network:
        t = profile.network_time(c.op, c.p, c.message_bytes, inner[c.axis], level, ranks_on_node)
        return c.count * t, c.count * profile.sync_s(level, c.p)
    fit, shared_by = profile.fit(level, c.op, c.p)
    share = ranks_on_node / shared_by if level == "inter" else 1.0
    return c.count * fit.time(c.op, c.p, c.message_bytes, share), c.count * profile.sync_s(level, c.p)


def collective_time(c: Collective, profile: MachineProfile, placement: Dict[str, str],
                    ranks_on_node: int, inner: Optional[Dict[str, int]] = None) -> float:
    """Seconds for all ``c.count`` messages of one collective (no overlap), with the profile's term weights."""
    w = profile.term_weights
    alpha_beta, sync = collective_parts(c, profile, placement, ranks_on_node, inner)
    return w["comm"] * alpha_beta + w["sync"] * sync


def term_features(cfg: ModelConfig, grid: GridShape, profile: MachineProfile,
                  overlap: Optional[OverlapConfig] = None, dtype: str = "float32", optimizer: str = "adam",
                  ranks_per_node: Optional[int] = None) -> Dict[str, float]:
    """The model's unweighted terms (seconds per step, nothing overlapped): what
    ``fourd-mpi model calibrate`` fits the weights of :data:`~fourd_mpi.perf.machine.TERMS` to."""
    overlap = overlap or OverlapConfig()
    rpn = ranks_per_node or min(profile.ranks_per_node, grid.size)
    placement = axis_placement(grid, rpn)
    comp = compute_time(cfg, grid, profile, overlap, dtype, rpn, optimizer, weighted=False)
    out = {t: comp[t] for t in ("gemm", "attention", "elementwise", "calls")}
    out["comm"] = out["sync"] = 0.0
    for c in step_collectives(cfg, grid, overlap, dtype):
        alpha_beta, sync = collective_parts(c, profile, placement, rpn, axis_inner_products(grid))
        out["comm"] += alpha_beta
        out["sync"] += sync
    return out


def fit_term_weights(features: List[Dict[str, float]], measured: List[float], terms=None, iterations: int = 20000):
    """Non-negative weights ``w`` minimising the relative error of ``sum_t w_t * feature_t`` against the
    measured step times (projected gradient descent on the scaled least-squares problem).

    ``terms``: the terms the fit may use (default all); the others get weight 0, except terms that
    are zero in every row, which keep weight 1. Returns ``(weights, predicted)``."""
    import numpy as np

    from fourd_mpi.perf.machine import TERMS

    terms = list(TERMS if terms is None else terms)
    used = [t for t in terms if any(f[t] > 0 for f in features)]
    if not used or len(features) < len(used):
        raise ConfigError(f"calibration needs at least {max(1, len(used))} traces (one per model term), "
                          f"got {len(features)}")
    y = np.asarray(measured, dtype=float)
    a = np.array([[f[t] for t in used] for f in features], dtype=float) / y[:, None]
    scale = a.max(axis=0)
    a = a / scale  # columns of comparable size: the step below is stable
    x = np.maximum(np.linalg.lstsq(a, np.ones(len(y)), rcond=None)[0], 0.0)
    step = 1.0 / max(np.linalg.norm(a, 2) ** 2, 1e-300)
    for _ in range(iterations):
        x = np.maximum(0.0, x - step * (a.T @ (a @ x - 1.0)))
    weights = {t: (1.0 if not any(f[t] > 0 for f in features) else 0.0) for t in TERMS}
    weights.update({t: float(v / s) for t, v, s in zip(used, x, scale)})
    predicted = [sum(weights[t] * f[t] for t in TERMS) for f in features]
    return weights, predicted


def predict(cfg: ModelConfig, grid: GridShape, profile: MachineProfile,
            overlap: Optional[OverlapConfig] = None, dtype: str = "float32", progress: str = "poll",
            optimizer: str = "adam", ranks_per_node: Optional[int] = None) -> Prediction:
    """Predict one training step of ``cfg`` on ``grid`` (see the module docstring).

    ``ranks_per_node``: ranks of the run per node (default: the profile's, or the world size when
    smaller). Raises :class:`~fourd_mpi.errors.ConfigError` when the profile lacks a level the
    grid needs and has no fallback.
    """
    overlap = overlap or OverlapConfig()
    rpn = ranks_per_node or min(profile.ranks_per_node, grid.size)
    placement = axis_placement(grid, rpn)
    inner = axis_inner_products(grid)
    comp = compute_time(cfg, grid, profile, overlap, dtype, rpn, optimizer)
    colls = step_collectives(cfg, grid, overlap, dtype)
    efficiency = profile.overlap_efficiency
    notes: List[str] = []
    if profile.host_driven and progress == "none":
        efficiency = 0.0
        if overlap.enabled and overlap.enabled != ["cache"]:
            notes.append("progress none on a CPU: nonblocking collectives do not progress during compute, "
                         "overlap hides nothing")
    # windows of compute each overlappable collective can hide behind (per message kind)
    per_layer_gemm = comp["gemm"] / max(1, len(fc_weights(cfg, grid)) * cfg.layers)
    backward_compute = comp["total"] * (2.0 / 3.0)
    comm: Dict[Tuple[str, str], float] = defaultdict(float)
    hidden: Dict[Tuple[str, str], float] = defaultdict(float)
    wire: Dict[str, int] = defaultdict(int)
    layer_index: Dict[str, int] = {}
    for c in colls:
        t = collective_time(c, profile, placement, rpn, inner)
        key = (c.axis, c.op)
        comm[key] += t
        wire[c.axis] += c.wire_bytes
        option = OVERLAPS.get(c.role)
        if option is None or not getattr(overlap, option) or efficiency == 0.0:
            continue
        idx = layer_index.setdefault(c.layer, len(layer_index))
        if option == "oag":
            # every gather but the first of each pass runs behind the previous layers' GEMMs
            first = 1.0 / max(1, len(fc_weights(cfg, grid)) * cfg.layers)
            window = per_layer_gemm * overlap.prefetch_depth * (0.5 if c.phase == "forward" else 1.0)
            hidden[key] += efficiency * min(t * (1 - first), window)
        elif option == "od":
            window = per_layer_gemm / 3.0 * (c.count - 1) / max(1, c.count)
            hidden[key] += efficiency * min(t * (c.count - 1) / max(1, c.count), window)
        elif option == "oar":
            hidden[key] += efficiency * min(t, per_layer_gemm / 3.0)
        else:  # ors, dp: the rest of the backward pass (later layers in backward = earlier in forward)
            remaining = backward_compute * idx / max(1, len(layer_index) + 1)
            hidden[key] += efficiency * min(t, remaining)
    total_hidden = sum(hidden.values())
    cap = efficiency * comp["total"]
    scale = cap / total_hidden if total_hidden > cap and total_hidden > 0 else 1.0
    exposed = {k: max(0.0, v - hidden.get(k, 0.0) * scale) for k, v in comm.items()}
    memory = estimate_memory(cfg, grid, dtype, optimizer, overlap=overlap)
    for note in profile.notes:
        if note not in notes:
            notes.append(note)
    step = comp["total"] + sum(exposed.values())
    return Prediction(grid=grid, step_s=step, compute_s=comp["total"], gemm_s=comp["gemm"] + comp["attention"],
                      comm_s=dict(comm), exposed_s=exposed, wire_bytes=dict(wire), placement=placement,
                      memory=memory, notes=notes)
