"""Model terms of the systems the suite's predictions are compared against, one function per term (pure).

Each term has its source and a known-answer test (``tests/perf/test_<term>.py``); :mod:`fourd_mpi.perf.scenario`
calls them at small call sites.

**Uneven pipeline stages.** ``L`` blocks on ``p`` stages where ``p`` does not divide ``L`` (Llama 3 405B's 126
layers on 16 stages). Two distributions:

- the default: contiguous and balanced to one block, the first ``L mod p`` stages hold ``ceil(L/p)``, the
  others ``floor(L/p)`` (this suite's own pipeline, :func:`~fourd_mpi.algorithms.pipeline_plan.stage_blocks`;
  DeepSpeed's ``PipelineModule(partition_method="uniform")``, ``deepspeed/runtime/utils.py``
  ``partition_uniform``, gives the first ``L mod p`` parts one more item the same way);
- Megatron-LM's ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
  (``megatron/core/transformer/transformer_block.py``, ``get_num_layers_to_build``): the first and/or the last
  stage hold the given counts and the remaining stages split the rest evenly (Megatron-LM refuses a rest that
  does not divide, and uneven stages with the interleaved schedule). Without these flags Megatron-LM requires
  ``p | L``; Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2) takes one layer from
  each of the first and the last stage: 126 on 16 = 7, 14 x 8, 7.

The step's time is set by the fullest stage (every slot of the schedule waits for it); memory is counted for the
first and the last stage with their own block counts.
"""

from __future__ import annotations

from typing import Optional, Tuple

from fourd_mpi.errors import ConfigError


def stage_layers(layers: int, stages: int, first: Optional[int] = None,
                 last: Optional[int] = None) -> Tuple[int, ...]:
    """Blocks per stage, first to last (module docstring). Known answers: 70 on 12 = 10 x 6, 2 x 5; 126 on 16 =
    14 x 8, 2 x 7; 126 on 16 with first 7, last 7 = 7, 14 x 8, 7. One-line :class:`ConfigError` for counts that
    do not add up."""
    if stages < 1 or stages > layers:
        raise ConfigError(f"--stages must be between 1 and the {layers} layers, got {stages}")
    if first is None and last is None:
        from fourd_mpi.algorithms.pipeline_plan import stage_blocks

        return tuple(len(stage_blocks(layers, stages, s)) for s in range(stages))
    if stages < 2:
        raise ConfigError("--first-stage-layers and --last-stage-layers need --stages 2 or more")
    for name, value in (("first", first), ("last", last)):
        if value is not None and not 1 <= value < layers:
            raise ConfigError(f"--{name}-stage-layers must be between 1 and {layers - 1}, got {value}")
    rest = layers - (first or 0) - (last or 0)
    middle = stages - (first is not None) - (last is not None)
    if middle == 0:
        if rest:
            raise ConfigError(f"2 stages: --first-stage-layers {first} + --last-stage-layers {last} != {layers} layers")
        return (first, last)
    if rest < middle or rest % middle:
        raise ConfigError(f"{layers} layers less --first/--last-stage-layers ({first}, {last}) leave {rest} for "
                          f"{middle} stage(s): not an equal whole number each (Megatron-LM requires it)")
    each = rest // middle
    return ((first,) if first is not None else (each,)) + (each,) * (stages - 2) + \
        ((last,) if last is not None else (each,))
