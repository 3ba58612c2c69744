"""Memory per rank of a training step: what :mod:`fourd_mpi.step.layers`, :mod:`fourd_mpi.step.model`
and :mod:`fourd_mpi.step.optim` actually keep, counted from the shapes (pure, no MPI).

Notation (docs/design.md section 2): ``m = B*s/(G_data*G_z)`` local tokens, ``h`` hidden,
``f`` MLP hidden, ``e`` the dtype's item size in bytes. A weight ``W[n, k]`` of a normal
layer has blocks ``[n/G_y, k/G_x]`` (transposed: ``[n/G_x, k/G_y]``); a rank stores
``n*k/(G_x*G_y*G_z)`` elements of it.

Categories (bytes, per rank, at the step's peak: the end of the forward pass):

``weights``      FC weight shards ``n*k/(G_x*G_y*G_z)`` and LayerNorm ``gamma, beta`` ``[h/G_x]``.
``gradients``    one gradient per parameter, the size of its shard (``param.grad`` persists).
``optimizer``    Adam: ``m`` and ``v`` per parameter (2x weights); SGD (momentum 0): nothing.
``activations``  what the forward saves for backward, per block:
                 GPT: ``xhat, a, xhat2, b`` ``[m, h/G_x]`` each, ``rstd`` x2 ``[m, 1]``, the QKV
                 output ``[m, 3h/G_y]`` (q, k, v are views of it), the attention probabilities
                 ``[m/s, heads/G_y, s, s]``, the context ``[m, h/G_y]``, ``u`` and ``gelu(u)``
                 ``[m, f/G_y]``; MLP: ``x [m, h/G_x]``, ``u, g [m, f/G_y]``;
                 plus the step's input and target ``[m, h/G_x]`` and the largest transient of a
                 layer (the attention scores ``[m/s, heads/G_y, s, s]`` in GPT, else one
                 ``[m, f/G_y]`` output).
``comm_buffers`` all-gathered weight blocks alive at once (1, or ``prefetch_depth + 1`` with
                 OAG; every layer's block with ``cache``), the all-reduce send/receive pair
                 of the largest activation ``[m, max(3h, f)/G_y]``, and the ``dW`` blocks whose
                 reduce-scatter is in flight (1, or every layer's with ORS).

Exactness: weights, gradients and optimizer state are exact (tested against the arrays of a
built run); activations are exact for the saved tensors and approximate for transients
(NumPy temporaries are not counted); communication buffers are an upper bound of the
buffers alive at one time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from fourd_mpi.core.backend import dtype_bytes
from fourd_mpi.step.presets import ModelConfig
from fourd_mpi.core.grid import GridShape
from fourd_mpi.step.overlap import OverlapConfig


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by category; ``total`` is their sum."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    comm_buffers: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.comm_buffers

    def as_dict(self) -> Dict[str, int]:
        d = asdict(self)
        d["total"] = self.total
        return d

    def describe(self) -> str:
        """``1.23 GiB (weights 0.1, grads 0.1, optimizer 0.2, activations 0.8, comm 0.03 GiB)``."""
        g = 2.0 ** 30
        return (f"{self.total / g:.3g} GiB (weights {self.weights / g:.3g}, grads {self.gradients / g:.3g}, "
                f"optimizer {self.optimizer / g:.3g}, activations {self.activations / g:.3g}, "
                f"comm {self.comm_buffers / g:.3g})")


def fc_weights(cfg: ModelConfig, grid: GridShape) -> List[Tuple[str, int, int, bool]]:
    """The 4D layers of one block, in forward order: ``(name, n_out, k_in, transposed)``."""
    h, f = cfg.hidden, cfg.ffn_hidden
    if cfg.kind == "gpt":
        return [("qkv", 3 * h, h, False), ("proj", h, h, True), ("fc1", f, h, False), ("fc2", h, f, True)]
    return [("fc1", f, h, False), ("fc2", h, f, True)]


def block_elements(n_out: int, k_in: int, transposed: bool, grid: GridShape) -> int:
    """Elements of the (all-gathered) weight block ``[n/out_axis, k/in_axis]``."""
    out_axis, in_axis = ("x", "y") if transposed else ("y", "x")
    return (n_out // grid[out_axis]) * (k_in // grid[in_axis])


def local_tokens(cfg: ModelConfig, grid: GridShape) -> int:
    """``m = B*s/(G_data*G_z)`` (whole sequences per rank)."""
    return (cfg.batch // (grid.data * grid.z)) * cfg.seq


def parameter_elements(cfg: ModelConfig, grid: GridShape) -> int:
    """Elements of every parameter shard this rank stores."""
    per_block = sum(block_elements(n, k, t, grid) // grid.z for _, n, k, t in fc_weights(cfg, grid))
    if cfg.kind == "gpt":
        per_block += 4 * (cfg.hidden // grid.x)  # two LayerNorms, gamma and beta [h/x]
    return cfg.layers * per_block


def saved_activation_elements(cfg: ModelConfig, grid: GridShape) -> int:
    """Elements the forward pass saves for backward, whole stack (module docstring lists them)."""
    m, h, f = local_tokens(cfg, grid), cfg.hidden, cfg.ffn_hidden
    hx, hy, fy = h // grid.x, h // grid.y, f // grid.y
    if cfg.kind == "gpt":
        per_block = m * (4 * hx + 2 + 3 * hy + hy + 2 * fy) + _probs_elements(cfg, grid)
    else:
        per_block = m * (hx + 2 * fy)
    return cfg.layers * per_block


def _probs_elements(cfg: ModelConfig, grid: GridShape) -> int:
    """Attention probabilities ``[m/s, heads/G_y, s, s]`` of one block."""
    return (local_tokens(cfg, grid) // cfg.seq) * (cfg.heads // grid.y) * cfg.seq * cfg.seq


def activation_elements(cfg: ModelConfig, grid: GridShape) -> int:
    """Saved activations, plus the step's input/target and the largest transient of a layer."""
    m, hx, fy = local_tokens(cfg, grid), cfg.hidden // grid.x, cfg.ffn_hidden // grid.y
    transient = max(_probs_elements(cfg, grid), m * fy) if cfg.kind == "gpt" else m * fy
    return saved_activation_elements(cfg, grid) + 2 * m * hx + transient


def comm_buffer_elements(cfg: ModelConfig, grid: GridShape, overlap: OverlapConfig) -> int:
    """Elements of the communication buffers alive at one time (upper bound, see module docstring)."""
    layers = fc_weights(cfg, grid) * cfg.layers
    blocks = sorted((block_elements(n, k, t, grid) for _, n, k, t in layers), reverse=True)
    total = 0
    if grid.z > 1:
        if overlap.cache:
            total += sum(blocks)  # every gathered block kept from forward to backward
        else:
            live = min(len(blocks), overlap.prefetch_depth + 1) if overlap.oag else 1
            total += sum(blocks[:live])
        # dW blocks (send) and their shards (receive) while their reduce-scatter is in flight
        in_flight = blocks if overlap.ors else blocks[:1]
        total += sum(b + b // grid.z for b in in_flight)
    m = local_tokens(cfg, grid)
    widest = max(n // grid.y if not t else n // grid.x for _, n, _, t in fc_weights(cfg, grid))
    if grid.x > 1 or grid.y > 1:
        total += 2 * m * widest  # send and receive of the widest activation all-reduce
    return total


def estimate_memory(cfg: ModelConfig, grid: GridShape, dtype: str = "float32", optimizer: str = "adam",
                    cache_weights: bool = False, prefetch_depth: int = 1,
                    overlap: Optional[OverlapConfig] = None) -> MemoryEstimate:
    """Bytes per rank of training ``cfg`` on ``grid`` (see the module docstring for what is counted).

    ``overlap``: the run's :class:`~fourd_mpi.step.overlap.OverlapConfig`; when None, a conservative
    default for planning: OAG on with ``prefetch_depth``, cache as ``cache_weights``, ORS off.
    ``cfg`` must have its batch and fit the grid (:func:`fourd_mpi.step.presets.model_problems`).
    """
    if overlap is None:
        overlap = OverlapConfig(oag=True, cache=cache_weights, prefetch_depth=prefetch_depth)
    elif cache_weights and not overlap.cache:
        overlap = OverlapConfig(**{**asdict(overlap), "cache": True})
    e = dtype_bytes(dtype)
    params = parameter_elements(cfg, grid)
    opt_states = {"adam": 2, "sgd": 0}.get(optimizer)
    if opt_states is None:
        from fourd_mpi.errors import ConfigError

        raise ConfigError(f"unknown optimizer {optimizer!r}: choose adam or sgd")
    return MemoryEstimate(
        weights=params * e,
        gradients=params * e,
        optimizer=opt_states * params * e,
        activations=activation_elements(cfg, grid) * e,
        comm_buffers=comm_buffer_elements(cfg, grid, overlap) * e,
    )
