"""The bytes a built run really holds on this rank, measured from its arrays (for the memory checks
run under mpiexec: mpi_memory_check.py, mpi_optimus_check.py). Local: no communication."""

import numpy as np


def _arrays(obj, out):
    """Every NumPy array inside nested dicts, lists and tuples, appended to ``out``."""
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _arrays(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _arrays(v, out)
    return out


def unique_bytes(obj) -> int:
    """Bytes of the distinct base arrays behind the arrays in ``obj`` (a view counts its base once)."""
    seen, total = set(), 0
    for a in _arrays(obj, []):
        base = a
        while isinstance(base.base, np.ndarray):
            base = base.base
        if id(base) not in seen:
            seen.add(id(base))
            total += base.nbytes
    return total


def measure(run, recompute: str = "none") -> dict:
    """Bytes of the parameter shards, gradients and Adam state after one step of ``run`` (call
    ``run.trainer.step`` first), and of what one forward pass with ``recompute`` saves for backward."""
    params = run.model.parameters()
    opt = run.trainer.optimizer
    measured = {"weights": sum(p.data.nbytes for p in params), "gradients": sum(p.grad.nbytes for p in params),
                "optimizer": sum(a.nbytes for a in opt.m + opt.v)}
    x, _ = run.data.batch(1)
    run.trainer.weights.begin_forward()
    _, saved = run.model.forward(x, run.trainer.ctx, recompute)
    run.trainer.weights.finish()
    measured["saved"] = unique_bytes(saved)
    return measured
