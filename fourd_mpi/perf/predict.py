"""The performance model: predicted step time of a (model, grid, overlap) on a machine profile.

Per rank and step (seconds), from :mod:`fourd_mpi.perf.volumes` (every collective of the step) and a
:class:`~fourd_mpi.perf.machine.MachineProfile`:

- **communication** of each collective: alpha-beta by placement level (an axis inside a node uses the
  profile's ``intra`` level, one that crosses nodes ``inter``),
  ``t = count * (k*(p-1)*alpha + k*(p-1)/p*S*beta*share)``, k = 2 for all-reduce; ``share`` = ranks of a node
  in the run / the level's ``shared_by`` (ranks that shared the link when beta was measured); a calibrated
  profile's measured points of the same collective and group size replace the fit (interpolated in bytes,
  :func:`~fourd_mpi.perf.machine.interpolate_measured`, the part above the smallest message's time times
  ``share``); plus the profile's synchronization cost per message (``sync_s``: ranks arriving apart, measured
  by the benchmark) where it has one; a profile with a ``network`` section (published bandwidths by placement
  ``ip`` and message size, :meth:`~fourd_mpi.perf.machine.MachineProfile.network_time`) costs each message
  with that instead of alpha-beta;
- **compute**: local GEMM FLOPs (forward ``2*m*(n/G_out)*(k/G_in)`` per 4D layer, backward twice
  that; attention ``12*m*s*h/G_y`` per GPT block, replicated over X) at the profile's sustained
  GEMM rate, element-wise work (LayerNorm, GeLU, softmax, residuals, Adam) at its memory
  bandwidth, and a fixed cost per kernel / NumPy call; all times the oversubscription factor
  (ranks sharing a core compute in turn). ``recompute="full"`` runs every block's forward once
  more in backward (GEMMs, attention, element-wise work and calls x 4/3 of the block part: the
  96 convention of :meth:`~fourd_mpi.step.presets.ModelConfig.hardware_flops_per_step`);
  ``"selective"`` only the attention core (+1/3 of attention and softmax work).
  ``attention="fused"`` (flash attention) removes the softmax passes over ``s x s`` matrices
  (they stay in on-chip memory); its FLOPs are counted as the convention counts them;
- **exposed communication**, two regimes chosen by the profile's ``progress.host_driven``:

  * host-driven (CPU profiles, the model's first overlap rule): a collective whose overlap option is on
    (oag: weight all-gathers, ors: dW reduce-scatters, oar: backward all-reduces, od: forward
    all-reduces, dp: data all-reduces) hides ``efficiency * min(t, window)``, the window being the
    compute it can run behind (the previous layer's GEMMs for oag, the dW GEMM for oar, the other
    chunks' GEMMs for od, the rest of the backward pass for ors and dp); the total hidden is at most
    ``efficiency * compute``. ``efficiency`` is 0 with ``--progress none``: MPI does not progress
    inside a NumPy GEMM (docs/design.md section 3);
  * device-driven (GPU profiles: the network moves the data while the GPU computes): a timeline of
    the step (:class:`Link`). Nonblocking collectives enter one FIFO served by the network while the
    rank computes (``efficiency`` seconds of transfer per second of compute) and at full speed
    while the rank waits; a rank waits for a collective where the step needs its result. Each
    collective is thereby bounded by the compute it can hide behind: OAG's gather of layer ``j``
    is issued ``prefetch_depth`` layers ahead and needed before layer ``j`` computes; OAR's dX
    all-reduce is issued after the dX GEMM and needed after the dW GEMM; OD's chunks hide behind
    the rest of their layer; ORS reduce-scatters and DP all-reduces are needed only before the
    optimizer. A collective whose option is off, and every LayerNorm / loss all-reduce, is
    blocking: all of it is exposed, and the FIFO does not advance meanwhile (the network is busy).
    With ``recompute="full"`` the forward all-reduces run again in backward (Megatron-LM and
    AxoNN recompute the whole block, collectives included);
- **step** = compute + exposed communication; **memory** from :mod:`fourd_mpi.perf.memory`.

Long: one model: its regimes, the link replay and the pricing share the Link and its terms; whole while it changes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Tuple

from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError
from fourd_mpi.perf.exact import Sums
from fourd_mpi.perf.machine import MachineProfile, axis_inner_products, axis_placement, group_per_node
from fourd_mpi.perf.memory import (
    MemoryEstimate,
    block_elements,
    estimate_memory,
    fc_weights,
    local_tokens,
    parameter_elements,
)
from fourd_mpi.perf.volumes import OVERLAPS, Collective, collective_rows, step_collectives
from fourd_mpi.step.overlap import OverlapConfig
from fourd_mpi.step.presets import ModelConfig


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


#: element-wise passes over an array (reads + writes of temporaries, counted loosely from the NumPy code of
#: kernels.py) and NumPy calls, per layer visit (the 4D model here, Optimus-CUBE's in perf/optimus3d.py)
LN_PASSES, LN_CALLS = 12, 14            # forward + backward of one LayerNorm over [m, h/x]
GELU_PASSES, GELU_CALLS = 24, 22        # forward + backward of GeLU over [m, f/y]
SOFTMAX_PASSES, SOFTMAX_CALLS = 12, 14  # mask, max, exp, sum, divide; backward over [b, nh, s, s]
ADAM_PASSES, ADAM_CALLS = 14, 14        # per parameter
#: element-wise traffic of the MLP activation relative to GeLU's: GeLU reads ``u`` and writes ``gelu(u)`` (2 f),
#: its backward reads ``u`` and the gradient and writes one (3 f): 5 f; SwiGLU reads gate and up and writes their
#: product (3 f), its backward reads gate, up and the gradient and writes two (5 f): 8 f; 8/5
MLP_PASS_SCALE = {"gelu": 1.0, "swiglu": 8.0 / 5.0}
#: bytes per parameter of a mixed-precision Adam step (fp32 main gradients, master weights and moments),
#: counted from Megatron-LM's Float16OptimizerWithFloat16Params.step: 16-bit gradient -> fp32 main
#: gradient (read 2, write 4), unscale and inf/NaN check (read 4, write 4), gradient norm for clipping
#: (read 4), clipping (read 4, write 4), fused Adam (read weight, gradient, 2 moments: 16; write weight,
#: 2 moments: 12), fp32 master -> 16-bit weight (read 4, write 2): 6 + 8 + 4 + 8 + 28 + 6 = 60
MIXED_ADAM_BYTES = 60
#: passes of ``b (a/G_y) s^2`` elements the unfused attention's batched GEMMs move (forward: Q K^T writes the
#: scores, P V reads the probabilities; backward: dP = dO V^T writes, dV = P^T dO reads, dQ = dS K and
#: dK = dS^T Q read dS): 2 + 4
_ATTENTION_BMM_PASSES = 6


def gemm_rate_tflops(profile: MachineProfile, dtype: str, notes: Optional[List[str]] = None) -> float:
    """The profile's sustained GEMM rate for ``dtype``; a profile without a bfloat16 rate uses its
    float16 one (the tensor cores of A100, H100 and MI250X run both at the same peak), noted."""
    rates = profile.data["compute"]["gemm_tflops"]
    if dtype == "bfloat16" and dtype not in rates and "float16" in rates:
        if notes is not None:
            note = f"profile {profile.name} has no bfloat16 GEMM rate: using its float16 rate (same tensor-core peak)"
            if note not in notes:
                notes.append(note)
        return float(rates["float16"])
    return profile.gemm_tflops(dtype)


def compute_time(cfg: ModelConfig, grid: GridShape, profile: MachineProfile, overlap: OverlapConfig,
                 dtype: str, ranks_on_node: int, optimizer: str = "adam", weighted: bool = True,
                 recompute: str = "none", attention: str = "unfused",
                 precision: Optional[str] = None, gemm_dtype: Optional[str] = None) -> Dict[str, float]:
    """Seconds of local work per step, by kind: ``gemm`` (4D layers, recompute included; one forward
    pass in ``gemm_fwd``, the backward's ``2 x`` in ``gemm_bwd``), ``attention``, ``elementwise``,
    ``calls``, ``total``; ``optimizer`` (the Adam part of elementwise and calls), ``recompute`` (the
    extra work of activation recompute, part of the others), ``block_other`` (attention,
    element-wise work and calls of the blocks without recompute); each scaled by the profile's
    calibrated term weight unless ``weighted`` is False.

    On a GPU profile (``cupy`` backend) the unfused attention's batched GEMMs are priced by the roofline
    ``max(F/rate, bytes/bandwidth)``: they move :data:`_ATTENTION_BMM_PASSES` passes of the ``s x s``
    scores per head for ``4 d s^2`` FLOPs per pass pair, so with ``e``-byte elements they are
    memory-bound when the head size ``d = h/a < e/2 x rate/bandwidth`` (A100 fp16: ``d < 122``; the
    factor ``e rate / (2 d bw)``). Mixed precision (``precision``, default: ``mixed`` for 16-bit dtypes)
    prices the Adam step at :data:`MIXED_ADAM_BYTES` bytes per parameter (fp32 state), else 14 passes of
    the dtype.

    ``gemm_dtype``: the dtype of the 4D layers' GEMMs when it is not ``dtype`` (``float8``: Transformer Engine's
    FP8 GEMMs at the profile's ``float8`` rate, :mod:`fourd_mpi.perf.terms`; attention, element-wise work and
    the optimizer stay in ``dtype``).

    Memoized per profile on every argument (a search prices the same micro-batch step for its lower bound
    and its prediction; the profile's data are not changed after loading): a fresh dict each call."""
    return dict(compute_time_shared(cfg, grid, profile, overlap, dtype, ranks_on_node, optimizer, weighted,
                                    recompute, attention, precision, gemm_dtype))


def compute_time_shared(cfg: ModelConfig, grid: GridShape, profile: MachineProfile, overlap: OverlapConfig,
                        dtype: str, ranks_on_node: int, optimizer: str = "adam", weighted: bool = True,
                        recompute: str = "none", attention: str = "unfused",
                        precision: Optional[str] = None, gemm_dtype: Optional[str] = None) -> Dict[str, float]:
    """:func:`compute_time`'s memoized dict itself, not a copy: for callers that only read it (lower bounds)."""
    memo = profile.__dict__.setdefault("_compute_memo", {})
    key = (cfg, grid, overlap, dtype, ranks_on_node, optimizer, weighted, recompute, attention, precision, gemm_dtype)
    found = memo.get(key)
    if found is None:
        found = memo[key] = _compute_time(cfg, grid, profile, overlap, dtype, ranks_on_node, optimizer, weighted,
                                          recompute, attention, precision, gemm_dtype)
    return found


def _machine_terms(profile: MachineProfile, dtype: str, ranks_on_node: int, weighted: bool) -> tuple:
    """``(GEMM FLOP/s, memory bytes/s, seconds per call, oversubscription, term weights)`` of
    :func:`compute_time` (memoized per profile)."""
    memo = profile.__dict__.setdefault("_machine_terms_memo", {})
    key = (dtype, ranks_on_node, bool(weighted))
    if key not in memo:
        weights = profile.term_weights if weighted else {t: 1.0 for t in profile.term_weights}
        memo[key] = (gemm_rate_tflops(profile, dtype) * 1e12, profile.mem_bandwidth, profile.op_overhead_s,
                     profile.oversubscription(ranks_on_node), weights)
    return memo[key]


def _compute_time(cfg: ModelConfig, grid: GridShape, profile: MachineProfile, overlap: OverlapConfig,
                  dtype: str, ranks_on_node: int, optimizer: str, weighted: bool, recompute: str, attention: str,
                  precision: Optional[str], gemm_dtype: Optional[str] = None) -> Dict[str, float]:
    """:func:`compute_time`, not memoized."""
    from fourd_mpi.perf.memory import ATTENTION, RECOMPUTE, check_choice, default_precision

    check_choice("recompute", recompute, RECOMPUTE)
    check_choice("attention", attention, ATTENTION)
    precision = precision or default_precision(dtype)
    e = dtype_bytes(dtype)
    rate, bw, call, slow, w = _machine_terms(profile, dtype, ranks_on_node, weighted)
    gemm_rate = rate if gemm_dtype in (None, dtype) else _machine_terms(profile, gemm_dtype, ranks_on_node, weighted)[0]
    m = local_tokens(cfg, grid)
    fcs = fc_weights(cfg, grid)
    blocks = [block_elements(n, k, transposed, grid) for _, n, k, transposed in fcs]
    gemm_flops, calls, passes = 0.0, 0, 0.0
    for block in blocks:
        gemm_flops += 3 * 2.0 * m * block
        chunks = min(overlap.chunks, m) if overlap.od else 1
        calls += chunks + 2 + 6  # GEMMs, plus reshapes, handles and collective bookkeeping
    gemm_flops *= cfg.layers
    calls *= cfg.layers
    attn_flops, softmax_passes, softmax_calls = 0.0, 0.0, 0
    if cfg.kind == "gpt":
        attn_flops = cfg.layers * 12.0 * m * cfg.seq * (cfg.hidden // grid.y)
        probs = (m // cfg.seq) * (cfg.heads // grid.y) * cfg.seq * cfg.seq
        hx = cfg.hidden // grid.x
        # fused (flash) attention keeps the s x s scores on chip: no element-wise passes over them
        softmax_passes = 0.0 if attention == "fused" else cfg.layers * SOFTMAX_PASSES * probs
        softmax_calls = 0 if attention == "fused" else cfg.layers * SOFTMAX_CALLS
        passes += cfg.layers * (2 * LN_PASSES * m * hx + 4 * m * hx) + softmax_passes
        calls += cfg.layers * (2 * LN_CALLS + 6 + 4) + softmax_calls
    fy = cfg.ffn_hidden // grid.y
    passes += cfg.layers * GELU_PASSES * m * fy * MLP_PASS_SCALE[cfg.mlp]
    calls += cfg.layers * GELU_CALLS
    params = parameter_elements(cfg, grid, blocks)  # the weights of estimate_memory, in elements
    n_params = len(fcs) * cfg.layers + (4 * cfg.layers if cfg.kind == "gpt" else 0)
    opt_passes, opt_calls = 0.0, 0
    if optimizer == "adam":  # opt_passes: in elements of the dtype (e bytes each)
        opt_passes, opt_calls = ADAM_PASSES * params, ADAM_CALLS * n_params
        if precision == "mixed":
            opt_passes = MIXED_ADAM_BYTES * params / e
    # unfused attention on a GPU: the batched GEMMs over the s x s scores are memory-bound for small heads
    attn_scale = 1.0
    if cfg.kind == "gpt" and attention == "unfused" and attn_flops > 0 and profile.backend == "cupy":
        attn_bytes = cfg.layers * _ATTENTION_BMM_PASSES * probs * e
        attn_scale = max(1.0, (attn_bytes / bw) / (attn_flops / rate))
    attn_flops *= attn_scale  # FLOP-equivalents at the GEMM rate (the FLOP conventions are counted elsewhere)
    # activation recompute: the forward share (1/3) of the block work once more
    rec = {"none": (0.0, 0.0, 0.0, 0.0),
           "full": (gemm_flops / 3.0, attn_flops / 3.0, passes / 3.0, calls / 3.0),
           "selective": (0.0, attn_flops / 3.0, softmax_passes / 3.0, softmax_calls / 3.0)}[recompute]
    gemm_model = w["gemm"] * gemm_flops / gemm_rate
    attention_model = w["attention"] * attn_flops / rate
    block_elementwise = w["elementwise"] * passes * e / bw
    block_calls = w["calls"] * calls * call
    opt_time = w["elementwise"] * opt_passes * e / bw + w["calls"] * opt_calls * call
    rec_gemm = w["gemm"] * rec[0] / gemm_rate
    rec_other = w["attention"] * rec[1] / rate + w["elementwise"] * rec[2] * e / bw + w["calls"] * rec[3] * call
    gemm = gemm_model + rec_gemm
    attention_t = attention_model + w["attention"] * rec[1] / rate
    elementwise = w["elementwise"] * (passes + rec[2] + opt_passes) * e / bw
    overhead = w["calls"] * (calls + rec[3] + opt_calls) * call
    total = (gemm + attention_t + elementwise + overhead) * slow
    fwd_share = 1.0 / 3.0
    return {"gemm": gemm * slow, "gemm_fwd": gemm_model * slow * fwd_share,
            "gemm_bwd": gemm_model * slow * (1 - fwd_share), "attention": attention_t * slow,
            "elementwise": elementwise * slow, "calls": overhead * slow, "total": total,
            "oversubscription": slow, "optimizer": opt_time * slow,
            "recompute": (rec_gemm + rec_other) * slow, "recompute_gemm": rec_gemm * slow,
            "block_other": (attention_model + block_elementwise + block_calls) * slow,
            "gemm_per_flop": w["gemm"] * slow / gemm_rate}


#: roles of the step's data all-reduces: with DP overlap off, ``GradientSync.finish`` issues them back to back at the
#: end of the backward pass, each waited before the next (:func:`back_to_back`)
GRADIENT_SYNC_ROLES = ("grad_allreduce", "ln_grad_allreduce")


def back_to_back(role: str, axis: str, overlap: OverlapConfig) -> bool:
    """Whether the step issues a collective of ``role`` on ``axis`` in a back-to-back run: the data all-reduces of
    the gradients when DP overlap is off (with ``dp`` each is issued as soon as its gradient is ready, between the
    backward GEMMs). A profile's ``measured_runs`` points price these
    (:meth:`~fourd_mpi.perf.machine.MachineProfile.measured_time`)."""
    return axis == "data" and role in GRADIENT_SYNC_ROLES and not overlap.dp


def collective_parts(c: Collective, profile: MachineProfile, placement: Dict[str, str],
                     ranks_on_node: int, inner: Optional[Dict[str, int]] = None,
                     run: bool = False) -> Tuple[float, float]:
    """``(alpha-beta seconds, synchronization seconds)`` of all ``c.count`` messages (no overlap).
    A profile with a ``network`` section costs them with its published bandwidths by placement
    (``inner``: the axis's inner product ip, :func:`~fourd_mpi.perf.machine.axis_inner_products`).
    ``run``: the messages are part of a back-to-back run (:func:`back_to_back`): the profile's back-to-back
    points price them where it has them."""
    level = placement[c.axis]
    if inner is not None and profile.has_network:
        t = profile.network_time(c.op, c.p, c.message_bytes, inner[c.axis], level, ranks_on_node)
        return c.count * t, c.count * profile.sync_s(level, c.p)
    fit, shared_by = profile.fit(level, c.op, c.p)
    share = ranks_on_node / shared_by if level == "inter" else 1.0
    measured = profile.measured_time(level, c.op, c.p, c.message_bytes, share,
                                     per_node=_per_node(c, level, ranks_on_node, inner), run=run)
    one = measured if measured is not None else fit.time(c.op, c.p, c.message_bytes, share)
    return c.count * one, c.count * profile.sync_s(level, c.p)


def _per_node(c: Collective, level: str, ranks_on_node: int, inner: Optional[Dict[str, int]]) -> Optional[int]:
    """Ranks of ``c``'s group on one node (:func:`~fourd_mpi.perf.machine.group_per_node`) for an
    inter-node group; None inside a node or without the axis' stride. An axis that block placement
    keeps inside a node but ``placement`` puts across nodes (another rank order, e.g. round-robin over
    the nodes) counts one rank per node."""
    if level != "inter" or inner is None or c.axis not in inner:
        return None
    g = group_per_node(c.p, inner[c.axis], ranks_on_node)
    return 1 if g >= c.p else g


def collective_time(c: Collective, profile: MachineProfile, placement: Dict[str, str],
                    ranks_on_node: int, inner: Optional[Dict[str, int]] = None, run: bool = False) -> float:
    """Seconds for all ``c.count`` messages of one collective (no overlap), with the profile's term weights
    (``run``: as :func:`collective_parts`'s). Memoized per profile on what the price depends on (a search prices
    the same message many times)."""
    memo = profile.__dict__.setdefault("_collective_memo", {})
    key = _price_key(c.op, c.axis, c.p, c.count, c.message_bytes, placement, ranks_on_node, inner, run)
    if key not in memo:
        w = profile.term_weights
        alpha_beta, sync = collective_parts(c, profile, placement, ranks_on_node, inner, run)
        memo[key] = w["comm"] * alpha_beta + w["sync"] * sync
    return memo[key]


def _price_key(op: str, axis: str, p: int, count: int, message_bytes: int, placement: Dict[str, str],
               ranks_on_node: int, inner: Optional[Dict[str, int]], run: bool = False) -> tuple:
    """What :func:`collective_time`'s price depends on: the key of its memo."""
    return (op, axis, p, count, message_bytes, placement[axis], ranks_on_node, None if inner is None else inner[axis],
            run)


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
    sums = Sums()
    for c in step_collectives(_one_block(cfg), grid, overlap, dtype):  # every block's: counted L times
        runs = 1 if c.layer == "loss" else cfg.layers
        alpha_beta, sync = collective_parts(c, profile, placement, rpn, axis_inner_products(grid),
                                            back_to_back(c.role, c.axis, overlap))
        sums.add_times("comm", alpha_beta, runs)
        sums.add_times("sync", sync, runs)
    out["comm"] = float(sums.sums["comm"]) if "comm" in sums.sums else 0.0
    out["sync"] = float(sums.sums["sync"]) if "sync" in sums.sums else 0.0
    return out


def fit_term_weights(features: List[Dict[str, float]], measured: List[float], terms=None):
    """Non-negative weights ``w`` minimising the relative error of ``sum_t w_t * feature_t`` against the
    measured step times: ``min_{w >= 0} sum_i (sum_t w_t f_it / y_i - 1)^2``, solved exactly by the
    Lawson-Hanson active-set method (``scipy.optimize.nnls``) on columns scaled to a maximum of 1.

    ``features``: one dict of term -> predicted seconds per measured run (n runs); ``measured``: the
    n measured step times ``y_i``. ``terms``: the terms the fit may use (default all); the others get
    weight 0, except terms that are zero in every row, which keep weight 1. Returns
    ``(weights, predicted)``. Needs scipy (the ``analysis`` extra)."""
    import numpy as np

    from fourd_mpi.perf.machine import TERMS

    try:
        from scipy.optimize import nnls
    except ImportError:
        raise ConfigError("model calibrate needs scipy for its non-negative least-squares fit: "
                          "pip install 'fourd_mpi[analysis]' (or pip install scipy)") from None
    terms = list(TERMS if terms is None else terms)
    used = [t for t in terms if any(f[t] > 0 for f in features)]
    if not used or len(features) < len(used):
        raise ConfigError(f"calibration needs at least {max(1, len(used))} traces (one per model term), "
                          f"got {len(features)}")
    y = np.asarray(measured, dtype=float)
    a = np.array([[f[t] for t in used] for f in features], dtype=float) / y[:, None]
    scale = a.max(axis=0)
    a = a / scale  # columns of comparable size (the solution of the unscaled problem is x / scale)
    x, _ = nnls(a, np.ones(len(y)))
    weights = {t: (1.0 if not any(f[t] > 0 for f in features) else 0.0) for t in TERMS}
    weights.update({t: float(v / s) for t, v, s in zip(used, x, scale)})
    predicted = [sum(weights[t] * f[t] for t in TERMS) for f in features]
    return weights, predicted


class Link:
    """The network of one rank as a FIFO of in-flight nonblocking collectives (device-driven regime).

    :meth:`issue` enqueues a transfer of ``t`` seconds; :meth:`compute` lets the rank compute for
    ``seconds`` while the network serves the queue for ``efficiency * seconds``; :meth:`wait` blocks
    the rank until one transfer is done (the queue ahead of it drains at full speed and every
    second of it is exposed); :meth:`blocking` is a collective the rank waits on at once (all of it
    exposed, the queue does not move). ``exposed[key]`` / ``hidden[key]``: seconds of each
    ``(axis, op)`` that the rank waited for / that ran during compute (exact sums,
    :mod:`fourd_mpi.perf.exact`: the same seconds added in another order give the same floats).
    While :attr:`log` is a list, every second counted is also appended to it (:meth:`replay`).
    """

    def __init__(self, efficiency: float):
        from collections import deque

        self.efficiency = efficiency
        self.queue = deque()
        self._exposed = Sums()
        self._hidden = Sums()
        self.log: Optional[list] = None

    @property
    def exposed(self) -> Dict[Tuple[str, str], float]:
        return self._exposed.floats()

    @property
    def hidden(self) -> Dict[Tuple[str, str], float]:
        return self._hidden.floats()

    def _count(self, sums: Sums, key: Tuple[str, str], seconds: float) -> None:
        sums.add(key, seconds)
        log = self.log
        if log is not None:
            log.append((sums, key, seconds))

    def issue(self, key: Tuple[str, str], seconds: float) -> list:
        item = [seconds, key]
        if seconds > 0:
            self.queue.append(item)
        return item

    def compute(self, seconds: float) -> None:
        budget = self.efficiency * seconds
        while budget > 0 and self.queue:
            item = self.queue[0]
            used = min(item[0], budget)
            item[0] -= used
            budget -= used
            self._count(self._hidden, item[1], used)
            if item[0] <= 0:
                self.queue.popleft()

    def wait(self, item: list) -> None:
        while item[0] > 0 and self.queue:
            head = self.queue.popleft()
            self._count(self._exposed, head[1], head[0])
            head[0] = 0.0

    def wait_all(self) -> None:
        while self.queue:
            self.wait(self.queue[-1])

    def blocking(self, key: Tuple[str, str], seconds: float) -> None:
        self._count(self._exposed, key, seconds)

    def blocking_times(self, key: Tuple[str, str], seconds: float, n: int) -> None:
        """:meth:`blocking` ``n`` times."""
        self._exposed.add_times(key, seconds, n)

    def replay(self, log: list, n: int) -> None:
        """Count again, ``n`` times, every second ``log`` recorded."""
        for sums, key, seconds in log:
            sums.add_times(key, seconds, n)


#: a repeating stretch of a timeline is looked for only while the queue holds at most this many transfers
_STATE_QUEUE = 64


def _state(link: Link, issued: Dict[int, Optional[list]], boundary: int) -> tuple:
    """What the rest of a timeline depends on at position ``boundary``: the queue (each transfer's seconds left,
    its key, and the position ahead it was issued for, relative to ``boundary``) and the positions ahead already
    issued. A transfer no longer queued has no seconds left: waiting for it does nothing."""
    ahead = {id(item): g - boundary for g, item in issued.items() if item is not None and g >= boundary}
    return (tuple(sorted(g - boundary for g in issued if g >= boundary)),
            tuple((item[0], item[1], ahead.get(id(item))) for item in link.queue))


def replay_blocks(link: Link, blocks: int, width: int, depth: int, issued: Dict[int, Optional[list]],
                  position: Callable[[int], None]) -> None:
    """Run ``position(p)`` for ``p`` in ``range(blocks * width)`` (``width`` positions per block, alike in every
    block; ``position`` may issue up to ``depth`` positions ahead, keeping what it issued in ``issued`` by
    position), without running every block: once a block that is neither the first nor one whose look-ahead
    reaches past the end leaves the link and ``issued`` as it found them (a state repeats), every block up to
    those last ones would do the same, and the seconds that block counted are counted once per such block
    (:meth:`Link.replay`; exact sums, so the result is bit for bit the one of running them). A timeline whose
    state keeps changing (a queue that grows from block to block) runs every block."""
    tail = -(-depth // width) if width else 0  # last blocks whose look-ahead is cut at the end
    last_middle = blocks - 1 - tail
    b = 0
    while b < blocks:
        start, end = b * width, (b + 1) * width
        check = 1 <= b < last_middle and len(link.queue) <= _STATE_QUEUE
        if check:
            before = _state(link, issued, start)
            link.log = []
        for p in range(start, end):
            position(p)
        for g in [g for g in issued if g < end]:
            del issued[g]
        if check:
            log, link.log = link.log, None
            if len(link.queue) == len(before[1]) and _state(link, issued, end) == before:
                n = last_middle - b  # blocks b+1 .. last_middle: each as block b
                link.replay(log, n)
                moved = {g + n * width: item for g, item in issued.items()}
                issued.clear()
                issued.update(moved)
                b = last_middle + 1
                continue
        b += 1


def device_timeline(cfg: ModelConfig, grid: GridShape, colls: List[Collective], times: List[float],
                    comp: Dict[str, float], overlap: OverlapConfig, efficiency: float,
                    recompute: str = "none") -> Link:
    """Replay one step on a :class:`Link` (device-driven regime of the module docstring).

    ``colls``: block 0's collectives and the loss (every block has the same,
    :func:`~fourd_mpi.perf.volumes.step_collectives` builds each block alike; those of other blocks are ignored);
    ``times[i]``: seconds of all messages of ``colls[i]``. Compute per 4D layer ``j``: its forward
    GEMM ``g_j`` plus a third of its block's other work ``o_j`` in forward; ``2 g_j + 2 o_j`` in
    backward, split evenly between the dX and dW GEMMs; with full recompute the forward once more
    before them. The optimizer runs after every collective has completed (not a window). The blocks run
    through :func:`replay_blocks`: the cost does not grow with the layer count once the timeline repeats.

    Long: one step's replay in issue order, as the docstring lists it; split, the order is harder to check.
    """
    link = Link(efficiency)
    fcs = fc_weights(cfg, grid)
    width = len(fcs)
    count = cfg.layers * width
    m = local_tokens(cfg, grid)
    per_flop = comp["gemm_per_flop"]
    names = [f"block0.{name}" for name, _, _, _ in fcs]
    gemm_f = [2.0 * m * block_elements(n, k, t, grid) * per_flop for _, n, k, t in fcs]
    other = comp["block_other"] / max(1, count)
    rec_other = (comp["recompute"] - comp["recompute_gemm"]) / max(1, count)
    by_layer: Dict[str, Dict[Tuple[str, str], List[Tuple[float, Collective]]]] = defaultdict(lambda: defaultdict(list))
    for c, t in zip(colls, times):
        if c.layer == "loss" or c.layer.startswith("block0."):
            by_layer[c.layer][(c.role, c.phase)].append((t, c))
    depth = overlap.prefetch_depth if overlap.oag else 0

    def key(c: Collective) -> Tuple[str, str]:
        return (c.axis, c.op)

    def block_ln(phase: str) -> None:  # LayerNorm statistics and loss: small and blocking
        for ln in ("ln1", "ln2"):
            for (role, ph), items in by_layer.get(f"block0.{ln}", {}).items():
                if ph == phase:
                    for t, c in items:
                        link.blocking(key(c), t)

    def gather(layer: str, phase: str) -> Optional[list]:
        items = by_layer.get(layer, {}).get(("weight_allgather", phase), [])
        if not items:
            return None
        t, c = items[0]
        if not overlap.oag:
            link.blocking(key(c), t)
            return None
        return link.issue(key(c), t)

    def forward_allreduce(layer: str, window: float) -> None:
        """The forward all-reduce of ``layer`` (od: all chunks but the last behind the layer's own
        remaining chunks) around ``window`` seconds of its compute."""
        items = by_layer.get(layer, {}).get(("fwd_allreduce", "forward"), [])
        if not items:
            link.compute(window)
            return
        t, c = items[0]
        chunks = c.count
        if overlap.od and chunks > 1:
            link.compute(window / chunks)
            pending = link.issue(key(c), t * (chunks - 1) / chunks)
            link.compute(window * (chunks - 1) / chunks)
            link.wait(pending)
            link.blocking(key(c), t / chunks)
        else:
            link.compute(window)
            link.blocking(key(c), t)

    # forward: gathers of layers j .. j+depth issued when layer j starts, layer j's needed now
    issued: Dict[int, Optional[list]] = {}

    def forward(j: int) -> None:
        i = j % width
        if i == 0 and cfg.kind == "gpt":
            block_ln("forward")
        for ahead in range(j, min(j + depth + 1, count)):
            if ahead not in issued:
                issued[ahead] = gather(names[ahead % width], "forward")
        if issued.get(j) is not None:
            link.wait(issued[j])
        forward_allreduce(names[i], gemm_f[i] + other / 3.0)

    replay_blocks(link, cfg.layers, width, depth, issued, forward)
    for t, c in by_layer.get("loss", {}).get(("loss", "forward"), []):
        link.blocking(key(c), t)

    # backward, last layer first: position j is layer count-1-j; each layer's collectives looked up once
    issued = {}
    dx_of = []
    after_of = []  # the dW reduce-scatters and (with dp) the data all-reduces, in flight or blocking
    for layer in names:
        dx = by_layer.get(layer, {}).get(("bwd_allreduce", "backward"), [])
        dx_of.append((dx[0][0], key(dx[0][1])) if dx else None)
        after_of.append([(t, key(c), bool(getattr(overlap, option)))
                         for role, option in (("dw_reduce_scatter", "ors"), ("grad_allreduce", "dp"))
                         for t, c in by_layer.get(layer, {}).get((role, "backward"), [])
                         if not (role == "grad_allreduce" and not overlap.dp)])  # else issued at the end, below

    def backward(j: int) -> None:
        i = width - 1 - j % width
        layer = names[i]
        for ahead in range(j, min(j + depth + 1, count)):
            if ahead not in issued:
                issued[ahead] = gather(names[width - 1 - ahead % width], "backward")
        if issued.get(j) is not None:
            link.wait(issued[j])
        if recompute == "full":  # the block's forward again, its all-reduces included
            forward_allreduce(layer, gemm_f[i] + rec_other)
        elif rec_other:
            link.compute(rec_other)
        half = gemm_f[i] + other / 3.0
        link.compute(half)  # dX GEMM
        dx = dx_of[i]
        pending = None
        if dx:
            t, k = dx
            if overlap.oar:
                pending = link.issue(k, t)
            else:
                link.blocking(k, t)
        link.compute(half)  # dW GEMM
        if pending is not None:
            link.wait(pending)
        for t, k, hides in after_of[i]:
            if hides:
                link.issue(k, t)
            else:
                link.blocking(k, t)
        if i == 0 and cfg.kind == "gpt":
            block_ln("backward")

    replay_blocks(link, cfg.layers, width, depth, issued, backward)
    link.wait_all()
    if not overlap.dp:
        for layer in reversed(names):
            for t, c in by_layer.get(layer, {}).get(("grad_allreduce", "backward"), []):
                link.blocking_times(key(c), t, cfg.layers)
    return link


def predict(cfg: ModelConfig, grid: GridShape, profile: MachineProfile,
            overlap: Optional[OverlapConfig] = None, dtype: str = "float32", progress: str = "poll",
            optimizer: str = "adam", ranks_per_node: Optional[int] = None, recompute: str = "none",
            attention: str = "unfused", precision: Optional[str] = None,
            shard_optimizer: str = "none", dw_window: Optional[int] = None,
            levels: Optional[Dict[str, str]] = None, strides: Optional[Dict[str, int]] = None,
            gemm_dtype: Optional[str] = None) -> Prediction:
    """Predict one training step of ``cfg`` on ``grid`` (see the module docstring).

    ``ranks_per_node``: ranks of the run per node (default: the profile's, or the world size when
    smaller). ``recompute``, ``attention``, ``precision``, ``shard_optimizer``: as in
    :func:`~fourd_mpi.perf.memory.estimate_memory` (they change compute and memory; sharding the
    optimizer over data keeps the data all-reduce's volume, a reduce-scatter plus an all-gather; this
    function prices the all-reduce, :func:`fourd_mpi.perf.prediction.predict_scenario` the two collectives).
    Raises :class:`~fourd_mpi.errors.ConfigError` when the profile lacks a level the grid needs and
    has no fallback. ``dw_window``: at most this many dW blocks in flight with ORS (memory only;
    :func:`~fourd_mpi.perf.memory.comm_buffer_elements`; None: every layer's, as this suite's step).
    ``levels``: ``axis -> "intra" | "inter"`` for a rank order other than consecutive ranks on a node
    (e.g. the placement a run recorded, :class:`~fourd_mpi.core.placement.NodePlacement`); axes it
    leaves out keep :func:`~fourd_mpi.perf.machine.axis_placement`'s level. ``strides``: ``axis -> ranks
    between neighbours of its group`` where the world is more than this grid (a pipeline's data axis
    strides over the stages); the rest are :func:`~fourd_mpi.perf.machine.axis_inner_products`. With the
    ranks per node they give how many of a group's ranks share a node (measured points of that
    placement price it). ``gemm_dtype``: as :func:`compute_time`'s (the 4D layers' GEMMs in another dtype, FP8).

    Long: the model's terms priced one after another into one Prediction; split, each needs the lot.
    """
    overlap = overlap or OverlapConfig()
    rpn = ranks_per_node or min(profile.ranks_per_node, grid.size)
    placement = {**axis_placement(grid, rpn), **(levels or {})}
    bad = {a: v for a, v in (levels or {}).items() if a not in ("data", "z", "y", "x") or v not in ("intra", "inter")}
    if bad:
        raise ConfigError(f"placement levels {bad}: give axis data|z|y|x -> intra|inter")
    inner = {**axis_inner_products(grid), **(strides or {})}
    notes: List[str] = []
    gemm_rate_tflops(profile, dtype, notes)
    comp = compute_time(cfg, grid, profile, overlap, dtype, rpn, optimizer, recompute=recompute,
                        attention=attention, precision=precision, gemm_dtype=gemm_dtype)
    efficiency = profile.overlap_efficiency
    memory = estimate_memory(cfg, grid, dtype, optimizer, overlap=overlap, recompute=recompute,
                             attention=attention, precision=precision, shard_optimizer=shard_optimizer,
                             dw_window=dw_window)
    one_block = step_collectives(_one_block(cfg), grid, overlap, dtype)
    if not profile.host_driven:
        return _predict_device(cfg, grid, profile, overlap, one_block, comp, placement, rpn, efficiency, memory,
                               notes, recompute, inner)
    if profile.host_driven and progress == "none":
        efficiency = 0.0
        if overlap.enabled and overlap.enabled != ["cache"]:
            notes.append("progress none on a CPU: nonblocking collectives do not progress during compute, "
                         "overlap hides nothing")
    # windows of compute each overlappable collective can hide behind (per message kind); every block has
    # block 0's collectives: each is priced once and counted L times (exact sums, as adding every layer's)
    per_layer_gemm = comp["gemm"] / max(1, len(fc_weights(cfg, grid)) * cfg.layers)
    backward_compute = comp["total"] * (2.0 / 3.0)
    comm = Sums()
    hidden = Sums()
    wire: Dict[str, int] = defaultdict(int)

    def hides(c: Collective) -> Optional[str]:
        option = OVERLAPS.get(c.role)
        return option if option is not None and getattr(overlap, option) and efficiency != 0.0 else None

    # the layers of a block with a collective that hides, in order: layer j of block b is the (b w + j)-th
    layer_index: Dict[str, int] = {}
    for c in one_block:
        if hides(c):
            layer_index.setdefault(c.layer, len(layer_index))
    width = len(layer_index)
    for c in one_block:
        runs = 1 if c.layer == "loss" else cfg.layers
        t = collective_time(c, profile, placement, rpn, inner, back_to_back(c.role, c.axis, overlap))
        key = (c.axis, c.op)
        comm.add_times(key, t, runs)
        wire[c.axis] += c.wire_bytes * runs
        option = hides(c)
        if option is None:
            continue
        if option == "oag":
            # every gather but the first of each pass runs behind the previous layers' GEMMs
            first = 1.0 / max(1, len(fc_weights(cfg, grid)) * cfg.layers)
            window = per_layer_gemm * overlap.prefetch_depth * (0.5 if c.phase == "forward" else 1.0)
            hidden.add_times(key, efficiency * min(t * (1 - first), window), runs)
        elif option == "od":
            window = per_layer_gemm / 3.0 * (c.count - 1) / max(1, c.count)
            hidden.add_times(key, efficiency * min(t * (c.count - 1) / max(1, c.count), window), runs)
        elif option == "oar":
            hidden.add_times(key, efficiency * min(t, per_layer_gemm / 3.0), runs)
        else:  # ors, dp: the rest of the backward pass (later layers in backward = earlier in forward)
            rest_of_backward(hidden, key, t, backward_compute, efficiency, layer_index[c.layer], width, runs)
    exposed = exposed_after_hiding(comm.floats(), hidden.floats(), efficiency * comp["total"])
    return assemble_prediction(grid, profile, comp, comm.floats(), exposed, wire, placement, memory, notes)


def rest_of_backward(hidden: Sums, key: Tuple[str, str], t: float, backward_compute: float, efficiency: float,
                     j: int, width: int, blocks: int) -> None:
    """Add to ``hidden[key]`` what the host-driven window rule hides of a collective of ``t`` seconds that ORS or
    DP overlap with the rest of the backward pass, in each of ``blocks`` blocks: in block ``b`` it is the layer
    ``i = b width + j`` (of those whose collectives hide) and hides ``efficiency * min(t, backward_compute * i /
    (i + 2))``. Once that window is surely at least ``t`` (``i >= first``) it hides ``efficiency * t``: those
    blocks are counted at once, the others one by one (all of them only when one layer's collective takes about
    as long as the whole backward pass)."""
    if width <= 0 or blocks <= 0:
        return
    margin = t * (1.0 + 1e-9)  # far above the float error of the window (a few ulp): the window is >= t beyond
    if backward_compute > margin and margin >= 0:
        first = int(2.0 * margin / (backward_compute - margin)) + 2
        explicit = min(blocks, max(0, -(-(first - j) // width)))
    else:
        explicit = blocks
    hidden.extend(key, [efficiency * min(t, backward_compute * i / max(1, i + 2))
                        for i in range(j, j + explicit * width, width)])
    hidden.add_times(key, efficiency * t, blocks - explicit)


def blocking_time(cfg: ModelConfig, grid: GridShape, profile: MachineProfile, overlap: OverlapConfig, dtype: str,
                  ranks_on_node: int, recompute: str = "none", levels: Optional[Dict[str, str]] = None,
                  strides: Optional[Dict[str, int]] = None) -> Dict[Tuple[str, str], float]:
    """Seconds per ``(axis, op)`` that :func:`predict` exposes whatever the timeline: collectives whose
    overlap option is off, every LayerNorm and loss all-reduce, the last chunk of an OD all-reduce (and,
    device-driven with full recompute, the forward all-reduces' second run). Every block has the same
    collectives: priced on one block, times ``L`` (memoized per profile on the block). ``levels``: as
    :func:`predict`'s (axes placed for another rank order); ``strides``: as :func:`predict`'s."""
    memo = profile.__dict__.setdefault("_blocking_memo", {})
    key = (_one_block(cfg), grid, overlap, dtype, ranks_on_node, recompute,
           tuple(sorted((levels or {}).items())), tuple(sorted((strides or {}).items())))
    if key not in memo:
        memo[key] = _blocking_parts(key[0], grid, profile, overlap, dtype, ranks_on_node, recompute, levels,
                                    strides)
    block, loss = memo[key]
    out = {k: t * cfg.layers for k, t in block.items()}
    for k, t in loss.items():
        out[k] = out.get(k, 0.0) + t
    return out


@lru_cache(maxsize=65536)
def _one_block(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with one block (memoized: the key of :func:`blocking_time`'s memo)."""
    return replace(cfg, layers=1)


def _blocking_parts(one_block: ModelConfig, grid: GridShape, profile: MachineProfile, overlap: OverlapConfig,
                    dtype: str, ranks_on_node: int, recompute: str, levels: Optional[Dict[str, str]] = None,
                    strides: Optional[Dict[str, int]] = None):
    """``(per block, loss)`` seconds by ``(axis, op)`` of :func:`blocking_time` for a one-block model."""
    placement = {**axis_placement(grid, ranks_on_node), **(levels or {})}
    inner = {**axis_inner_products(grid), **(strides or {})}
    memo = profile.__dict__.setdefault("_collective_memo", {})
    twice = recompute == "full" and not profile.host_driven
    hides = {role: bool(getattr(overlap, option)) for role, option in OVERLAPS.items()}
    block: Dict[Tuple[str, str], float] = defaultdict(float)
    loss: Dict[Tuple[str, str], float] = defaultdict(float)
    # the rows of step_collectives, priced through collective_time's memo (no Collective built when known;
    # the key is _price_key's, written out: this loop runs for every candidate of a pipeline search)
    for row in collective_rows(one_block, grid, overlap, dtype):
        layer, role, op, axis, p, _, count, nbytes = row
        hidden = hides.get(role, False)
        if hidden and (role != "fwd_allreduce" or count <= 1):
            continue
        run = back_to_back(role, axis, overlap)
        t = memo.get((op, axis, p, count, nbytes, placement[axis], ranks_on_node, inner[axis], run))
        if t is None:
            t = collective_time(Collective(*row), profile, placement, ranks_on_node, inner, run)
        if hidden:
            t /= count  # od: the last chunk waits for its own GEMM
        if twice and role == "fwd_allreduce":
            t *= 2
        (loss if layer == "loss" else block)[(axis, op)] += t
    return dict(block), dict(loss)


def lower_bound(cfg: ModelConfig, grid: GridShape, profile: MachineProfile,
                overlap: Optional[OverlapConfig] = None, dtype: str = "float32", optimizer: str = "adam",
                ranks_per_node: Optional[int] = None, recompute: str = "none", attention: str = "unfused",
                communication: bool = True, precision: Optional[str] = None, **_) -> float:
    """Seconds never above :func:`predict`'s step: its compute plus :func:`blocking_time` (``step = compute +
    exposed``; ``communication=False``: the compute alone, a looser and cheaper bound). ``tune`` skips,
    without predicting them, configurations whose bound exceeds the K-th fastest predicted step."""
    overlap = overlap or OverlapConfig()
    rpn = ranks_per_node or min(profile.ranks_per_node, grid.size)
    comp = compute_time(cfg, grid, profile, overlap, dtype, rpn, optimizer, recompute=recompute, attention=attention,
                        precision=precision)
    if not communication:
        return comp["total"]
    return comp["total"] + sum(blocking_time(cfg, grid, profile, overlap, dtype, rpn, recompute).values())


def predicted_memory(cfg: ModelConfig, grid: GridShape, dtype: str = "float32", optimizer: str = "adam",
                     overlap: Optional[OverlapConfig] = None, recompute: str = "none", attention: str = "unfused",
                     precision: Optional[str] = None, shard_optimizer: str = "none",
                     dw_window: Optional[int] = None, **_) -> MemoryEstimate:
    """The memory :func:`predict` reports for these arguments, without predicting the time (a ranking
    drops what does not fit first)."""
    return estimate_memory(cfg, grid, dtype, optimizer, overlap=overlap or OverlapConfig(), recompute=recompute,
                           attention=attention, precision=precision, shard_optimizer=shard_optimizer,
                           dw_window=dw_window)


def exposed_after_hiding(comm: Dict[Tuple[str, str], float], hidden: Dict[Tuple[str, str], float],
                         cap: float) -> Dict[Tuple[str, str], float]:
    """Exposed seconds per ``(axis, op)``: ``max(0, comm - hidden * scale)``, where ``scale`` shrinks the
    hidden seconds to at most ``cap`` in total (overlap cannot hide more than ``efficiency x`` the step's
    compute; 1 when they fit). The host-driven window rule's last step, for every algorithm's model."""
    total_hidden = sum(hidden.values())
    scale = cap / total_hidden if total_hidden > cap and total_hidden > 0 else 1.0
    return {k: max(0.0, v - hidden.get(k, 0.0) * scale) for k, v in comm.items()}


def _predict_device(cfg, grid, profile, overlap, colls, comp, placement, rpn, efficiency, memory, notes,
                    recompute, inner=None) -> Prediction:
    """The device-driven regime: exposed communication from :func:`device_timeline`. Every block repeats
    block 0's collectives: they are priced once (``colls`` of a one-block model) and counted ``L`` times."""
    colls = [c for c in colls if c.layer == "loss" or c.layer.startswith("block0.")]
    times = [(collective_time(c, profile, placement, rpn, inner, back_to_back(c.role, c.axis, overlap)), c.wire_bytes)
             for c in colls]
    comm = Sums()
    wire: Dict[str, int] = defaultdict(int)
    for c, (t, nbytes) in zip(colls, times):
        # full recompute: the forward all-reduces run again when the block is recomputed
        runs = ((2 if recompute == "full" and c.role == "fwd_allreduce" else 1)
                * (1 if c.layer == "loss" else cfg.layers))
        comm.add_times((c.axis, c.op), t, runs)
        wire[c.axis] += nbytes * runs
    link = device_timeline(cfg, grid, colls, [t for t, _ in times], comp, overlap, efficiency, recompute)
    comm = comm.floats()
    link_exposed = link.exposed
    exposed = {k: link_exposed.get(k, 0.0) for k in comm}
    return assemble_prediction(grid, profile, comp, comm, exposed, wire, placement, memory, notes)


def assemble_prediction(grid, profile, comp, comm, exposed, wire, placement, memory, notes) -> Prediction:
    """The :class:`Prediction` of both regimes: step = compute + exposed communication."""
    for note in profile.notes:
        if note not in notes:
            notes.append(note)
    step = comp["total"] + sum(exposed.values())
    return Prediction(grid=grid, step_s=step, compute_s=comp["total"], gemm_s=comp["gemm"] + comp["attention"],
                      comm_s=dict(comm), exposed_s=exposed, wire_bytes=dict(wire), placement=placement,
                      memory=memory, notes=notes)
