"""Memory per rank of a training step: what :mod:`fourd_mpi.step.layers`, :mod:`fourd_mpi.step.model`
and :mod:`fourd_mpi.step.optim` actually keep, counted from the shapes, and what a GPU run with mixed
precision, activation recompute and fused (flash) attention keeps (pure, no MPI).

Notation (docs/design.md section 2): ``m = B*s/(G_data*G_z)`` local tokens, ``h`` hidden,
``f`` MLP hidden, ``e`` the dtype's item size in bytes. A weight ``W[n, k]`` of a normal
layer has blocks ``[n/G_y, k/G_x]`` (transposed: ``[n/G_x, k/G_y]``); a rank stores
``n*k/(G_x*G_y*G_z)`` elements of it.

Categories (bytes, per rank, at the step's peak: the end of the forward pass, or the backward of
the first block with recompute):

``weights``      FC weight shards ``n*k/(G_x*G_y*G_z)`` and LayerNorm ``gamma, beta`` ``[h/G_x]``, in the
                 run dtype (``e`` bytes each).
``gradients``    one gradient per parameter, the size of its shard, in the run dtype.
``master``       precision ``mixed`` only: an fp32 copy of every parameter shard the optimizer updates
                 (4 bytes each; Megatron-LM and AxoNN keep one with bf16/fp16 training).
``optimizer``    Adam: ``m`` and ``v`` per parameter (2 per parameter, run dtype with ``pure``, fp32 with
                 ``mixed``); SGD (momentum 0): nothing. ``shard_optimizer="data"`` divides master and
                 optimizer state by ``G_data`` (Megatron's distributed optimizer, ZeRO stage 1).
``activations``  what the forward saves for backward, per block, by ``recompute``:
                 ``none``: GPT: ``xhat, a, xhat2, b`` ``[m, h/G_x]`` each, ``rstd`` x2 ``[m, 1]``, the QKV
                 output ``[m, 3h/G_y]`` (q, k, v are views of it; ``[m, (h + 2 h kv/heads)/G_y]`` with
                 grouped-query attention), the attention probabilities
                 ``[m/s, heads/G_y, s, s]`` (``attention="fused"``: the per-row log-sum-exp
                 ``[m/s, heads/G_y, s]`` instead, as flash attention keeps), the context ``[m, h/G_y]``,
                 ``u`` and ``gelu(u)`` ``[m, f/G_y]`` (SwiGLU: the FC1 output ``[m, 2f/G_y]`` and its
                 product ``[m, f/G_y]``); MLP: ``x [m, h/G_x]``, ``u, g [m, f/G_y]``;
                 ``selective``: the same without the attention probabilities and the context (the
                 attention core, scores to context, is recomputed in backward);
                 ``full``: only each block's input ``[m, h/G_x]``, plus one block's ``none`` set (the
                 block being recomputed and differentiated);
                 plus the step's input and target ``[m, h/G_x]`` and the largest transient of a
                 layer (the attention scores ``[m/s, heads/G_y, s, s]`` in an unfused GPT, else one
                 ``[m, f/G_y]`` output).
``comm_buffers`` all-gathered weight blocks alive at once (1, or ``prefetch_depth + 1`` with
                 OAG; every layer's block with ``cache``), the all-reduce send/receive pair
                 of the largest activation ``[m, max(3h, f)/G_y]``, and the ``dW`` blocks whose
                 reduce-scatter is in flight (1, or every layer's with ORS: the step keeps their
                 handles, and so their buffers, until the optimizer; ``dw_window`` bounds them,
                 as FSDP and ZeRO-3 bound their buckets).

``total`` is the sum of the counted bytes. What a device must hold is more: :meth:`MemoryEstimate.required`
adds :data:`ALLOCATOR_MARGIN` (caching-allocator fragmentation and NumPy/CuPy temporaries) and, on a GPU,
:data:`GPU_RUNTIME_RESERVE_BYTES` (CUDA/HIP context, BLAS and MPI/NCCL workspaces).

Exactness: weights, gradients and optimizer state are exact (tested against the arrays of a
built run); activations are exact for the saved tensors and approximate for transients
(NumPy temporaries are not counted); communication buffers are an upper bound of the
buffers alive at one time. ``master`` and ``attention="fused"`` describe a GPU framework (AxoNN,
Megatron-LM): this suite's own step keeps its state in the run dtype (``precision="pure"``) and
computes attention unfused.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.core.grid import GridShape
from fourd_mpi.step.overlap import DEFAULT_PREFETCH_DEPTH, OverlapConfig
from fourd_mpi.step.presets import ModelConfig
from fourd_mpi.util.units import GIB

if TYPE_CHECKING:  # annotations only
    from fourd_mpi.perf.machine import MachineProfile

#: activation recompute choices (what the forward keeps for backward, module docstring)
RECOMPUTE = ("none", "selective", "full")
#: attention implementations: ``unfused`` keeps the ``s x s`` probabilities (this suite's step),
#: ``fused`` (flash attention) keeps only a log-sum-exp per query row
ATTENTION = ("unfused", "fused")
#: ``mixed``: 16-bit weights and gradients, fp32 master copy and fp32 Adam moments (Megatron-LM,
#: AxoNN with bf16); ``pure``: everything in the run dtype (this suite's step)
PRECISIONS = ("mixed", "pure")
#: where the optimizer state is sharded beyond the 4D shards: ``none`` (the suite's step) or ``data``
#: (Megatron-LM's distributed optimizer / ZeRO stage 1: master copy and moments split over G_data)
OPTIMIZER_SHARDING = ("none", "data")
#: Fraction added to the counted bytes before comparing with a device: a caching allocator
#: (CuPy's pool, PyTorch's) rounds blocks up and fragments, and element-wise kernels make temporaries
#: the count leaves out. 10 % is an assumption (PyTorch's documentation of the caching allocator
#: discusses fragmentation without a single figure); ``tune --memory-limit`` moves the limit instead.
ALLOCATOR_MARGIN = 0.10
#: Bytes a GPU process holds beyond its arrays: the CUDA/HIP context (hundreds of MiB on an A100),
#: cuBLAS/hipBLAS workspaces and the MPI/NCCL staging buffers. An assumption, stated once here.
GPU_RUNTIME_RESERVE_BYTES = 1 * GIB
_16BIT = ("float16", "bfloat16")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by category; ``total`` is their sum (the module docstring defines each)."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    comm_buffers: int
    master: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.master + self.optimizer + self.activations
                + self.comm_buffers)

    def required(self, reserve_bytes: int = 0, margin: float = ALLOCATOR_MARGIN) -> int:
        """Bytes a device needs: ``ceil(total * (1 + margin)) + reserve_bytes`` (pass
        :data:`GPU_RUNTIME_RESERVE_BYTES` for a GPU)."""
        return int(math.ceil(self.total * (1.0 + margin))) + int(reserve_bytes)

    def as_dict(self) -> Dict[str, int]:
        d = asdict(self)
        d["total"] = self.total
        return d

    def describe(self) -> str:
        """``1.23 GiB (weights 0.1, grads 0.1, optimizer 0.2, activations 0.8, comm 0.03 GiB)``."""
        g = GIB
        master = f"master {self.master / g:.3g}, " if self.master else ""
        return (f"{self.total / g:.3g} GiB (weights {self.weights / g:.3g}, grads {self.gradients / g:.3g}, "
                f"{master}optimizer {self.optimizer / g:.3g}, activations {self.activations / g:.3g}, "
                f"comm {self.comm_buffers / g:.3g})")


def fc_weights(cfg: ModelConfig, grid: GridShape) -> List[Tuple[str, int, int, bool]]:
    """The 4D layers of one block, in forward order: ``(name, n_out, k_in, transposed)``
    (:meth:`~fourd_mpi.step.presets.ModelConfig.weight_shapes`: grouped-query attention and SwiGLU included)."""
    return cfg.weight_shapes()


def _qkv_mlp_widths(cfg: ModelConfig, grid: GridShape) -> Tuple[int, int]:
    """``(QKV output, MLP elements a token keeps)`` per rank: ``(h + 2 h kv/heads)/G_y`` (``3h/G_y`` with multi-head
    attention); GeLU ``u`` and ``gelu(u)`` ``2 f/G_y``, SwiGLU the FC1 output ``[2f/G_y]`` (gate and up) and its
    product ``[f/G_y]``, ``3 f/G_y`` (Megatron-LM's ``bias_swiglu`` keeps its input for the backward)."""
    qkv = next((n for name, n, _, _ in cfg.weight_shapes() if name == "qkv"), 3 * cfg.hidden)
    fy = cfg.ffn_hidden // grid.y
    return qkv // grid.y, (3 if cfg.mlp == "swiglu" else 2) * fy


def block_elements(n_out: int, k_in: int, transposed: bool, grid: GridShape) -> int:
    """Elements of the (all-gathered) weight block ``[n/out_axis, k/in_axis]``."""
    out_axis, in_axis = ("x", "y") if transposed else ("y", "x")
    return (n_out // grid[out_axis]) * (k_in // grid[in_axis])


def local_tokens(cfg: ModelConfig, grid: GridShape) -> int:
    """``m = B*s/(G_data*G_z)`` (whole sequences per rank)."""
    return (cfg.batch // (grid.data * grid.z)) * cfg.seq


def parameter_elements(cfg: ModelConfig, grid: GridShape, blocks: Optional[Sequence[int]] = None) -> int:
    """Elements of every parameter shard this rank stores. ``blocks``: the :func:`block_elements` of the
    block's FC weights when the caller has them already (in :func:`fc_weights` order)."""
    if blocks is None:
        blocks = [block_elements(n, k, t, grid) for _, n, k, t in fc_weights(cfg, grid)]
    per_block = sum(-(-block // grid.z) for block in blocks)  # ceil: a padded shard (DeepSpeed) = exact otherwise
    if cfg.kind == "gpt":
        per_block += 4 * (cfg.hidden // grid.x)  # two LayerNorms, gamma and beta [h/x]
    return cfg.layers * per_block


def check_choice(name: str, value: str, choices) -> None:
    """Refuse ``value`` unless it is one of ``choices``: ``unknown NAME 'VALUE': choose A, B`` (a ConfigError)."""
    if value not in choices:
        from fourd_mpi.errors import ConfigError

        raise ConfigError(f"unknown {name} {value!r}: choose {', '.join(choices)}")


def block_saved_elements(cfg: ModelConfig, grid: GridShape, attention: str = "unfused",
                         recompute: str = "none") -> int:
    """Elements one block keeps for its backward when it is not recomputed as a whole
    (``recompute`` none or selective; module docstring)."""
    m, h = local_tokens(cfg, grid), cfg.hidden
    hx, hy = h // grid.x, h // grid.y
    qkv, mlp = _qkv_mlp_widths(cfg, grid)
    if cfg.kind != "gpt":
        return m * (hx + mlp)
    if recompute == "selective":  # the attention core (scores, softmax, context) runs again in backward
        return m * (4 * hx + 2 + qkv + mlp)
    if attention == "fused":
        attn = (m // cfg.seq) * (cfg.heads // grid.y) * cfg.seq  # log-sum-exp per query row
    else:
        attn = _probs_elements(cfg, grid)
    return m * (4 * hx + 2 + qkv + hy + mlp) + attn


def saved_activation_elements(cfg: ModelConfig, grid: GridShape, recompute: str = "none",
                              attention: str = "unfused") -> int:
    """Elements the forward pass saves for backward, whole stack (module docstring lists them).

    ``recompute="full"``: each block's input ``[m, h/G_x]`` plus one block's working set."""
    check_choice("recompute", recompute, RECOMPUTE)
    check_choice("attention", attention, ATTENTION)
    if recompute == "full":
        m, hx = local_tokens(cfg, grid), cfg.hidden // grid.x
        return cfg.layers * m * hx + block_saved_elements(cfg, grid, attention, "none")
    return cfg.layers * block_saved_elements(cfg, grid, attention, recompute)


def _probs_elements(cfg: ModelConfig, grid: GridShape) -> int:
    """Attention probabilities ``[m/s, heads/G_y, s, s]`` of one block."""
    return (local_tokens(cfg, grid) // cfg.seq) * (cfg.heads // grid.y) * cfg.seq * cfg.seq


def activation_elements(cfg: ModelConfig, grid: GridShape, recompute: str = "none",
                        attention: str = "unfused") -> int:
    """Saved activations, plus the step's input/target and the largest transient of a layer."""
    m, hx = local_tokens(cfg, grid), cfg.hidden // grid.x
    fy = cfg.ffn_hidden // grid.y * (2 if cfg.mlp == "swiglu" else 1)  # the FC1 output (SwiGLU: gate and up)
    unfused_gpt = cfg.kind == "gpt" and attention == "unfused"
    transient = max(_probs_elements(cfg, grid), m * fy) if unfused_gpt else m * fy
    return saved_activation_elements(cfg, grid, recompute, attention) + 2 * m * hx + transient


def comm_buffer_elements(cfg: ModelConfig, grid: GridShape, overlap: OverlapConfig,
                         dw_window: Optional[int] = None) -> int:
    """Elements of the communication buffers alive at one time (upper bound, see module docstring).

    ``dw_window``: with ORS, at most this many ``dW`` blocks (the largest) whose reduce-scatter is in
    flight at once (FSDP and ZeRO-3 bound their reduce buckets the same way); None: every layer's, as
    this suite's step keeps every handle until the optimizer. Known answer: ``w`` blocks of ``b``
    elements each in flight hold ``w (b + b/G_z)`` elements."""
    # every block repeats the same FC shapes: the l largest of the L-fold list, without building it
    one = sorted((block_elements(n, k, t, grid) for _, n, k, t in fc_weights(cfg, grid)), reverse=True)
    count = len(one) * cfg.layers

    def largest(k: int, f=lambda b: b) -> int:
        k = min(k, count)
        return sum(f(b) * min(cfg.layers, max(0, k - i * cfg.layers)) for i, b in enumerate(one))

    total = 0
    if grid.z > 1:
        if overlap.cache:
            total += largest(count)  # every gathered block kept from forward to backward
        else:
            live = min(count, overlap.prefetch_depth + 1) if overlap.oag else 1
            total += largest(live)
        # dW blocks (send) and their shards (receive) while their reduce-scatter is in flight
        in_flight = (count if dw_window is None else max(1, dw_window)) if overlap.ors else 1
        total += largest(in_flight, lambda b: b + b // grid.z)
    m = local_tokens(cfg, grid)
    widest = max(n // grid.y if not t else n // grid.x for _, n, _, t in fc_weights(cfg, grid))
    if grid.x > 1 or grid.y > 1:
        total += 2 * m * widest  # send and receive of the widest activation all-reduce
    return total


def default_precision(dtype: str) -> str:
    """``mixed`` for 16-bit dtypes (what GPU frameworks train with), ``pure`` otherwise (float32 and
    float64 training has no master copy)."""
    return "mixed" if dtype in _16BIT else "pure"


def state_bytes(params: int, grid: GridShape, dtype: str, optimizer: str, precision: Optional[str],
                shard_optimizer: str) -> Dict[str, int]:
    """Bytes per rank of the parameter state of ``params`` local parameter elements (the keys ``weights``,
    ``gradients``, ``master``, ``optimizer`` of :class:`MemoryEstimate`): weights and gradients in
    ``dtype``; ``mixed`` precision adds an fp32 master copy and keeps the Adam moments (2 states; SGD 0)
    in fp32; ``shard_optimizer="data"`` keeps master and moments of ``ceil(params / G_data)`` elements.
    ``precision`` None: :func:`default_precision` of ``dtype``. Shared by every algorithm's estimate."""
    precision = precision or default_precision(dtype)
    check_choice("precision", precision, PRECISIONS)
    check_choice("optimizer sharding", shard_optimizer, OPTIMIZER_SHARDING)
    e = dtype_bytes(dtype)
    opt_states = {"adam": 2, "sgd": 0}.get(optimizer)
    if opt_states is None:
        from fourd_mpi.errors import ConfigError

        raise ConfigError(f"unknown optimizer {optimizer!r}: choose adam or sgd")
    state_e = 4 if precision == "mixed" else e
    owned = -(-params // grid.data) if shard_optimizer == "data" else params  # shards this rank updates
    return {"weights": params * e, "gradients": params * e, "master": owned * 4 if precision == "mixed" else 0,
            "optimizer": opt_states * owned * state_e}


@lru_cache(maxsize=8192)
def estimate_memory(cfg: ModelConfig, grid: GridShape, dtype: str = "float32", optimizer: str = "adam",
                    cache_weights: bool = False, prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
                    overlap: Optional[OverlapConfig] = None, recompute: str = "none",
                    attention: str = "unfused", precision: Optional[str] = None,
                    shard_optimizer: str = "none", dw_window: Optional[int] = None) -> MemoryEstimate:
    """Bytes per rank of training ``cfg`` on ``grid`` (see the module docstring for what is counted).

    ``overlap``: the run's :class:`~fourd_mpi.step.overlap.OverlapConfig`; when None, a conservative
    default for planning: OAG on with ``prefetch_depth``, cache as ``cache_weights``, ORS off.
    ``recompute`` (:data:`RECOMPUTE`), ``attention`` (:data:`ATTENTION`), ``precision`` (:data:`PRECISIONS`; None:
    :func:`default_precision` of ``dtype``), ``shard_optimizer`` (:data:`OPTIMIZER_SHARDING`), ``dw_window``
    (:func:`comm_buffer_elements`). ``cfg`` must have its batch and fit the grid
    (:func:`fourd_mpi.step.presets.model_problems`). Memoized (every argument and the result are frozen): a search
    asks for the same stage and micro-batch many times.
    """
    if overlap is None:
        overlap = OverlapConfig(oag=True, cache=cache_weights, prefetch_depth=prefetch_depth)
    elif cache_weights and not overlap.cache:
        overlap = OverlapConfig(**{**asdict(overlap), "cache": True})
    state = state_bytes(parameter_elements(cfg, grid), grid, dtype, optimizer, precision, shard_optimizer)
    e = dtype_bytes(dtype)
    return MemoryEstimate(
        **state,
        activations=activation_elements(cfg, grid, recompute, attention) * e,
        comm_buffers=comm_buffer_elements(cfg, grid, overlap, dw_window) * e,
    )


def memory_reserve(profile: MachineProfile) -> int:
    """Bytes a rank holds beyond its arrays: the GPU runtime's reserve on a CuPy profile, else 0."""
    return GPU_RUNTIME_RESERVE_BYTES if profile.backend == "cupy" else 0


def admission_memory(options, attention: str = "unfused") -> Tuple[MemoryEstimate, int]:
    """The 4D family's admission hook (:attr:`fourd_mpi.algorithms.families.Family.admission`): the
    :func:`estimate_memory` of a run's resolved options (:class:`~fourd_mpi.algorithms.runoptions.RunOptions`) with
    the attention kernels that will run (``unfused`` keeps the score matrix, a fused mode only a row
    statistic), and the tokens per rank ``m = B*s/(G_data*G_z)`` (:func:`local_tokens`)."""
    cfg, grid = options.model, options.grid
    estimate = estimate_memory(cfg, grid, dtype=options.dtype, optimizer=options.optimizer,
                               overlap=options.overlap,
                               attention="unfused" if attention == "unfused" else "fused")
    return estimate, local_tokens(cfg, grid)
