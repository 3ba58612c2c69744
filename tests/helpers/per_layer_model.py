"""The performance model's communication, layer by layer: the step's whole collective list (every block's) and a
timeline that runs every layer, as the model did before it priced one block and counted it L times.

An oracle for tests/perf/test_layer_count.py. Every sum here is the exact sum of all the seconds counted,
correctly rounded (:func:`math.fsum` of every term, kept in a list), so the model, whose sums are exact too
(:mod:`fourd_mpi.perf.exact`), must give the same floats, not merely close ones. Compute, memory and the
price of one collective come from the model itself: what is checked is how the layers add up.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import asdict

from fourd_mpi.perf import optimus3d as o3
from fourd_mpi.perf.machine import axis_inner_products, axis_placement
from fourd_mpi.perf.memory import block_elements, fc_weights, local_tokens
from fourd_mpi.perf.predict import OVERLAPS, back_to_back, collective_time, compute_time, exposed_after_hiding
from fourd_mpi.perf.volumes import step_collectives
from fourd_mpi.step.overlap import OverlapConfig


class Terms:
    """key -> every term added, in first-added key order; :meth:`floats` their exact sums, correctly rounded."""

    def __init__(self):
        self.terms = {}

    def add(self, key, x):
        self.terms.setdefault(key, []).append(x)

    def floats(self):
        return {k: math.fsum(v) for k, v in self.terms.items()}


class LinkByLayer:
    """:class:`fourd_mpi.perf.predict.Link` as it was, with every second kept."""

    def __init__(self, efficiency):
        self.efficiency = efficiency
        self.queue = deque()
        self.exposed = Terms()
        self.hidden = Terms()

    def issue(self, key, seconds):
        item = [seconds, key]
        if seconds > 0:
            self.queue.append(item)
        return item

    def compute(self, seconds):
        budget = self.efficiency * seconds
        while budget > 0 and self.queue:
            item = self.queue[0]
            used = min(item[0], budget)
            item[0] -= used
            budget -= used
            self.hidden.add(item[1], used)
            if item[0] <= 0:
                self.queue.popleft()

    def wait(self, item):
        while item[0] > 0 and self.queue:
            head = self.queue.popleft()
            self.exposed.add(head[1], head[0])
            head[0] = 0.0

    def wait_all(self):
        while self.queue:
            self.wait(self.queue[-1])

    def blocking(self, key, seconds):
        self.exposed.add(key, seconds)


def tensor4d_timeline(cfg, grid, colls, times, comp, overlap, efficiency, recompute):
    """The device-driven replay over every layer of ``colls`` (every block's collectives)."""
    link = LinkByLayer(efficiency)
    fcs = fc_weights(cfg, grid)
    order = [f"block{b}.{name}" for b in range(cfg.layers) for name, _, _, _ in fcs]
    m = local_tokens(cfg, grid)
    per_flop = comp["gemm_per_flop"]
    gemm_f = {f"block{b}.{name}": 2.0 * m * block_elements(n, k, t, grid) * per_flop
              for b in range(cfg.layers) for name, n, k, t in fcs}
    other = comp["block_other"] / max(1, len(order))
    rec_other = (comp["recompute"] - comp["recompute_gemm"]) / max(1, len(order))
    by_layer = defaultdict(lambda: defaultdict(list))
    for c, t in zip(colls, times):
        by_layer[c.layer][(c.role, c.phase)].append((t, c))
    depth = overlap.prefetch_depth if overlap.oag else 0

    def key(c):
        return (c.axis, c.op)

    def block_ln(block, phase):
        for ln in ("ln1", "ln2"):
            for (role, ph), items in by_layer.get(f"block{block}.{ln}", {}).items():
                if ph == phase:
                    for t, c in items:
                        link.blocking(key(c), t)

    def gather(layer, phase):
        items = by_layer.get(layer, {}).get(("weight_allgather", phase), [])
        if not items:
            return None
        t, c = items[0]
        if not overlap.oag:
            link.blocking(key(c), t)
            return None
        return link.issue(key(c), t)

    def forward_allreduce(layer, window):
        items = by_layer.get(layer, {}).get(("fwd_allreduce", "forward"), [])
        if not items:
            link.compute(window)
            return
        t, c = items[0]
        chunks = c.count
        if overlap.od and chunks > 1:
            link.compute(window / chunks)
            pending = link.issue(key(c), t * (chunks - 1) / chunks)
            link.compute(window * (chunks - 1) / chunks)
            link.wait(pending)
            link.blocking(key(c), t / chunks)
        else:
            link.compute(window)
            link.blocking(key(c), t)

    issued = {}
    for j, layer in enumerate(order):
        if j % len(fcs) == 0 and cfg.kind == "gpt":
            block_ln(j // len(fcs), "forward")
        for ahead in order[j:j + depth + 1]:
            if ahead not in issued:
                issued[ahead] = gather(ahead, "forward")
        if issued.get(layer) is not None:
            link.wait(issued[layer])
        forward_allreduce(layer, gemm_f[layer] + other / 3.0)
    for t, c in by_layer.get("loss", {}).get(("loss", "forward"), []):
        link.blocking(key(c), t)
    back = list(reversed(order))
    issued = {}
    for j, layer in enumerate(back):
        for ahead in back[j:j + depth + 1]:
            if ahead not in issued:
                issued[ahead] = gather(ahead, "backward")
        if issued.get(layer) is not None:
            link.wait(issued[layer])
        if recompute == "full":
            forward_allreduce(layer, gemm_f[layer] + rec_other)
        elif rec_other:
            link.compute(rec_other)
        half = gemm_f[layer] + other / 3.0
        link.compute(half)
        dx = by_layer.get(layer, {}).get(("bwd_allreduce", "backward"), [])
        pending = None
        if dx:
            t, c = dx[0]
            if overlap.oar:
                pending = link.issue(key(c), t)
            else:
                link.blocking(key(c), t)
        link.compute(half)
        if pending is not None:
            link.wait(pending)
        for role, option in (("dw_reduce_scatter", "ors"), ("grad_allreduce", "dp")):
            for t, c in by_layer.get(layer, {}).get((role, "backward"), []):
                if role == "grad_allreduce" and not overlap.dp:
                    continue
                if getattr(overlap, option):
                    link.issue(key(c), t)
                else:
                    link.blocking(key(c), t)
        if j % len(fcs) == len(fcs) - 1 and cfg.kind == "gpt":
            block_ln(cfg.layers - 1 - j // len(fcs), "backward")
    link.wait_all()
    if not overlap.dp:
        for layer in back:
            for t, c in by_layer.get(layer, {}).get(("grad_allreduce", "backward"), []):
                link.blocking(key(c), t)
    return link


def tensor4d(cfg, grid, profile, overlap=None, dtype="float32", progress="poll", optimizer="adam", recompute="none",
             attention="unfused"):
    """``(comm, exposed, wire, step)`` of :func:`fourd_mpi.perf.predict.predict`, layer by layer."""
    overlap = overlap or OverlapConfig()
    rpn = min(profile.ranks_per_node, grid.size)
    placement = axis_placement(grid, rpn)
    inner = axis_inner_products(grid)
    comp = compute_time(cfg, grid, profile, overlap, dtype, rpn, optimizer, recompute=recompute, attention=attention)
    efficiency = profile.overlap_efficiency
    colls = step_collectives(cfg, grid, overlap, dtype)
    comm, wire = Terms(), defaultdict(int)
    if not profile.host_driven:
        times = [collective_time(c, profile, placement, rpn, inner, back_to_back(c.role, c.axis, overlap))
                 for c in colls]
        for c, t in zip(colls, times):
            for _ in range(2 if recompute == "full" and c.role == "fwd_allreduce" else 1):
                comm.add((c.axis, c.op), t)
                wire[c.axis] += c.wire_bytes
        link = tensor4d_timeline(cfg, grid, colls, times, comp, overlap, efficiency, recompute)
        comm = comm.floats()
        link_exposed = link.exposed.floats()
        exposed = {k: link_exposed.get(k, 0.0) for k in comm}
        return comm, exposed, dict(wire), comp["total"] + sum(exposed.values())
    if progress == "none":
        efficiency = 0.0
    per_layer_gemm = comp["gemm"] / max(1, len(fc_weights(cfg, grid)) * cfg.layers)
    backward_compute = comp["total"] * (2.0 / 3.0)
    hidden = Terms()
    layer_index = {}
    for c in colls:
        t = collective_time(c, profile, placement, rpn, inner, back_to_back(c.role, c.axis, overlap))
        key = (c.axis, c.op)
        comm.add(key, t)
        wire[c.axis] += c.wire_bytes
        option = OVERLAPS.get(c.role)
        if option is None or not getattr(overlap, option) or efficiency == 0.0:
            continue
        idx = layer_index.setdefault(c.layer, len(layer_index))
        if option == "oag":
            first = 1.0 / max(1, len(fc_weights(cfg, grid)) * cfg.layers)
            window = per_layer_gemm * overlap.prefetch_depth * (0.5 if c.phase == "forward" else 1.0)
            hidden.add(key, efficiency * min(t * (1 - first), window))
        elif option == "od":
            window = per_layer_gemm / 3.0 * (c.count - 1) / max(1, c.count)
            hidden.add(key, efficiency * min(t * (c.count - 1) / max(1, c.count), window))
        elif option == "oar":
            hidden.add(key, efficiency * min(t, per_layer_gemm / 3.0))
        else:
            remaining = backward_compute * idx / max(1, len(layer_index) + 1)
            hidden.add(key, efficiency * min(t, remaining))
    comm = comm.floats()
    exposed = exposed_after_hiding(comm, hidden.floats(), efficiency * comp["total"])
    return comm, exposed, dict(wire), comp["total"] + sum(exposed.values())


def optimus3d_timeline(cfg, grid, colls, times, comp, overlap, efficiency, recompute):
    """:func:`fourd_mpi.perf.optimus3d.device_timeline` over every layer."""
    link = LinkByLayer(efficiency)
    q, m = grid.x, o3.local_tokens(cfg, grid)
    per_block = o3.layers(cfg)
    order = [f"block{b}.{name}" for b in range(cfg.layers) for name, _, _, _ in per_block]
    gemm_f = {f"block{b}.{name}": 2.0 * (q * m) * (k // q) * (n // q) * comp["gemm_per_flop"]
              for b in range(cfg.layers) for name, n, k, _ in per_block}
    other = comp["block_other"] / max(1, len(order))
    rec_other = (comp["recompute"] - comp["recompute_gemm"]) / max(1, len(order))
    by = defaultdict(lambda: defaultdict(list))
    for c, t in zip(colls, times):
        by[c.layer][(c.role, c.phase)].append((t, c))

    def blocking(layer, role, phase):
        for t, c in by.get(layer, {}).get((role, phase), []):
            link.blocking((c.axis, c.op), t)

    def ln(block, phase):
        if cfg.kind == "gpt":
            for name in ("ln1", "ln2"):
                for (role, ph), items in by.get(f"block{block}.{name}", {}).items():
                    if ph == phase:
                        for t, c in items:
                            link.blocking((c.axis, c.op), t)

    depth = overlap.prefetch_depth if overlap.oag else 0
    issued = {}
    for j, layer in enumerate(order):
        if j % len(per_block) == 0:
            ln(j // len(per_block), "forward")
        for ahead in order[j:j + depth + 1]:
            if ahead not in issued:
                items = by.get(ahead, {}).get(("weight_allgather", "forward"), [])
                issued[ahead] = None
                if items:
                    t, c = items[0]
                    if overlap.oag:
                        issued[ahead] = link.issue((c.axis, c.op), t)
                    else:
                        link.blocking((c.axis, c.op), t)
        blocking(layer, "input_allgather", "forward")
        if issued.get(layer) is not None:
            link.wait(issued[layer])
        link.compute(gemm_f[layer] + other / 3.0)
        blocking(layer, "output_reduce_scatter", "forward")
    blocking("loss", "loss", "forward")
    deferred = []
    for j, layer in enumerate(reversed(order)):
        if recompute == "full":
            if j % len(per_block) == 0:
                ln(cfg.layers - 1 - j // len(per_block), "recompute")
            blocking(layer, "input_allgather", "recompute")
            link.compute(gemm_f[layer] + rec_other)
            blocking(layer, "output_reduce_scatter", "recompute")
        elif recompute == "selective":
            blocking(layer, "input_allgather", "recompute")
            link.compute(rec_other)
        blocking(layer, "dy_allgather", "backward")
        half = gemm_f[layer] + other / 3.0
        link.compute(half)
        pending = None
        for t, c in by.get(layer, {}).get(("dx_reduce_scatter", "backward"), []):
            if overlap.oar:
                pending = link.issue((c.axis, c.op), t)
            else:
                link.blocking((c.axis, c.op), t)
        link.compute(half)
        if pending is not None:
            link.wait(pending)
        for role, option in (("dw_reduce_scatter", "ors"), ("grad_allreduce", "dp")):
            for t, c in by.get(layer, {}).get((role, "backward"), []):
                if role == "grad_allreduce" and not overlap.dp:
                    deferred.append((t, c))
                elif getattr(overlap, option):
                    link.issue((c.axis, c.op), t)
                else:
                    link.blocking((c.axis, c.op), t)
        if j % len(per_block) == len(per_block) - 1:
            ln(cfg.layers - 1 - j // len(per_block), "backward")
    link.wait_all()
    for t, c in deferred:
        link.blocking((c.axis, c.op), t)
    return link


def optimus3d(cfg, grid, profile, overlap=None, dtype="float32", progress="poll", optimizer="adam", recompute="none",
              attention="unfused"):
    """``(comm, exposed, wire, step)`` of :func:`fourd_mpi.perf.optimus3d.predict`, layer by layer."""
    overlap = OverlapConfig(**{**asdict(overlap or OverlapConfig()), "cache": True})
    rpn = min(profile.ranks_per_node, grid.size)
    placement = axis_placement(grid, rpn)
    inner = axis_inner_products(grid)
    comp = o3.compute_time(cfg, grid, profile, overlap, dtype, rpn, optimizer, attention, recompute)
    colls = o3.step_collectives(cfg, grid, overlap, dtype, recompute)
    efficiency = profile.overlap_efficiency
    if profile.host_driven and progress == "none":
        efficiency = 0.0
    comm, wire = Terms(), defaultdict(int)
    if not profile.host_driven:
        times = [collective_time(c, profile, placement, rpn, inner) for c in colls]
        for c, t in zip(colls, times):
            comm.add((c.axis, c.op), t)
            wire[c.axis] += c.wire_bytes
        link = optimus3d_timeline(cfg, grid, colls, times, comp, overlap, efficiency, recompute)
        comm = comm.floats()
        link_exposed = link.exposed.floats()
        exposed = {k: link_exposed.get(k, 0.0) for k in comm}
        return comm, exposed, dict(wire), comp["total"] + sum(exposed.values())
    n_layers = max(1, len(o3.layers(cfg)) * cfg.layers)
    per_layer_gemm = comp["gemm"] / n_layers
    backward_compute = comp["total"] * (2.0 / 3.0)
    hidden = Terms()
    layer_index = {}
    for c in colls:
        t = collective_time(c, profile, placement, rpn, inner)
        key = (c.axis, c.op)
        comm.add(key, t)
        wire[c.axis] += c.wire_bytes
        option = o3.OVERLAPS.get(c.role)
        if option is None or not getattr(overlap, option) or efficiency == 0.0:
            continue
        idx = layer_index.setdefault(c.layer, len(layer_index))
        if option == "oag":
            window = per_layer_gemm / 3.0 * overlap.prefetch_depth
            hidden.add(key, efficiency * min(t * (1 - 1.0 / n_layers), window))
        elif option == "oar":
            hidden.add(key, efficiency * min(t, per_layer_gemm / 3.0))
        else:
            hidden.add(key, efficiency * min(t, backward_compute * idx / max(1, len(layer_index) + 1)))
    comm = comm.floats()
    exposed = exposed_after_hiding(comm, hidden.floats(), efficiency * comp["total"])
    return comm, exposed, dict(wire), comp["total"] + sum(exposed.values())
