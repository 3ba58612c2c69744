"""Activation recompute side by side: step time and activation memory of ``--recompute none|selective|full``.

One ``mpiexec`` run builds the same model on the same grid three times (one run per recompute mode,
each with its own array pool) and then alternates them: repeat ``r`` runs ``--steps`` steps of every
mode, in an order rotated by one mode per repeat, so drift of a shared machine hits every mode alike.
Per mode it reports

* **step time**: per step the max over ranks of the step's wall time; per repeat the median over its
  steps; the median (and min/max) over repeats of those medians;
* **hardware / model time ratio** implied: model FLOPs per step are the same for every mode
  (``72 B s l h^2 (1 + s/6h)``), hardware FLOPs are those the step executes
  (``ModelConfig.hardware_flops_per_step``: 4/3 of them with full recompute, the ``96`` convention);
  both are shown per rank as GFLOP/s over the median step time;
* **activation bytes** kept from the end of the forward pass for the backward pass and the most held
  at once during the backward pass (max over ranks, measured from the arrays actually held,
  ``fourd_mpi.step.model.held_bytes``), and the bytes the host array pool holds after the last step
  (max over ranks: what the step really allocated, activations, gradients and buffers together).

Launch with one BLAS thread per rank::

    OMP_NUM_THREADS=1 mpiexec -n 8 python -m bench.recompute_bench --gx 2 --gy 2 --gz 2 \\
        --steps 3 --repeats 5 --json recompute.json

Default model: gpt-small with 2 layers and sequence length 256 (the attention probabilities
``[B, heads/y, s, s]`` are then a large part of the activations). ``--overlap`` and ``--progress``
are passed to every mode as in ``fourd-mpi run``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import replace

from mpi4py import MPI

from fourd_mpi.cli.args import OneLineParser, add_options
from fourd_mpi.run.build import Run
from fourd_mpi.run.options import resolve_values
from fourd_mpi.step.presets import RECOMPUTE_MODES
from fourd_mpi.util.values import positive_int

DEFAULTS = {"model": "gpt-small", "layers": 2, "seq": 256}


def parse(argv=None):
    p = OneLineParser(prog="recompute_bench.py", description=__doc__.split("\n\n")[0])
    add_options(p, ("grid", "model", "numerics", "overlap"))
    p.add_argument("--steps", type=positive_int, default=3, help="steps per mode and repeat (default 3)")
    p.add_argument("--repeats", type=positive_int, default=5, help="alternating repeats (default 5)")
    p.add_argument("--json", metavar="FILE", help="also write every number as JSON (rank 0)")
    args = p.parse_args(argv)
    given = vars(args)
    if given["model"] == "gpt-tiny":  # the option table's default: use this benchmark's instead
        for key, value in DEFAULTS.items():
            if key == "model" or given.get(key) is None:
                given[key] = value
    return args


def main(argv=None) -> int:
    world = MPI.COMM_WORLD
    args = parse(argv)
    base = resolve_values({k: v for k, v in vars(args).items() if k not in ("steps", "repeats", "json")},
                          world.Get_size())
    rank = world.Get_rank()
    runs = {mode: Run.build(world, replace(base, recompute=mode)) for mode in RECOMPUTE_MODES}
    for run in runs.values():  # warm-up: first-touch page faults, pools filled
        run.trainer.step(0)
    times = {mode: [] for mode in RECOMPUTE_MODES}
    step = 1
    for r in range(args.repeats):
        order = RECOMPUTE_MODES[r % 3:] + RECOMPUTE_MODES[:r % 3]
        for mode in order:
            per_step = []
            for _ in range(args.steps):
                per_step.append(runs[mode].trainer.step(step).seconds)
                step += 1
            times[mode].append(statistics.median(per_step))
    rows = []
    for mode, run in runs.items():
        result = run.trainer.step(step)
        saved = world.allreduce(result.saved_activation_bytes, op=MPI.MAX)
        peak = world.allreduce(result.peak_activation_bytes, op=MPI.MAX)
        pool = world.allreduce(run.backend.pool_stats().get("bytes", 0), op=MPI.MAX)
        cfg = run.options.model
        median = statistics.median(times[mode])
        rows.append({"recompute": mode, "step_median_s": median, "step_min_s": min(times[mode]),
                     "step_max_s": max(times[mode]), "per_repeat_s": times[mode],
                     "model_gflops_per_rank": cfg.flops_per_step() / world.Get_size() / median / 1e9,
                     "hardware_gflops_per_rank": cfg.hardware_flops_per_step(mode) / world.Get_size() / median / 1e9,
                     "saved_activation_bytes": saved, "peak_activation_bytes": peak, "pool_bytes": pool})
    for run in runs.values():
        run.close()
    if rank == 0:
        cfg = base.model
        print(f"# recompute_bench: {cfg.name} (L={cfg.layers}, h={cfg.hidden}, heads={cfg.heads}, s={cfg.seq}, "
              f"B={cfg.batch}), grid {base.grid} on {world.Get_size()} ranks, {base.dtype}, overlap {base.overlap}, "
              f"progress {base.progress}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
        print(f"# {args.repeats} repeats x {args.steps} steps per mode, modes alternated (order rotated each "
              f"repeat); step = max over ranks; per repeat the median over its steps; below the median over repeats")
        print("# GFLOP/s per rank = FLOPs per step / ranks / median step: model = 72 B s l h^2 (1 + s/6h) for every "
              "mode; hardware = executed (x 4/3 under full: 96 B s l h^2 (1 + s/6h); + 4 B s^2 h l under selective)")
        print("# bytes: max over ranks; saved = activations kept from forward for backward, peak = most held at once "
              "in backward (measured from the arrays held); pool = host array pool after the last step")
        head = (f"{'recompute':<10} {'step (s)':>9} {'min':>8} {'max':>8} {'vs none':>8} {'model GF/s':>10} "
                f"{'hw GF/s':>8} {'saved MiB':>10} {'peak MiB':>9} {'pool MiB':>9}")
        print(head)
        none = rows[0]["step_median_s"]
        mib = 1 / 2 ** 20
        for row in rows:
            print(f"{row['recompute']:<10} {row['step_median_s']:>9.4f} {row['step_min_s']:>8.4f} "
                  f"{row['step_max_s']:>8.4f} {row['step_median_s'] / none:>8.3f} "
                  f"{row['model_gflops_per_rank']:>10.3f} "
                  f"{row['hardware_gflops_per_rank']:>8.3f} {row['saved_activation_bytes'] * mib:>10.3f} "
                  f"{row['peak_activation_bytes'] * mib:>9.3f} {row['pool_bytes'] * mib:>9.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"model": cfg.as_dict(), "grid": str(base.grid), "world_size": world.Get_size(),
                           "dtype": base.dtype, "overlap": base.overlap, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
