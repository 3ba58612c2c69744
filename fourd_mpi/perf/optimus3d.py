"""The performance model of Optimus-CUBE (``--algorithm optimus3d``): communication volumes, memory and
step time per rank (pure, no MPI), with the inputs and outputs of the 4D model's
(:func:`fourd_mpi.perf.volumes.step_collectives`, :func:`fourd_mpi.perf.memory.estimate_memory`,
:func:`fourd_mpi.perf.predict.predict`), so ``tune`` can rank both.

Notation: cube edge ``q`` (``G_x = G_y = G_z = q``), ``m = B*s/(G_data*q^2)`` tokens per rank (whole
sequences), ``e`` bytes per element; a layer ``W[n, k]`` whose input is gathered over ``gather`` and whose
output is scattered over ``scatter`` (parity 0: ``y``/``z``; parity 1: ``z``/``y``;
:mod:`fourd_mpi.algorithms.cube`). Messages follow the nccl-tests convention of the trace
(:class:`~fourd_mpi.core.commlog.CommRecord`: the gathered buffer of an all-gather, the full input of a
reduce-scatter, the buffer of an all-reduce):

==========================  ===============  =========  ==========================  =====
collective                  role             axis       message                     phase
==========================  ===============  =========  ==========================  =====
all-gather X                input_allgather  gather     ``m*k*e``                   fwd
all-gather W^T              weight_allgather x          ``(k/q)*(n/q)*e``           fwd
reduce-scatter Y            output_reduce_   scatter    ``m*n*e``                   fwd
                            scatter
all-gather dY               dy_allgather     scatter    ``m*n*e``                   bwd
reduce-scatter dX           dx_reduce_       gather     ``m*k*e``                   bwd
                            scatter
reduce-scatter dW           dw_reduce_       x          ``(k/q)*(n/q)*e``           bwd
                            scatter
gradient all-reduce         grad_allreduce   data       ``(k/q^2)*(n/q)*e``         bwd
==========================  ===============  =========  ==========================  =====

The weights gathered in forward are kept for backward (no backward all-gather). GPT blocks add per
LayerNorm two forward all-reduces over Z of ``[m, 1]`` and one backward of ``[m, 2]``, and for each of
``gamma, beta`` ``[h/q]`` an all-reduce over X, one over Y and one over data; the loss is summed over
data, Z, Y and X (one float64 each).

With ``--recompute full`` every forward collective but the weight all-gathers runs again (phase
``recompute``); ``selective`` all-gathers proj's input again once per GPT block.

Memory: weights ``(k/q^2)*(n/q)`` per layer and LayerNorm ``[h/q]``; the saved activations per GPT block
``xhat`` x2 ``[m, h/q]``, ``rstd`` x2 ``[m, 1]``, the gathered inputs of QKV, proj and FC1 ``[q*m, h/q]``
(``m*h`` each) and of FC2 ``[q*m, f/q]``, the QKV output ``[m, 3h/q]``, the attention probabilities
``[m/s, heads/q, s, s]``, the FC1 output ``[m, f/q]``; MLP: ``[q*m, h/q]``, ``[m, f/q]``, ``[q*m, f/q]``.

Time: compute as :func:`fourd_mpi.perf.predict.compute_time` counts it, on this algorithm's shapes (no
replicated work: attention, LayerNorm and GeLU run on ``m`` tokens and ``1/q`` of the hidden sizes);
each collective costed by :func:`~fourd_mpi.perf.predict.collective_time`; exposed communication in the
profile's regime, as :func:`~fourd_mpi.perf.predict.predict`: host-driven, the window rule (``oag`` hides
a weight gather behind the previous layer's GEMMs, ``oar`` a dX reduce-scatter behind the dW GEMM, ``ors``
and ``dp`` behind the rest of the backward pass); device-driven, a replay of the step on a
:class:`~fourd_mpi.perf.predict.Link` (:func:`device_timeline`). The input all-gathers, output
reduce-scatters, dY all-gathers, LayerNorm and loss all-reduces are always waited at once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, replace
from typing import Dict, List, Optional, Tuple

from fourd_mpi.algorithms.cube import axes_of
from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.core.grid import GridShape
from fourd_mpi.perf.exact import Sums
from fourd_mpi.perf.memory import ATTENTION, RECOMPUTE, MemoryEstimate, check_choice, state_bytes
from fourd_mpi.perf.volumes import Collective
from fourd_mpi.step.overlap import DEFAULT_PREFETCH_DEPTH, OverlapConfig
from fourd_mpi.step.presets import ModelConfig

#: which overlap option can hide each kind of collective (the others are waited at once)
OVERLAPS = {"weight_allgather": "oag", "dw_reduce_scatter": "ors", "dx_reduce_scatter": "oar",
            "grad_allreduce": "dp"}


def layers(cfg: ModelConfig) -> List[Tuple[str, int, int, int]]:
    """The linear layers of one block, in forward order: ``(name, n_out, k_in, parity)``."""
    h, f = cfg.hidden, cfg.ffn_hidden
    if cfg.kind == "gpt":
        return [("qkv", 3 * h, h, 0), ("proj", h, h, 1), ("fc1", f, h, 0), ("fc2", h, f, 1)]
    return [("fc1", f, h, 0), ("fc2", h, f, 1)]


def local_tokens(cfg: ModelConfig, grid: GridShape) -> int:
    """``m = B*s/(G_data*q^2)``."""
    return cfg.batch // (grid.data * grid.x * grid.x) * cfg.seq


def step_collectives(cfg: ModelConfig, grid: GridShape, overlap: Optional[OverlapConfig] = None,
                     dtype: str = "float32", recompute: str = "none") -> List[Collective]:
    """Every collective of one optimus3d training step on one rank, in program order per layer (module
    docstring). Collectives over an axis of size 1 are not issued and not listed. ``overlap`` changes
    when they are waited, not what is sent. ``recompute``: ``full`` repeats every forward collective but
    the weight all-gathers (phase ``recompute``); ``selective`` adds proj's input all-gather per GPT block."""
    check_choice("recompute", recompute, RECOMPUTE)
    e = dtype_bytes(dtype)
    q = grid.x
    m = local_tokens(cfg, grid)
    out: List[Collective] = []

    def add(layer, role, op, axis, phase, count, message):
        if grid[axis] > 1 and count > 0:
            out.append(Collective(layer, role, op, axis, grid[axis], phase, count, int(message)))

    for b in range(cfg.layers):
        if cfg.kind == "gpt":
            for ln in ("ln1", "ln2"):
                name = f"block{b}.{ln}"
                add(name, "ln_allreduce", "allreduce", "z", "forward", 2, m * e)
                if recompute == "full":
                    add(name, "ln_allreduce", "allreduce", "z", "recompute", 2, m * e)
                add(name, "ln_allreduce", "allreduce", "z", "backward", 1, 2 * m * e)
                for axis in ("x", "y", "data"):
                    add(name, "ln_grad_allreduce", "allreduce", axis, "backward", 2, cfg.hidden // q * e)
        for lname, n, k, parity in layers(cfg):
            name = f"block{b}.{lname}"
            gather, scatter = axes_of(parity)
            block = (k // q) * (n // q)
            add(name, "input_allgather", "allgather", gather, "forward", 1, m * k * e)
            add(name, "weight_allgather", "allgather", "x", "forward", 1, block * e)
            add(name, "output_reduce_scatter", "reduce_scatter", scatter, "forward", 1, m * n * e)
            if recompute == "full" or (recompute == "selective" and lname == "proj"):
                add(name, "input_allgather", "allgather", gather, "recompute", 1, m * k * e)
            if recompute == "full":
                add(name, "output_reduce_scatter", "reduce_scatter", scatter, "recompute", 1, m * n * e)
            add(name, "dy_allgather", "allgather", scatter, "backward", 1, m * n * e)
            add(name, "dx_reduce_scatter", "reduce_scatter", gather, "backward", 1, m * k * e)
            add(name, "dw_reduce_scatter", "reduce_scatter", "x", "backward", 1, block * e)
            add(name, "grad_allreduce", "allreduce", "data", "backward", 1, block // q * e)
    for axis in ("data", "z", "y", "x"):
        add("loss", "loss", "allreduce", axis, "forward", 1, 8)
    return out


def parameter_elements(cfg: ModelConfig, grid: GridShape) -> int:
    """Elements of every parameter shard this rank stores."""
    q = grid.x
    per_block = sum((k // (q * q)) * (n // q) for _, n, k, _ in layers(cfg))
    if cfg.kind == "gpt":
        per_block += 4 * (cfg.hidden // q)
    return cfg.layers * per_block


def block_saved_elements(cfg: ModelConfig, grid: GridShape, attention: str = "unfused",
                         recompute: str = "none") -> int:
    """Elements one block keeps for its backward when it is not recomputed as a whole (module docstring;
    ``selective``: without the attention probabilities and proj's gathered input ``[q*m, h/q]``)."""
    q, m, h, f = grid.x, local_tokens(cfg, grid), cfg.hidden, cfg.ffn_hidden
    if cfg.kind != "gpt":
        return m * h + m * (f // q) + m * f
    if recompute == "selective":
        return 2 * m * (h // q) + 2 * m + 2 * m * h + m * f + m * (3 * h // q) + m * (f // q)
    if attention == "fused":
        attn = (m // cfg.seq) * (cfg.heads // q) * cfg.seq
    else:
        attn = (m // cfg.seq) * (cfg.heads // q) * cfg.seq * cfg.seq
    return 2 * m * (h // q) + 2 * m + 3 * m * h + m * f + m * (3 * h // q) + attn + m * (f // q)


def saved_activation_elements(cfg: ModelConfig, grid: GridShape, attention: str = "unfused",
                              recompute: str = "none") -> int:
    """Elements the forward pass saves for backward, whole stack (module docstring); ``full``: each block's
    input ``[m, h/q]`` plus one block's working set (the block being recomputed), as
    :func:`fourd_mpi.perf.memory.saved_activation_elements` counts it."""
    check_choice("attention", attention, ATTENTION)
    check_choice("recompute", recompute, RECOMPUTE)
    if recompute == "full":
        return (cfg.layers * local_tokens(cfg, grid) * (cfg.hidden // grid.x)
                + block_saved_elements(cfg, grid, attention, "none"))
    return cfg.layers * block_saved_elements(cfg, grid, attention, recompute)


def activation_elements(cfg: ModelConfig, grid: GridShape, attention: str = "unfused", recompute: str = "none") -> int:
    """Saved activations, the step's input and target ``[m, h/q]`` and the largest transient (the attention
    scores, or the widest gathered output ``[q*m, max(3h, f)/q]``)."""
    q, m = grid.x, local_tokens(cfg, grid)
    widest = m * max(n for _, n, _, _ in layers(cfg))
    probs = (m // cfg.seq) * (cfg.heads // q) * cfg.seq * cfg.seq if cfg.kind == "gpt" and attention == "unfused" else 0
    return saved_activation_elements(cfg, grid, attention, recompute) + 2 * m * (cfg.hidden // q) + max(widest, probs)


def comm_buffer_elements(cfg: ModelConfig, grid: GridShape, overlap: OverlapConfig) -> int:
    """Elements of communication buffers alive at once (upper bound): every layer's gathered weight (kept
    for backward), the dW blocks and shards in flight (all with ORS, else one), the reduce-scatter input
    and output of the widest layer ``[q*m, n/q]`` + ``[m, n/q]``."""
    q, m = grid.x, local_tokens(cfg, grid)
    one = [(k // q) * (n // q) for _, n, k, _ in layers(cfg)]  # every block's (counted L times, not listed)
    total = 0
    if q > 1:
        total += sum(one) * cfg.layers
        total += sum(b + b // q for b in one) * cfg.layers if overlap.ors else max(one) + max(one) // q
        widest = max(n for _, n, _, _ in layers(cfg))
        total += m * widest + m * (widest // q)
    return total


def estimate_memory(cfg: ModelConfig, grid: GridShape, dtype: str = "float32", optimizer: str = "adam",
                    cache_weights: bool = True, prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
                    overlap: Optional[OverlapConfig] = None, recompute: str = "none", attention: str = "unfused",
                    precision: Optional[str] = None, shard_optimizer: str = "none") -> MemoryEstimate:
    """Bytes per rank of training ``cfg`` with optimus3d on ``grid`` (categories as
    :func:`fourd_mpi.perf.memory.estimate_memory`; ``cache_weights`` and ``prefetch_depth`` are accepted for
    the same signature: optimus3d always keeps its gathered weights)."""
    overlap = overlap or OverlapConfig(oag=True, cache=True, prefetch_depth=prefetch_depth)
    state = state_bytes(parameter_elements(cfg, grid), grid, dtype, optimizer, precision, shard_optimizer)
    e = dtype_bytes(dtype)
    return MemoryEstimate(
        **state,
        activations=activation_elements(cfg, grid, attention, recompute) * e,
        comm_buffers=comm_buffer_elements(cfg, grid, overlap) * e,
    )


def compute_time(cfg: ModelConfig, grid: GridShape, profile, overlap: OverlapConfig, dtype: str, ranks_on_node: int,
                 optimizer: str = "adam", attention: str = "unfused", recompute: str = "none") -> Dict[str, float]:
    """Seconds of local work per step (keys as :func:`fourd_mpi.perf.predict.compute_time`: ``gemm``,
    ``attention``, ``elementwise``, ``calls``, ``total``, ``optimizer``), each scaled by the profile's term
    weights: GEMMs ``3 * 2 * (q*m) * (k/q) * (n/q)`` per layer, attention ``12*m*s*h/q`` per GPT block,
    LayerNorm over ``[m, h/q]``, GeLU over ``[m, f/q]``, softmax over ``[m/s, heads/q, s, s]``, Adam over the
    shards, at the profile's GEMM rate and memory bandwidth; ``recompute`` adds the forward share (a third)
    of the block work again (``full``) or of the attention core (``selective``), ``recompute`` says how much."""
    from fourd_mpi.perf import predict as p4

    check_choice("attention", attention, ATTENTION)
    e = dtype_bytes(dtype)
    rate = p4.gemm_rate_tflops(profile, dtype) * 1e12
    bw, call = profile.mem_bandwidth, profile.op_overhead_s
    slow = profile.oversubscription(ranks_on_node)
    q, m = grid.x, local_tokens(cfg, grid)
    gemm_flops = cfg.layers * sum(3 * 2.0 * (q * m) * (k // q) * (n // q) for _, n, k, _ in layers(cfg))
    calls = cfg.layers * len(layers(cfg)) * (3 + 8)  # GEMMs, plus reshapes, handles and collective bookkeeping
    passes, attn_flops, softmax_passes, softmax_calls = 0.0, 0.0, 0.0, 0
    if cfg.kind == "gpt":
        attn_flops = cfg.layers * 12.0 * m * cfg.seq * (cfg.hidden // q)
        probs = (m // cfg.seq) * (cfg.heads // q) * cfg.seq * cfg.seq
        softmax_passes = 0.0 if attention == "fused" else cfg.layers * p4.SOFTMAX_PASSES * probs
        softmax_calls = 0 if attention == "fused" else cfg.layers * p4.SOFTMAX_CALLS
        hq = cfg.hidden // q
        passes += cfg.layers * (2 * p4.LN_PASSES * m * hq + 4 * m * hq) + softmax_passes
        calls += cfg.layers * (2 * p4.LN_CALLS + 6 + 4) + softmax_calls
    passes += cfg.layers * p4.GELU_PASSES * m * (cfg.ffn_hidden // q)
    calls += cfg.layers * p4.GELU_CALLS
    params = parameter_elements(cfg, grid)
    n_params = len(layers(cfg)) * cfg.layers + (4 * cfg.layers if cfg.kind == "gpt" else 0)
    opt_passes, opt_calls = (p4.ADAM_PASSES * params, p4.ADAM_CALLS * n_params) if optimizer == "adam" else (0, 0)
    check_choice("recompute", recompute, RECOMPUTE)
    rec = {"none": (0.0, 0.0, 0.0, 0.0),
           "full": (gemm_flops / 3.0, attn_flops / 3.0, passes / 3.0, calls / 3.0),
           "selective": (0.0, attn_flops / 3.0, softmax_passes / 3.0, softmax_calls / 3.0)}[recompute]
    w = profile.term_weights
    rec_time = (w["gemm"] * rec[0] / rate + w["attention"] * rec[1] / rate + w["elementwise"] * rec[2] * e / bw
                + w["calls"] * rec[3] * call)
    gemm = w["gemm"] * (gemm_flops + rec[0]) / rate
    attention_t = w["attention"] * (attn_flops + rec[1]) / rate
    elementwise = w["elementwise"] * (passes + rec[2] + opt_passes) * e / bw
    overhead = w["calls"] * (calls + rec[3] + opt_calls) * call
    opt_time = w["elementwise"] * opt_passes * e / bw + w["calls"] * opt_calls * call
    total = (gemm + attention_t + elementwise + overhead) * slow
    block_other = (w["attention"] * attn_flops / rate + w["elementwise"] * passes * e / bw + w["calls"] * calls * call)
    return {"gemm": gemm * slow, "attention": attention_t * slow, "elementwise": elementwise * slow,
            "calls": overhead * slow, "total": total, "optimizer": opt_time * slow, "oversubscription": slow,
            "recompute": rec_time * slow, "recompute_gemm": w["gemm"] * rec[0] / rate * slow,
            "block_other": block_other * slow, "gemm_per_flop": w["gemm"] * slow / rate}


def device_timeline(cfg: ModelConfig, grid: GridShape, colls: List[Collective], times: List[float],
                    comp: Dict[str, float], overlap: OverlapConfig, efficiency: float, recompute: str = "none"):
    """Replay one optimus3d step on a :class:`~fourd_mpi.perf.predict.Link` (the device-driven regime of
    :mod:`fourd_mpi.perf.predict`): per layer, forward: LayerNorm statistics (blocking), the weight gathers
    issued ``prefetch_depth`` layers ahead with ``oag`` (else blocking), the input all-gather (blocking),
    the GEMM and a third of the block's other work, the output reduce-scatter (blocking); backward, last
    layer first: with full recompute the layer's forward collectives and work again, the dY all-gather
    (blocking), the dX GEMM, its reduce-scatter (in flight during the dW GEMM with ``oar``), the dW GEMM,
    its reduce-scatter (in flight with ``ors``) and the data all-reduce (in flight with ``dp``, else at the
    end). ``colls``: block 0's collectives and the loss (every block has the same; other blocks' are
    ignored); ``times[i]``: seconds of all messages of ``colls[i]``. The blocks run through
    :func:`~fourd_mpi.perf.predict.replay_blocks` (the cost does not grow with the layer count once the
    timeline repeats).

    Long: one step's replay in issue order, as the docstring lists it; split, the order is harder to check.
    """
    from fourd_mpi.perf.predict import Link, replay_blocks

    link = Link(efficiency)
    q, m = grid.x, local_tokens(cfg, grid)
    per_block = layers(cfg)
    width = len(per_block)
    count = cfg.layers * width
    names = [f"block0.{name}" for name, _, _, _ in per_block]
    gemm_f = [2.0 * (q * m) * (k // q) * (n // q) * comp["gemm_per_flop"] for _, n, k, _ in per_block]
    other = comp["block_other"] / max(1, count)
    rec_other = (comp["recompute"] - comp["recompute_gemm"]) / max(1, count)
    by: Dict[str, Dict[Tuple[str, str], List[Tuple[float, Collective]]]] = defaultdict(lambda: defaultdict(list))
    for c, t in zip(colls, times):
        if c.layer == "loss" or c.layer.startswith("block0."):
            by[c.layer][(c.role, c.phase)].append((t, c))

    def blocking(layer: str, role: str, phase: str) -> None:
        for t, c in by.get(layer, {}).get((role, phase), []):
            link.blocking((c.axis, c.op), t)

    def ln(phase: str) -> None:
        if cfg.kind == "gpt":
            for name in ("ln1", "ln2"):
                for (role, ph), items in by.get(f"block0.{name}", {}).items():
                    if ph == phase:
                        for t, c in items:
                            link.blocking((c.axis, c.op), t)

    depth = overlap.prefetch_depth if overlap.oag else 0
    issued: Dict[int, Optional[list]] = {}

    def forward(j: int) -> None:
        i = j % width
        if i == 0:
            ln("forward")
        for ahead in range(j, min(j + depth + 1, count)):
            if ahead not in issued:
                items = by.get(names[ahead % width], {}).get(("weight_allgather", "forward"), [])
                issued[ahead] = None
                if items:
                    t, c = items[0]
                    if overlap.oag:
                        issued[ahead] = link.issue((c.axis, c.op), t)
                    else:
                        link.blocking((c.axis, c.op), t)
        blocking(names[i], "input_allgather", "forward")
        if issued.get(j) is not None:
            link.wait(issued[j])
        link.compute(gemm_f[i] + other / 3.0)
        blocking(names[i], "output_reduce_scatter", "forward")

    replay_blocks(link, cfg.layers, width, depth, issued, forward)
    blocking("loss", "loss", "forward")

    def backward(j: int) -> None:  # position j: layer count-1-j
        i = width - 1 - j % width
        layer = names[i]
        if recompute == "full":
            if i == width - 1:
                ln("recompute")
            blocking(layer, "input_allgather", "recompute")
            link.compute(gemm_f[i] + rec_other)
            blocking(layer, "output_reduce_scatter", "recompute")
        elif recompute == "selective":
            blocking(layer, "input_allgather", "recompute")
            link.compute(rec_other)
        blocking(layer, "dy_allgather", "backward")
        half = gemm_f[i] + other / 3.0
        link.compute(half)  # dX GEMM
        pending = None
        for t, c in by.get(layer, {}).get(("dx_reduce_scatter", "backward"), []):
            if overlap.oar:
                pending = link.issue((c.axis, c.op), t)
            else:
                link.blocking((c.axis, c.op), t)
        link.compute(half)  # dW GEMM
        if pending is not None:
            link.wait(pending)
        for role, option in (("dw_reduce_scatter", "ors"), ("grad_allreduce", "dp")):
            for t, c in by.get(layer, {}).get((role, "backward"), []):
                if role == "grad_allreduce" and not overlap.dp:
                    continue  # at the end, below
                if getattr(overlap, option):
                    link.issue((c.axis, c.op), t)
                else:
                    link.blocking((c.axis, c.op), t)
        if i == 0:
            ln("backward")

    replay_blocks(link, cfg.layers, width, 0, {}, backward)
    link.wait_all()
    if not overlap.dp:
        for layer in reversed(names):
            for t, c in by.get(layer, {}).get(("grad_allreduce", "backward"), []):
                link.blocking_times((c.axis, c.op), t, cfg.layers)
    return link


def predict(cfg: ModelConfig, grid: GridShape, profile, overlap: Optional[OverlapConfig] = None,
            dtype: str = "float32", progress: str = "poll", optimizer: str = "adam",
            ranks_per_node: Optional[int] = None, recompute: str = "none", attention: str = "unfused",
            precision: Optional[str] = None, shard_optimizer: str = "none"):
    """Predict one optimus3d training step (same arguments and :class:`~fourd_mpi.perf.predict.Prediction` as
    :func:`fourd_mpi.perf.predict.predict`; module docstring for the model)."""
    from fourd_mpi.perf.machine import axis_inner_products, axis_placement
    from fourd_mpi.perf.predict import assemble_prediction, collective_time, exposed_after_hiding, rest_of_backward

    overlap = OverlapConfig(**{**asdict(overlap or OverlapConfig()), "cache": True})
    rpn = ranks_per_node or min(profile.ranks_per_node, grid.size)
    placement = axis_placement(grid, rpn)
    inner = axis_inner_products(grid)
    notes: List[str] = []
    comp = compute_time(cfg, grid, profile, overlap, dtype, rpn, optimizer, attention, recompute)
    # every block has block 0's collectives: each is priced once and counted L times (exact sums)
    colls = step_collectives(replace(cfg, layers=1), grid, overlap, dtype, recompute)
    memory = estimate_memory(cfg, grid, dtype, optimizer, overlap=overlap, recompute=recompute, attention=attention,
                             precision=precision, shard_optimizer=shard_optimizer)
    efficiency = profile.overlap_efficiency
    if profile.host_driven and progress == "none":
        efficiency = 0.0
        if set(overlap.enabled) - {"cache"}:
            notes.append("progress none on a CPU: nonblocking collectives do not progress during compute, "
                         "overlap hides nothing")
    comm = Sums()
    wire: Dict[str, int] = defaultdict(int)
    times = [collective_time(c, profile, placement, rpn, inner) for c in colls]
    for c, t in zip(colls, times):
        runs = 1 if c.layer == "loss" else cfg.layers
        comm.add_times((c.axis, c.op), t, runs)
        wire[c.axis] += c.wire_bytes * runs
    if not profile.host_driven:
        link = device_timeline(cfg, grid, colls, times, comp, overlap, efficiency, recompute)
        link_exposed = link.exposed
        exposed = {k: link_exposed.get(k, 0.0) for k in comm.sums}
        return assemble_prediction(grid, profile, comp, comm.floats(), exposed, dict(wire), placement, memory, notes)
    n_layers = max(1, len(layers(cfg)) * cfg.layers)
    per_layer_gemm = comp["gemm"] / n_layers
    backward_compute = comp["total"] * (2.0 / 3.0)
    hidden = Sums()

    def hides(c: Collective) -> Optional[str]:
        option = OVERLAPS.get(c.role)
        return option if option is not None and getattr(overlap, option) and efficiency != 0.0 else None

    # the layers of a block with a collective that hides, in order: layer j of block b is the (b w + j)-th
    layer_index: Dict[str, int] = {}
    for c in colls:
        if hides(c):
            layer_index.setdefault(c.layer, len(layer_index))
    for c, t in zip(colls, times):
        option = hides(c)
        if option is None:
            continue
        key, runs = (c.axis, c.op), cfg.layers
        if option == "oag":  # every gather but the first runs behind the previous layers' GEMMs
            window = per_layer_gemm / 3.0 * overlap.prefetch_depth
            hidden.add_times(key, efficiency * min(t * (1 - 1.0 / n_layers), window), runs)
        elif option == "oar":  # behind the dW GEMM
            hidden.add_times(key, efficiency * min(t, per_layer_gemm / 3.0), runs)
        else:  # ors, dp: the rest of the backward pass
            rest_of_backward(hidden, key, t, backward_compute, efficiency, layer_index[c.layer], len(layer_index),
                             runs)
    exposed = exposed_after_hiding(comm.floats(), hidden.floats(), efficiency * comp["total"])
    return assemble_prediction(grid, profile, comp, comm.floats(), exposed, dict(wire), placement, memory, notes)


def admission_memory(options, attention: str = "unfused") -> Tuple[MemoryEstimate, int]:
    """Optimus-CUBE's admission hook (:attr:`fourd_mpi.algorithms.families.Family.admission`): the
    :func:`estimate_memory` of a run's resolved options (:class:`~fourd_mpi.algorithms.runoptions.RunOptions`) with
    the attention kernels that will run (``unfused`` or a fused mode), and the tokens per rank
    ``m = B*s/(G_data*q^2)`` (:func:`local_tokens`: the batch split over data, X and Y)."""
    cfg, grid = options.model, options.grid
    estimate = estimate_memory(cfg, grid, dtype=options.dtype, optimizer=options.optimizer,
                               overlap=options.overlap,
                               attention="unfused" if attention == "unfused" else "fused")
    return estimate, local_tokens(cfg, grid)
