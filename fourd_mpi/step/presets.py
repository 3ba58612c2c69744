"""Model presets and the validation of a (model, grid) pair.

Validation is pure: every rank runs it on the same inputs before any collective,
so a bad input fails identically everywhere (see :mod:`fourd_mpi.errors`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional

from fourd_mpi.core.grid import GridShape
from fourd_mpi.errors import ConfigError

MODEL_KINDS = ("gpt", "mlp")
#: a GPT block's MLP: ``gelu`` (two GEMMs, ``h -> f -> h``: GPT-2/3, Megatron-LM's default) or ``swiglu``
#: (Shazeer 2020, "GLU Variants Improve Transformer", arXiv 2002.05202, eq. 6: ``(Swish(x W) * x V) W2``, three
#: ``h x f`` matrices; Llama 2, Touvron et al. 2023, section 2.2). The model's only: this suite's step is GeLU.
MLP_KINDS = ("gelu", "swiglu")
#: ``--recompute``: what a block drops after its forward and recomputes in backward
#: (``step/model.py``): nothing; the attention core (scores, probabilities, context); everything but the
#: block input
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a model and its global batch.

    kind: ``gpt`` (LayerNorm, attention, MLP, residuals) or ``mlp`` (pairs of
    normal h->ffn and transposed ffn->h layers with GeLU between).
    layers: number of blocks; hidden: model width h; heads: attention heads;
    ffn_hidden: MLP width (4h in GPT); seq: sequence length; batch: global batch in sequences.
    kv_heads: key/value heads of grouped-query attention (Ainslie et al. 2023, "GQA", arXiv 2305.13245,
    section 2; Llama 2 70B: 8 for 64 query heads): the QKV weight is ``[h + 2 h kv/heads, h]``; None: as many
    as ``heads`` (multi-head attention). mlp: :data:`MLP_KINDS`. Both are the model's only (this suite's step
    runs multi-head attention and a GeLU MLP: :func:`validate_model` refuses others).
    """

    name: str
    kind: str
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    seq: int
    batch: Optional[int]
    kv_heads: Optional[int] = None
    mlp: str = "gelu"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_head_count(self) -> int:
        """Key/value heads: ``kv_heads``, or ``heads`` (multi-head attention)."""
        return self.kv_heads or self.heads

    def weight_shapes(self):
        """The GEMM weights of one block, in forward order: ``(name, n_out, k_in, transposed)``. GPT: QKV
        ``[h + 2 h kv/heads, h]`` (``3h`` with multi-head attention), projection ``[h, h]`` (transposed), FC1
        ``[f, h]`` (SwiGLU: ``[2f, h]``, the gate and up matrices side by side, as Megatron-LM's ``--swiglu``
        fuses them) and FC2 ``[h, f]`` (transposed); ``mlp`` kind: FC1 and FC2 alone."""
        h, f = self.hidden, self.ffn_hidden
        fc1 = 2 * f if self.mlp == "swiglu" else f
        mlp = [("fc1", fc1, h, False), ("fc2", h, f, True)]
        if self.kind != "gpt":
            return mlp
        qkv = h + 2 * self.kv_head_count * (h // self.heads)
        return [("qkv", qkv, h, False), ("proj", h, h, True)] + mlp

    def gemm_weight_count(self) -> int:
        """Elements of one block's GEMM weights: ``sum n k`` of :meth:`weight_shapes`."""
        return sum(n * k for _, n, k, _ in self.weight_shapes())

    @property
    def tokens(self) -> int:
        return (self.batch or 0) * self.seq

    def parameter_count(self) -> int:
        """Parameters of the blocks (no embedding): GEMM weights plus, in a GPT, two LayerNorms' ``gamma, beta``
        (``4h``). Known answer (Llama 2 70B, :mod:`tests.perf.test_gqa_swiglu`): 80 blocks of ``h (h + 2 h kv/a) +
        h^2 + 3 h f`` plus ``2 V h`` untied embeddings = 68.98e9 with RMSNorm's ``2h``."""
        per_block = self.gemm_weight_count() + (4 * self.hidden if self.kind == "gpt" else 0)
        return self.layers * per_block

    def flops_per_step(self) -> float:
        """Model FLOPs of one training step (forward + backward, no recompute), whole model.

        GEMMs ``6 * tokens * weights`` (:meth:`gemm_weight_count`) plus causal-attention score and context
        products ``12 * B * s^2 * h`` per GPT layer (grouped-query attention shares K and V, not the products):
        Narayanan et al. (SC'21) ``72 B s l h^2 (1 + s/(6h))`` when ffn = 4h (no LM head here, so V = 0).
        """
        gemm = 6 * self.tokens * self.gemm_weight_count()
        if self.kind == "gpt":
            return float(self.layers * (gemm + 12 * (self.batch or 0) * self.seq ** 2 * self.hidden))
        return float(self.layers * gemm)

    def hardware_flops_per_step(self, recompute: str = "none") -> float:
        """FLOPs one training step executes, counting activation recompute (whole model).

        ``recompute``:
        - ``"none"``: equal to :meth:`flops_per_step` (the ``72 B s l h^2 (1 + s/(6h))`` convention);
        - ``"full"``: every block's forward runs twice (once more in backward), i.e. a step is 4
          forward passes instead of 3: ``96 B s l h^2 (1 + s/(6h))``, the hardware-FLOPs convention
          AxoNN and Megatron-LM use for "% of peak";
        - ``"selective"``: only the attention core (scores ``Q K^T`` and context ``P V``,
          ``4 B s^2 h`` per GPT layer) is recomputed.
        """
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be none, full or selective, not {recompute!r}")
        model = self.flops_per_step()
        if recompute == "none":
            return model
        if recompute == "full":
            return model * 4.0 / 3.0
        if recompute == "selective":
            if self.kind != "gpt":
                return model
            return model + float(self.layers * 4 * (self.batch or 0) * self.seq ** 2 * self.hidden)
        raise ValueError(f"recompute must be none, full or selective, not {recompute!r}")

    def flops_formula(self) -> str:
        """The formula of :meth:`flops_per_step`, in words (printed next to every model FLOP/s)."""
        if self.kind == "gpt":
            return ("model FLOPs per step = 72 B s l h^2 (1 + s/6h) convention: 6 x tokens x weights "
                    "+ 12 B s^2 h per block (no recompute, no LM head)")
        return "model FLOPs per step = 6 x tokens x weights (no recompute)"

    def hardware_flops_formula(self, recompute: str = "none") -> str:
        """The formula of :meth:`hardware_flops_per_step` for ``recompute``, in words."""
        if recompute == "full":
            extra = ("96 B s l h^2 (1 + s/6h) convention: model FLOPs x 4/3 (every block's forward "
                     "run again in backward)") if self.kind == "gpt" else "model FLOPs x 4/3 (forward run again)"
            return "hardware FLOPs per step = " + extra
        if recompute == "selective" and self.kind == "gpt":
            return ("hardware FLOPs per step = model FLOPs + 4 B s^2 h per block (attention scores and "
                    "context recomputed)")
        return "hardware FLOPs per step = model FLOPs (nothing recomputed)"

    def as_dict(self) -> Dict:
        """The fields; ``kv_heads`` and ``mlp`` only when not the default (traces and outputs of multi-head GeLU
        models keep their keys)."""
        d = asdict(self)
        if d["kv_heads"] is None:
            del d["kv_heads"]
        if d["mlp"] == "gelu":
            del d["mlp"]
        return d


def _gpt(name, layers, hidden, heads, seq=2048, batch=None, ffn=None):
    return ModelConfig(name, "gpt", layers, hidden, heads, ffn or 4 * hidden, seq, batch)


#: Built-in presets. The paper's GPT shapes (AxoNN SC'24, Table 2) use sequence
#: length 2048 and need the global batch from the user.
PRESETS: Dict[str, ModelConfig] = {
    "gpt-tiny": _gpt("gpt-tiny", layers=2, hidden=64, heads=8, seq=16, batch=8),
    "gpt-small": _gpt("gpt-small", layers=4, hidden=512, heads=8, seq=256, batch=8),
    "mlp-tiny": ModelConfig("mlp-tiny", "mlp", 2, 64, 1, 128, 16, 8),
    "mlp": ModelConfig("mlp", "mlp", 4, 1024, 1, 4096, 256, 8),
    "gpt-5b": _gpt("gpt-5b", 24, 4096, 32),
    "gpt-10b": _gpt("gpt-10b", 32, 5120, 40),
    "gpt-20b": _gpt("gpt-20b", 32, 7168, 56),
    "gpt-40b": _gpt("gpt-40b", 38, 9216, 72),
    "gpt-60b": _gpt("gpt-60b", 56, 9216, 72),
    "gpt-80b": _gpt("gpt-80b", 42, 12288, 96),
}


def resolve_model(preset: str, **overrides) -> ModelConfig:
    """The preset with the given fields replaced (``None`` values are ignored).

    ``hidden`` given without ``ffn_hidden`` rescales a GPT's MLP to 4 x hidden.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}: choose one of {', '.join(PRESETS)}")
    base = PRESETS[preset]
    changes = {k: v for k, v in overrides.items() if v is not None}
    if base.kind == "gpt" and "hidden" in changes and "ffn_hidden" not in changes:
        changes["ffn_hidden"] = 4 * changes["hidden"]
    unknown = set(changes) - set(ModelConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown model field(s) {', '.join(sorted(unknown))}")
    return replace(base, **changes)


#: what joins a preset's name and its overridden sizes in a label (``gpt-tiny with --hidden 512``)
OVERRIDDEN = " with "


def resolve_labelled(preset: str, **overrides) -> ModelConfig:
    """:func:`resolve_model`, named for what it is: ``"gpt-tiny with --hidden 512"`` when a size other than the
    batch differs from the preset's (a header must not call a 96-layer model by a 42-layer preset's name alone);
    the preset's own name otherwise. :func:`preset_of` gives the preset back."""
    cfg = resolve_model(preset, **overrides)
    base = PRESETS[preset]
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in overrides.items()
               if k != "batch" and v is not None and v != getattr(base, k)]
    return replace(cfg, name=f"{preset}{OVERRIDDEN}{' '.join(changed)}") if changed else cfg


def preset_of(cfg: ModelConfig) -> str:
    """The preset a (possibly :func:`resolve_labelled`) model was made from: ``gpt-tiny``."""
    return cfg.name.split(OVERRIDDEN, 1)[0]


def size_problems(cfg: ModelConfig) -> List[str]:
    """A sentence for each size of ``cfg`` (layers, hidden, heads, ffn_hidden, seq, batch) that is given
    and not positive (every algorithm's model check starts with these)."""
    problems = []
    for field_name in ("layers", "hidden", "heads", "ffn_hidden", "seq", "batch"):
        value = getattr(cfg, field_name)
        if value is not None and value < 1:
            problems.append(f"--{field_name.replace('_', '-')} must be positive, got {value}")
    return problems


def model_problems(cfg: ModelConfig, grid: GridShape, pad_z: bool = False) -> List[str]:
    """Everything wrong with running ``cfg`` on ``grid``, as actionable sentences (empty when fine).

    ``pad_z``: weight blocks need not divide by ``G_z`` (an implementation that pads each shard to
    ``ceil(block / G_z)``, as DeepSpeed's ZeRO-3 does; the model only: this suite's step needs it exact)."""
    problems: List[str] = []
    if cfg.kind not in MODEL_KINDS:
        problems.append(f"model kind {cfg.kind!r} is not one of {', '.join(MODEL_KINDS)}")
    if cfg.batch is None:
        problems.append(f"preset {cfg.name} needs the global batch: give --batch SEQUENCES")
    problems += size_problems(cfg)
    if problems:
        return problems

    def need(value, divisor, what, fix):
        if value % divisor:
            problems.append(f"{what} {value} is not divisible by {divisor}: {fix}")

    h, f = cfg.hidden, cfg.ffn_hidden
    if cfg.mlp not in MLP_KINDS:
        problems.append(f"MLP kind {cfg.mlp!r} is not one of {', '.join(MLP_KINDS)}")
    if cfg.kv_heads is not None and (cfg.kv_heads < 1 or cfg.heads % cfg.kv_heads):
        problems.append(f"--kv-heads {cfg.kv_heads} must divide --heads {cfg.heads} (query heads share K and V in "
                        f"equal groups)")
    if problems:
        return problems
    need(cfg.batch, grid.data * grid.z, "global batch",
         f"give --batch a multiple of G_data*G_z = {grid.data}*{grid.z}")
    need(h, grid.x, "hidden size", f"give --hidden a multiple of G_x = {grid.x}")
    need(f, grid.y, "MLP hidden size", f"give --ffn-hidden a multiple of G_y = {grid.y}")
    if cfg.kind == "gpt":
        need(h, grid.y, "hidden size", f"give --hidden a multiple of G_y = {grid.y}")
        need(h, cfg.heads, "hidden size", f"give --hidden a multiple of --heads = {cfg.heads}")
        need(cfg.heads, grid.y, "head count",
             f"attention splits whole heads over Y: give --heads a multiple of G_y = {grid.y}")
        if cfg.kv_heads is not None:
            need(cfg.kv_heads, grid.y, "key/value head count",
                 f"each rank of Y holds whole K/V groups (Megatron-LM requires it): give --kv-heads a multiple of "
                 f"G_y = {grid.y}")
    if problems:
        return problems
    # normal layers put their output on Y and input on X, transposed ones the other way round; MLP first
    for name, n_out, k_in, transposed in sorted(cfg.weight_shapes(), key=lambda w: w[0] in ("qkv", "proj")):
        out_axis, in_axis = ("x", "y") if transposed else ("y", "x")
        block = (n_out // grid[out_axis]) * (k_in // grid[in_axis])
        if block % grid.z and not pad_z:
            problems.append(
                f"the {name} weight block has {block} elements, not divisible by G_z = {grid.z}: "
                f"choose sizes so that (out/G_{out_axis})*(in/G_{in_axis}) is a multiple of G_z"
            )
    return problems


def validate_model(cfg: ModelConfig, grid: GridShape) -> None:
    """Raise :class:`ConfigError` naming every problem of ``cfg`` on ``grid``."""
    problems = model_problems(cfg, grid)
    if cfg.kv_heads not in (None, cfg.heads) or cfg.mlp != "gelu":
        problems.append("grouped-query attention (kv_heads) and the SwiGLU MLP are for the model only (fourd-mpi "
                        "model predict --kv-heads, --mlp): this suite's step runs multi-head attention and a GeLU MLP")
    if problems:
        raise ConfigError(f"model {cfg.name} on grid {grid} (G_data x G_z x G_y x G_x): " + "; ".join(problems))
