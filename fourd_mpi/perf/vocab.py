"""The vocabulary layers of a GPT (token embedding and LM head) in the model: FLOPs, memory,
communication (pure).

Notation: ``V`` vocabulary, ``h`` hidden, ``s`` sequence, ``B`` global batch (sequences), ``l``
blocks, ``T = G_x G_y`` the tensor-parallel ranks that share the vocabulary (Megatron-LM's
vocab-parallel embedding and cross entropy split ``V`` over its tensor-parallel group; on a 4D grid
the head's input ``[m, h/G_x]`` is all-gathered over X first and the vocabulary split over X and Y),
``m`` local tokens of a rank for one micro-batch (``B s/(G_data G_z m)``), ``e`` bytes per element.

- **FLOPs** (whole model, per step): the LM head GEMM ``logits = x E^T`` is ``2 B s h V`` forward and
  twice that backward: ``6 B s h V``. This is exactly Megatron's vocabulary term:
  ``96 B s l h^2 * V/(16 l h) = 6 B s h V`` (the head is not recomputed, so the term is the same in
  the 72 convention: ``72 B s l h^2 * V/(12 l h) = 6 B s h V``). The embedding lookup is a gather,
  no FLOPs. Per rank: ``6 m h V / T``.
- **Memory**: the (tied) embedding ``E [V, h]`` is stored as ``V h / T`` elements per rank on the
  first stage and again on the last (one copy with one stage), with its gradient and optimizer state
  like any parameter; the last stage keeps the logits of the micro-batch ``[m, V/T]`` in the run dtype
  plus their fp32 copy for the cross entropy (``m V/T (e + 4)`` bytes), freed after its backward.
- **Communication** per micro-batch: the embedding's output all-reduce over Y ``m h/G_x e``
  (forward); the head's input all-gather over X of ``m h e`` (forward) and its gradient's
  reduce-scatter over X (backward) when ``G_x > 1``; the head's backward dX all-reduce over Y
  ``m h/G_x e``; the cross entropy's three all-reduces of ``m`` floats over the tensor group
  (max, sum of exponentials, target logit). Per step: the embedding gradient's all-reduce over
  data (and Z) of ``V h/T e``, and with ``p > 1`` one more between the first and last stage (tied
  weights), both blocking in Megatron-LM (2021).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

#: the GPT-2 BPE vocabulary padded to a multiple of 1,024 (Megatron-LM and AxoNN's scripts: 51,200)
DEFAULT_VOCAB = 51200
FLOPS_FORMULA = "LM head FLOPs = 6 B s h V (forward 2 B s h V, backward 4 B s h V; not recomputed)"


def head_flops(batch: int, seq: int, hidden: int, vocab: int) -> float:
    """``6 B s h V``: the LM head's FLOPs per step, whole model (module docstring)."""
    return 6.0 * batch * seq * hidden * vocab


def head_flops_per_rank(tokens: int, hidden: int, vocab: int, tp: int) -> float:
    """``6 m h V / T`` for ``m = tokens`` local tokens and ``T = tp`` ranks sharing the vocabulary."""
    return 6.0 * tokens * hidden * vocab / tp


def embedding_elements(hidden: int, vocab: int, tp: int) -> int:
    """Elements of the embedding (= tied head) shard of one rank: ``V h / T``."""
    return vocab * hidden // tp


def logits_bytes(tokens: int, vocab: int, tp: int, e: int) -> int:
    """Bytes of the last stage's logits for ``tokens`` local tokens: ``m V/T (e + 4)``."""
    return tokens * (vocab // tp) * (e + 4)


def microbatch_collectives(tokens: int, hidden: int, gx: int, gy: int, e: int) -> List[Tuple[str, str, int, int]]:
    """``(axis, op, group size, message bytes)`` of one micro-batch's vocabulary collectives on the
    first and last stage together (module docstring; sizes-1 groups left out)."""
    out = []
    if gy > 1:
        out.append(("y", "allreduce", gy, tokens * hidden // gx * e))          # embedding output
        out.append(("y", "allreduce", gy, tokens * hidden // gx * e))          # head backward dX
    if gx > 1:
        out.append(("x", "allgather", gx, tokens * hidden * e))                # head input
        out.append(("x", "reduce_scatter", gx, tokens * hidden * e))           # its gradient
    if gx * gy > 1:
        for _ in range(3):                                                     # cross-entropy statistics
            out.append(("y" if gy > 1 else "x", "allreduce", gx * gy, tokens * 4))
    return out


def volumes(tokens: int, hidden: int, vocab: int, gx: int, gy: int, e: int) -> Dict[str, int]:
    """Wire bytes one rank sends per micro-batch by axis (ring factors: ``(p-1)/p`` for all-gather and
    reduce-scatter, ``2(p-1)/p`` for all-reduce). Known answer: ``G_y = 8``, ``G_x = 1``, ``m = 2048``,
    ``h = 4096``, fp16: two all-reduces of 16 MiB = ``2 * 2 * 7/8 * 16 MiB`` plus 3 x ``2 * 7/8 * 8 KiB``."""
    out: Dict[str, int] = {}
    for axis, op, p, nbytes in microbatch_collectives(tokens, hidden, gx, gy, e):
        k = 2 if op == "allreduce" else 1
        out[axis] = out.get(axis, 0) + int(k * (p - 1) / p * nbytes)
    return out
