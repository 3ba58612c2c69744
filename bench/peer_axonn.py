"""Peer benchmark: AxoNN's own intra-layer Linear pair, side by side with our 4D MLP block.

The block (the same on both sides): a normal 4D fully connected layer K -> K, GeLU
(tanh approximation), a transposed layer K -> K, no bias, float32, ``--seq * --batch``
tokens (default 256 x 16 = 4096), on the grid ``(G_x, G_y, G_z)`` with ``G_data = 1``.

* **AxoNN**: ``axonn.intra_layer.Linear`` of AxoNN 0.2.0, unmodified, ``expert_mode=True``
  (the caller lays out activations as the 4D algorithm does, as our block does), no
  overlap flags (its forward all-reduce is blocking; ours is waited at once too with
  ``--overlap none``). torch.distributed with gloo on CPUs (NCCL on GPUs). On a CPU
  machine a few of AxoNN's CUDA assumptions are patched at run time from this file
  (never in site-packages); every patch is printed as a ``# patch:`` line.
* **ours**: ``fourd_mpi`` ``Trainer.forward_backward`` of a one-block ``mlp`` model on the
  same grid (forward, MSE loss, backward, gradient reduce-scatters; no optimizer).

Timed region per step: forward + backward of the block, gradients complete on every rank. **Both sides
compute the same gradients** in every timed step: the input gradient dX of the block (with its backward
all-reduce over Y) and both weight gradients dW1, dW2 (each reduce-scattered over Z). AxoNN's input
carries ``requires_grad=True`` in the timed steps too (it once did not, so AxoNN skipped the dX GEMM and
its all-reduce while ours computed them); ours records which gradients its step hands on (dX: what its
backward returns; dW: what reaches the gradient sync). Each worker reports the set of gradients its timed
steps produced; the driver stops when the two sets differ. Ours also computes the MSE loss and its output
gradient (an all-reduce of one number over the grid) inside the step, where AxoNN is handed the output
gradient: the table's ``step contains`` lines say so. Step time = max over ranks; the table shows the
median over ``--steps`` steps after ``--warmup``, and the median over ``--rounds`` runs, which alternate
AxoNN, ours, AxoNN, ours, ... each a fresh ``mpiexec`` of ``--ranks`` ranks (the same launcher for both:
AxoNN's ranks take ``RANK``/``WORLD_SIZE`` from MPICH's ``PMI_RANK``/``PMI_SIZE``).
``ratio = ours median / AxoNN median`` (below 1: ours is faster).

Before timing, each side computes the block once on the same global weights, input and
output gradient (ours generates them; AxoNN's shards are copied from them) and compares
its output, input gradient and both weight gradients with a float64 NumPy reference
(norm-wise relative error, ``# check:`` lines); above 1e-4 the benchmark stops.

Single-rank baselines (one process, one thread, no communication): the block's six
GEMMs (``Y = X W1^T``, ``Z = G W2^T``, and the four backward products) on the full
``[tokens, K]`` operands, with torch and with NumPy: what the local GEMM library alone
costs on each side.

Install (CPU: the exact CPU torch wheel from pip's find-links, never the CUDA build)::

    pip install -e ".[mpich,peer]"
    OMP_NUM_THREADS=1 python -m bench.peer_axonn --ranks 8 --grids 2x2x2,1x8x1,1x1x8 --hidden 1024,2048

Grids are ``GXxGYxGZ`` here (AxoNN's ``G_intra_c x G_intra_r x G_intra_d``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

REPO = Path(__file__).resolve().parents[1]

TOLERANCE = 1e-4
C, A = math.sqrt(2.0 / math.pi), 0.044715


# the float64 reference of the block ------------------------------------------------------
def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(C * (x + A * x ** 3)))


def gelu_grad(x):
    t = np.tanh(C * (x + A * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3 * A * x * x)


def reference(x, w1, w2, dz):
    """Float64 block: ``h = x w1^T``, ``g = gelu(h)``, ``z = g w2^T``; gradients for ``dz``."""
    h = x @ w1.T
    g = gelu(h)
    z = g @ w2.T
    dg = dz @ w2
    dh = dg * gelu_grad(h)
    return {"z": z, "dx": dh @ w1, "dw1": dh.T @ x, "dw2": dz.T @ g}


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-300))


# the global tensors, made by our synthetic generator ---------------------------------------
def build_ours(world, gx, gy, gz, hidden, seq, batch):
    from fourd_mpi.run.build import Run
    from fourd_mpi.run.options import defaults, resolve_values

    values = defaults()
    values.update(model="mlp", layers=1, hidden=hidden, ffn_hidden=hidden, seq=seq, batch=batch, gx=gx, gy=gy,
                  gz=gz, gdata=1, dtype="float32", backend="numpy", overlap="none", steps=1, warmup=0, data_batches=1)
    return Run.build(world, resolve_values(values, world.Get_size()))


#: our MLP block's layer names and init scales (fourd_mpi.step.model.MLPBlock: fc2 is scaled by 2)
LAYERS = (("block0.fc1", 1.0), ("block0.fc2", 2.0))
#: the gradients every timed step of either side must produce
GRADIENTS = ("dW1", "dW2", "dX")
#: what one timed step contains, per side (printed above the table)
STEP_CONTAINS = {
    "axonn": "forward fc1, GeLU, fc2 (all-reduce over X per layer: normal over X, transposed over Y); backward "
             "with the given output gradient: dX of both layers (all-reduces) and dW1, dW2 (reduce-scatter over "
             "Z); input requires_grad, so dX of the block is computed",
    "ours": "the same forward and backward (dX of the block returned by the backward pass, dW1, dW2 "
            "reduce-scattered over Z), plus the MSE loss and its output gradient (one scalar all-reduce); no "
            "optimizer",
}


def global_tensors(hidden: int, seq: int, batch: int, seed: int = 0):
    """``x [T, K]``, ``w1``, ``w2 [K, K]``, target ``[T, K]`` (float64), as our run generates them (no MPI)."""
    from fourd_mpi.step.synthetic import stream_id, uniform_at, uniform_block

    shape = (batch * seq, hidden)
    full = (slice(0, shape[0]), slice(0, shape[1]))
    x = uniform_block(seed, stream_id("input", 0), shape, *full)
    target = 0.5 * uniform_block(seed, stream_id("target", 0), shape, *full)
    weights = []
    for name, scale in LAYERS:
        flat = uniform_at(seed, stream_id("weight", name), np.arange(hidden * hidden, dtype=np.int64))
        weights.append((flat * (scale / math.sqrt(hidden))).reshape(hidden, hidden))
    return x, weights[0], weights[1], target


def f32(a):
    return np.asarray(a, np.float32).astype(np.float64)  # what float32 storage holds


# workers (run under mpiexec) ----------------------------------------------------------------
def worker_ours(args) -> Dict:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    run = build_ours(world, args.gx, args.gy, args.gz, args.hidden, args.seq, args.batch)
    assert [fc.name for fc in run.model.blocks[0].fc_layers()] == [name for name, _ in LAYERS]
    x, w1, w2, target = global_tensors(args.hidden, args.seq, args.batch, run.options.seed)
    x, w1, w2 = f32(x), f32(w1), f32(w2)
    z = gelu(x @ w1.T) @ w2.T
    ref = reference(x, w1, w2, (f32(z) - f32(target)) / target.size)
    fc1, fc2 = run.model.blocks[0].fc_layers()
    produced = set()  # the gradients of the step in progress (recorded, not changed)
    backward, reduce = run.model.backward, run.trainer.grads.reduce
    names = {fc1.weight.name: "dW1", fc2.weight.name: "dW2"}
    held = {}

    def recording_backward(dy, saved, ctx):
        held["dX"] = dx = backward(dy, saved, ctx)
        produced.add("dX")
        return dx

    def recording_reduce(param, *rest):
        produced.add(names.get(param.name, param.name))
        return reduce(param, *rest)

    run.model.backward, run.trainer.grads.reduce = recording_backward, recording_reduce
    _, y = run.trainer.forward_backward(0)
    rows, cols = run.data.rows, run.data.cols
    errors = {"output": rel(y, ref["z"][rows, cols]), "dX": rel(held["dX"], ref["dx"][rows, cols]),
              "dW1": rel(fc1.weight.grad, ref["dw1"].reshape(-1)[fc1.weight.global_index()]),
              "dW2": rel(fc2.weight.grad, ref["dw2"].reshape(-1)[fc2.weight.global_index()])}
    errors = {k: world.allreduce(v, op=MPI.MAX) for k, v in errors.items()}
    times, timed_sets = [], []
    for i in range(args.warmup + args.steps):
        produced.clear()
        world.Barrier()
        t0 = time.perf_counter()
        run.trainer.forward_backward(0)
        local = time.perf_counter() - t0
        times.append(world.allreduce(local, op=MPI.MAX))
        timed_sets.append(sorted(produced))
    run.close()
    return {"times": times[args.warmup:], "errors": errors, "rank": world.Get_rank(),
            "gradients": _one_set(timed_sets[args.warmup:])}


def _one_set(sets) -> List[str]:
    """The gradients every timed step produced (they must be the same set in every step)."""
    if any(s != sets[0] for s in sets):
        raise SystemExit(f"peer_axonn: the timed steps produced different gradient sets: {sets}")
    return list(sets[0])


def _with_keyword(fn, key: str, value):
    """``fn`` with keyword ``key`` forced to ``value``."""
    def wrapped(*a, **k):
        k[key] = value
        return fn(*a, **k)

    return wrapped


def _patch_axonn_for_cpu(say) -> None:
    """Run-time patches of AxoNN 0.2.0's CUDA assumptions (CPU only). Each is announced."""
    import axonn.intra_layer.fully_connected as fc
    import axonn.intra_layer.overlap_communication as oc
    import torch
    import torch.distributed as dist

    torch.cuda.set_device = lambda *a, **k: None
    say("torch.cuda.set_device -> no-op (communication_handle calls it for its local rank)")
    torch.cuda.synchronize = lambda *a, **k: None
    say("torch.cuda.synchronize -> no-op")
    dist.new_group = _with_keyword(dist.new_group, "backend", "gloo")
    say('torch.distributed.new_group(backend="nccl") -> backend="gloo"')
    fc.initialize_params = _with_keyword(fc.initialize_params, "init_device", "cpu")
    say('axonn.intra_layer.fully_connected.initialize_params(init_device="cuda") -> "cpu"')
    torch.cuda.current_device = lambda: "cpu"
    say('torch.cuda.current_device -> "cpu" (device of the reduce-scatter output)')

    def clear_handles():
        for handle in oc.handles:
            handle.wait()
        oc.handles = []

    oc.clear_handles = clear_handles
    say("axonn.intra_layer.overlap_communication.clear_handles -> wait on every handle")


def worker_axonn(args) -> Dict:
    import torch
    import torch.distributed as dist

    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    torch.set_num_threads(1)
    patches = []
    gpu = torch.cuda.is_available()
    if not gpu:
        _patch_axonn_for_cpu(patches.append)
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=size,
                            init_method=f"tcp://127.0.0.1:{args.port}")
    from axonn import axonn as ax
    from axonn.intra_layer import Linear

    ax.init(G_inter=1, G_data=1, G_intra_r=args.gy, G_intra_c=args.gx, G_intra_d=args.gz,
            gpus_per_node=torch.cuda.device_count() if gpu else 1)
    device = "cuda" if gpu else "cpu"
    fc1 = Linear(args.hidden, args.hidden, bias=False, expert_mode=True).to(device)
    fc2 = Linear(args.hidden, args.hidden, bias=False, expert_mode=True, transpose=True).to(device)
    # the same global tensors as ours: our synthetic generator (NumPy only, no MPI)
    x, w1, w2, target = global_tensors(args.hidden, args.seq, args.batch)
    x, w1, w2 = f32(x), f32(w1), f32(w2)
    z = gelu(x @ w1.T) @ w2.T
    dz = (f32(z) - f32(target)) / target.size
    ref = reference(x, w1, w2, dz)
    # AxoNN's rank order: x = r % gx, y = (r // gx) % gy, z = r // (gx gy); tokens split over Z
    cx, cy, cz = rank % args.gx, (rank // args.gx) % args.gy, rank // (args.gx * args.gy)
    tokens, k = x.shape
    rows = slice(cz * tokens // args.gz, (cz + 1) * tokens // args.gz)
    cols_x = slice(cx * k // args.gx, (cx + 1) * k // args.gx)

    def shard(w, out_parts, out_coord, in_parts, in_coord):
        n, kk = w.shape
        block = w[out_coord * n // out_parts:(out_coord + 1) * n // out_parts,
                  in_coord * kk // in_parts:(in_coord + 1) * kk // in_parts].reshape(-1)
        return block[cz * block.size // args.gz:(cz + 1) * block.size // args.gz]

    with torch.no_grad():  # normal: out over Y, in over X; transposed: out over X, in over Y
        fc1.weight.copy_(torch.from_numpy(shard(w1, args.gy, cy, args.gx, cx).astype(np.float32)))
        fc2.weight.copy_(torch.from_numpy(shard(w2, args.gx, cx, args.gy, cy).astype(np.float32)))
    x_local = torch.from_numpy(x[rows, cols_x].astype(np.float32)).to(device)
    dz_local = torch.from_numpy(dz[rows, cols_x].astype(np.float32)).to(device)

    def step():
        """One step, the same in the check and in every timed step: the input requires its gradient (dX)."""
        xin = x_local.clone().requires_grad_(True)
        fc1.weight.grad = fc2.weight.grad = None
        out = fc2(torch.nn.functional.gelu(fc1(xin), approximate="tanh"))
        out.backward(dz_local)
        if gpu:
            torch.cuda.synchronize()
        return out, xin

    def produced(xin) -> List[str]:
        grads = {"dX": xin.grad, "dW1": fc1.weight.grad, "dW2": fc2.weight.grad}
        return sorted(name for name, g in grads.items() if g is not None)

    out, xin = step()
    errors = {"output": rel(out.detach().cpu().numpy(), ref["z"][rows, cols_x]),
              "dX": rel(xin.grad.cpu().numpy(), ref["dx"][rows, cols_x]),
              "dW1": rel(fc1.weight.grad.cpu().numpy(), shard(ref["dw1"], args.gy, cy, args.gx, cx)),
              "dW2": rel(fc2.weight.grad.cpu().numpy(), shard(ref["dw2"], args.gx, cx, args.gy, cy))}
    worst = torch.tensor([errors[k] for k in sorted(errors)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    errors = dict(zip(sorted(errors), worst.tolist()))
    times, timed_sets = [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        _, xin = step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
        timed_sets.append(produced(xin))
    dist.destroy_process_group()
    import axonn

    return {"times": times[args.warmup:], "errors": errors, "rank": rank, "patches": patches,
            "gradients": _one_set(timed_sets[args.warmup:]),
            "axonn": getattr(axonn, "__version__", "0.2.0"), "torch": torch.__version__}


# single-rank baselines -------------------------------------------------------------------------
def six_gemms(x, w1, w2):
    """The block's GEMMs without the GeLU (forward 2, backward 4); NumPy arrays or torch tensors."""
    h = x @ w1.T
    z = h @ w2.T
    dg = z @ w2
    return dg @ w1, dg.T @ x, z.T @ h


def gemm_baselines(tokens: int, k: int, repeats: int = 3) -> Dict[str, float]:
    """Seconds of the block's six GEMMs on one rank, torch and NumPy, float32, median of ``repeats``."""
    rng = np.random.default_rng(0)
    operands = [rng.standard_normal(s).astype(np.float32) for s in ((tokens, k), (k, k), (k, k))]
    out = {"numpy": _median_time(lambda: six_gemms(*operands), repeats)}
    try:
        import torch
    except ImportError:
        return out
    torch.set_num_threads(1)
    tensors = [torch.from_numpy(a) for a in operands]
    out["torch"] = _median_time(lambda: six_gemms(*tensors), repeats)
    return out


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# the driver -------------------------------------------------------------------------------------
def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(side: str, args, gx: int, gy: int, gz: int, hidden: int) -> Dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.ranks), sys.executable, "-m",
               "bench.peer_axonn", "--worker", side, "--gx", str(gx), "--gy", str(gy), "--gz", str(gz),
               "--hidden", str(hidden),
               "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--port", str(free_port()), "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise SystemExit(f"peer_axonn: the {side} run on {gx}x{gy}x{gz}, K={hidden} failed "
                             f"(exit {proc.returncode}): {' | '.join(tail)}")
        with open(out) as fh:
            return json.load(fh)


def parse_grid(text: str):
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"grid {text!r}: expected GXxGYxGZ, e.g. 2x2x2")
    return tuple(parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="AxoNN's intra-layer Linear pair vs our 4D MLP block, side by side")
    p.add_argument("--ranks", type=int, default=8, help="ranks of every run (default 8)")
    p.add_argument("--grids", default="2x2x2,1x8x1,1x1x8",
                   help="comma list of GXxGYxGZ (product = --ranks; default 2x2x2,1x8x1,1x1x8)")
    p.add_argument("--hidden", default="1024,2048", help="comma list of K (default 1024,2048)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="alternating AxoNN/ours runs per configuration (default 2)")
    p.add_argument("--json", metavar="FILE", help="also write every number as JSON")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    # worker mode (internal)
    p.add_argument("--worker", choices=("ours", "axonn"), help=argparse.SUPPRESS)
    for name in ("gx", "gy", "gz", "port"):
        p.add_argument(f"--{name}", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def driver(args) -> int:
    grids = [parse_grid(g) for g in args.grids.split(",")]
    sizes = [int(k) for k in args.hidden.split(",")]
    bad = [g for g in grids if g[0] * g[1] * g[2] != args.ranks]
    if bad:
        raise SystemExit(f"peer_axonn: grid(s) {bad} do not multiply to --ranks {args.ranks}")
    tokens = args.seq * args.batch
    print(f"# peer benchmark: AxoNN intra_layer.Linear pair vs fourd_mpi MLP block, {args.ranks} ranks, "
          f"{tokens} tokens, float32, OMP_NUM_THREADS=1, {args.rounds} alternating round(s) per row")
    print("# step = forward + backward of Linear(K->K) -> GeLU -> Linear^T(K->K), max over ranks; "
          f"median of {args.steps} steps after {args.warmup}, then median over rounds")
    print("# ratio = ours / AxoNN (below 1: ours faster); 1-rank torch / numpy = the block's 6 GEMMs "
          "on one rank, no communication (the GEMM libraries alone)")
    for side, text in STEP_CONTAINS.items():
        print(f"# step contains ({side}): {text}")
    print(f"# load average before: {_loadavg()}")
    rows, printed_patches, gradient_sets = [], False, {"axonn": set(), "ours": set()}
    for hidden in sizes:
        base = gemm_baselines(tokens, hidden)
        for gx, gy, gz in grids:
            runs = {"axonn": [], "ours": []}
            for _ in range(args.rounds):
                for side in ("axonn", "ours"):
                    result = launch(side, args, gx, gy, gz, hidden)
                    if side == "axonn" and not printed_patches:
                        for line in result.get("patches", []):
                            print(f"# patch: {line}")
                        printed_patches = True
                    if sorted(result["gradients"]) != sorted(GRADIENTS):
                        raise SystemExit(f"peer_axonn: the {side} timed steps produced gradients "
                                         f"{result['gradients']}, not {list(GRADIENTS)}: unequal work")
                    gradient_sets[side].add(",".join(sorted(result["gradients"])))
                    worst = max(result["errors"].values())
                    errors = ", ".join(f"{k} {v:.1e}" for k, v in sorted(result["errors"].items()))
                    print(f"# check: {side} {gx}x{gy}x{gz} K={hidden}: max rel. error over ranks {errors}")
                    if not worst <= TOLERANCE:
                        raise SystemExit(f"peer_axonn: {side} differs from the float64 reference by {worst:.2e} "
                                         f"> {TOLERANCE} on {gx}x{gy}x{gz}, K={hidden}")
                    runs[side].append(statistics.median(result["times"]))
            ax_s, our_s = statistics.median(runs["axonn"]), statistics.median(runs["ours"])
            rows.append({"grid": f"{gx}x{gy}x{gz}", "K": hidden, "axonn_s": ax_s, "ours_s": our_s,
                         "ratio": our_s / ax_s, "axonn_rounds": runs["axonn"], "ours_rounds": runs["ours"],
                         "torch_1rank_s": base.get("torch"), "numpy_1rank_s": base["numpy"]})
    print(f"{'grid (x,y,z)':<13} {'K':>5} {'AxoNN (s)':>10} {'ours (s)':>9} {'ratio':>6} "
          f"{'spread AxoNN':>16} {'spread ours':>16} {'1-rank torch':>13} {'1-rank numpy':>13}")
    for r in rows:
        spread = lambda v: f"{min(v):.3f}-{max(v):.3f}"  # noqa: E731
        print(f"{r['grid']:<13} {r['K']:>5} {r['axonn_s']:10.4f} {r['ours_s']:9.4f} {r['ratio']:6.2f} "
              f"{spread(r['axonn_rounds']):>16} {spread(r['ours_rounds']):>16} "
              f"{r['torch_1rank_s'] or float('nan'):13.4f} {r['numpy_1rank_s']:13.4f}")
    geo = math.exp(statistics.fmean(math.log(r["ratio"]) for r in rows))
    print(f"# geometric mean of ratio over {len(rows)} row(s): {geo:.2f}")
    print(f"# gradients of every timed step, both sides: {', '.join(GRADIENTS)}; load average after: {_loadavg()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "geomean_ratio": geo, "args": vars(args), "gradients": list(GRADIENTS),
                       "step_contains": STEP_CONTAINS,
                       "gradient_sets": {k: sorted(v) for k, v in gradient_sets.items()}}, fh, indent=1)
    return 0


def main(argv: List[str] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is None:
        return driver(args)
    args.hidden = int(args.hidden)  # a worker runs one size
    result = (worker_ours if args.worker == "ours" else worker_axonn)(args)
    if result["rank"] == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
