"""Pipeline schedules as formulas: bubble, activations in flight, point-to-point messages (pure).

Notation: ``p`` pipeline stages, ``m`` micro-batches per step (per data-parallel replica), ``v``
model chunks per stage (virtual stages; ``v = 1`` without interleaving), ``L`` blocks, ``L/p``
blocks per stage, ``L/(p v)`` blocks per chunk.

Schedules (Narayanan et al., SC'21, arXiv 2104.04473, section 2.2):

- ``1f1b``: PipeDream-Flush's one-forward-one-backward; bubble fraction (:func:`bubble_fraction`, of the ideal time;
  :func:`idle_share`: of the step)
  ``(p - 1)/m``, i.e. the step is ``(m + p - 1) t`` for a slot ``t`` (one micro-batch's forward and
  backward through one stage); stage ``s`` holds at most ``min(p - s, m)`` micro-batches' inputs.
- ``interleaved``: each stage holds ``v`` chunks; the bubble shrinks ``v``-fold,
  ``(p - 1)/(v m)`` of the ideal time (step ``(m + (p - 1)/v) t``), at ``v`` times the
  point-to-point messages. Megatron-LM's warm-up on stage ``s`` runs ``(p - s - 1) 2 + (v - 1) p``
  chunk forwards before its first backward (``megatron/schedules.py``,
  ``forward_backward_pipelining_with_interleaving``), so stage 0 holds the inputs of at most
  ``min(m v, 2 (p - 1) + (v - 1) p + 1)`` chunk passes of ``L/(p v)`` blocks each.
- ``axonn``: AxoNN's message-driven schedule; stage 0 admits ``min(p, m)`` micro-batches; the
  same ``(p - 1)/m`` bubble with equal stage times (:mod:`fourd_mpi.perf.pipeline`).
"""

from __future__ import annotations

from typing import Optional, Tuple

from fourd_mpi.errors import ConfigError

SCHEDULES = ("1f1b", "interleaved", "axonn")
BUBBLE_FORMULA = {"1f1b": "bubble = (p - 1)/m of the ideal time (1F1B)",
                  "interleaved": "bubble = (p - 1)/(v m) of the ideal time (interleaved 1F1B, v chunks per stage)",
                  "axonn": "bubble = (p - 1)/m of the ideal time (AxoNN message-driven, equal stages)"}
#: at most this many micro-batches per step in the searches over pipelines (``tune --algorithm pipeline``,
#: ``tune --search``): the bound of "every micro-batch size that divides the per-replica batch"
MAX_MICROBATCHES = 1024


def check_schedule(schedule: str, stages: int, chunks: int, layers: int, microbatches: int,
                   stage_layers: Optional[Tuple[int, ...]] = None) -> None:
    """Refuse a schedule that cannot run: an unknown name, ``v > 1`` without ``interleaved``, blocks
    that do not split into ``p v`` equal chunks, or (interleaved, as Megatron-LM requires) ``m`` not a
    multiple of ``p``.

    ``stage_layers``: blocks per stage, first to last, when they differ (:func:`fourd_mpi.perf.terms.stage_layers`).
    Interleaved on uneven stages is Llama 3's layout (arXiv 2407.21783, section 3.3.2: one block fewer on the
    first and the last stage, whose first and last chunk then hold only the embedding and only the output
    projection and loss): the fullest stages split into ``v`` equal chunks and every other stage lacks at most
    one chunk's blocks."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}: choose {', '.join(SCHEDULES)}")
    if chunks < 1:
        raise ConfigError(f"--chunks-per-stage must be at least 1, got {chunks}")
    if chunks > 1 and schedule != "interleaved":
        raise ConfigError(f"--chunks-per-stage {chunks} needs --pipeline-schedule interleaved (got {schedule})")
    if schedule == "interleaved":
        if stages < 2:
            raise ConfigError("--pipeline-schedule interleaved needs --ginter 2 or more (pipeline stages)")
        if stage_layers is not None and len(set(stage_layers)) > 1:
            _check_uneven_chunks(stage_layers, chunks)
        elif layers % (stages * chunks):
            raise ConfigError(f"interleaved: {layers} layers do not split into {stages} stages x {chunks} chunks "
                              f"of equal size (layers must be a multiple of {stages * chunks})")
        if microbatches % stages:
            raise ConfigError(f"interleaved: {microbatches} micro-batches is not a multiple of {stages} stages "
                              f"(Megatron-LM's interleaved schedule needs it)")


def _check_uneven_chunks(stage_layers: Tuple[int, ...], chunks: int) -> None:
    """Interleaved on uneven stages (:func:`check_schedule`): ``max(L_s)`` a multiple of ``v``, and every stage
    at least ``max(L_s) - max(L_s)/v`` blocks. Known answers: 7, 14 x 8, 7 with ``v = 8`` (Llama 3 405B) runs;
    ``v = 4`` runs (chunks of 2, the end stages' first/last chunk 1); 6, 8, 8, 6 with ``v = 4`` is refused."""
    fullest = max(stage_layers)
    shortest = min(stage_layers)
    where = f"interleaved on uneven stages ({', '.join(map(str, stage_layers))} blocks, Llama 3's layout)"
    if fullest % chunks:
        raise ConfigError(f"{where}: the fullest stages' {fullest} blocks must split into {chunks} equal chunks")
    if fullest - shortest > fullest // chunks:
        raise ConfigError(f"{where}: a stage may lack at most one chunk ({fullest // chunks} blocks) of the "
                          f"fullest's {fullest}, but one has {shortest}")


def bubble_fraction(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Bubble as a fraction of the ideal (bubble-free) time ``m t``: ``(p - 1)/(v m)`` (``v = 1`` for
    ``1f1b`` and ``axonn``). Known answers: p = 8, m = 32: 7/32; interleaved v = 4: 7/128."""
    v = chunks if schedule == "interleaved" else 1
    return (stages - 1) / (v * microbatches)


def idle_share(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Share of a stage's step spent idle (not of the ideal time, as :func:`bubble_fraction`): the bubble's
    ``(p - 1)/v`` slots of the step's ``m + (p - 1)/v``, i.e. ``(p - 1)/(v m + p - 1)``. Known answers: p = 4,
    m = 4: 3/7; interleaved v = 2: 3/11; p = 1: 0."""
    slots = bubble_slots(schedule, stages, chunks)
    return slots / (microbatches + slots)


def bubble_slots(schedule: str, stages: int, chunks: int = 1) -> float:
    """Bubble in slots of one micro-batch through one stage: ``(p - 1)/v``."""
    v = chunks if schedule == "interleaved" else 1
    return (stages - 1) / v


def inflight_block_passes(schedule: str, stages: int, microbatches: int, layers: int, chunks: int = 1,
                          stage: int = 0) -> float:
    """Block-micro-batch pairs whose stored input ``stage`` holds at its peak (module docstring):
    ``1f1b`` ``min(p - s, m) L/p``; ``axonn`` ``min(p, m) L/p``; ``interleaved``
    ``min(m v, 2 (p - s - 1) + (v - 1) p + 1) L/(p v)``."""
    per_stage = layers / stages
    if schedule == "interleaved":
        passes = min(microbatches * chunks, 2 * (stages - stage - 1) + (chunks - 1) * stages + 1)
        return passes * per_stage / chunks
    if schedule == "axonn":
        return min(stages, microbatches) * per_stage
    return min(stages - stage, microbatches) * per_stage


def p2p_messages_per_microbatch(schedule: str, stages: int, chunks: int = 1) -> int:
    """Messages a middle stage sends per micro-batch: one activation forward and one gradient backward
    per chunk, ``2 v`` (``0`` with one stage)."""
    if stages == 1:
        return 0
    return 2 * (chunks if schedule == "interleaved" else 1)


def link_bound_slot(slot: float, t_msg: float, efficiency: float) -> float:
    """One steady-state slot when each micro-batch's message must also cross the stage boundary:
    ``max(W, t) + (1 - e) min(W, t)`` = ``W + t - e min(W, t)`` for compute ``W``, message ``t`` and
    overlap efficiency ``e`` (the share of the shorter one hidden behind the longer, as the 4D model
    hides collectives: :attr:`~fourd_mpi.perf.machine.MachineProfile.overlap_efficiency`, 0 without
    progress). ``e = 1``: ``max(W, t)`` (a message per slot each way, the link full duplex); a slot
    never runs faster than its link."""
    return max(slot, t_msg) + (1.0 - efficiency) * min(slot, t_msg)
