"""``taperay bench jax``: the JAX walker's forms on a ~100-record and a ~2,000-record scene.

Forms (``--forms``, default all): the trace, the generic interpreter, the generic interpreter
cell by cell ("cells": each cell of points runs only the records that can matter there), and
"default", ``JaxWalker()`` as a user gets it (each call's form chosen by the walker). Per scene
and form, at 64³ points: the first call (in this process, compiling into an empty persistent
cache) and the steady time of values, and of values plus the gradient of their sum w.r.t. every
pool entry (``JaxWalker.vjp``); for the default form also ``value_and_grad`` of 3 names (forward
sweeps per name); the first call in a new process that finds the programs in the persistent
cache; XLA compiles per 100 random parameter edits (and, for the generic and cell forms, per 100
topology edits inside the bucket). The twin's value time is the yardstick: each JAX row gives its
values + gradient time over it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from taperay.runtime.tape import TaperayError

from .bench import BenchResult, summarize, time_calls

GRID = 64            # points: a GRID³ lattice over the scene's bounds
EDITS = 100
TRACE_MAX_RECORDS = 500   # larger scenes: the trace form is not measured (its compile takes minutes)
FORMS = ("trace", "generic", "cells", "default")     # default: JaxWalker() as a user gets it
NAMES = 3                 # the default form's value_and_grad: the gradient of this many names


def scene(parts: int, seed: int = 0, variant: int | None = None):
    """A union of ``parts`` moved shapes (spheres, boxes, capsules) blended in pairs, every radius
    a named Param; ``variant`` k swaps part k's shape for a torus (a topology edit)."""
    from taperay.scenegraph import Param, box, capsule, smooth_union, sphere, torus, union
    rng = np.random.default_rng(seed)
    nodes = []
    for i in range(parts):
        r = Param(f"r{i}", float(rng.uniform(0.1, 0.25)))
        kind = i % 3
        if variant == i:
            shape = torus(r, 0.05)
        elif kind == 0:
            shape = sphere(r)
        elif kind == 1:
            shape = box(r, 0.15, 0.1)
        else:
            shape = capsule((0, 0, -0.1), (0, 0, 0.1), r)
        nodes.append(shape.translate(*rng.uniform(-2, 2, 3)))
    pairs = [smooth_union(a, b, k=0.05) for a, b in zip(nodes[0::2], nodes[1::2])]
    return union(*pairs)


def _lattice(tape) -> np.ndarray:
    lo, hi = tape.bounds
    axes = [np.linspace(lo[k], hi[k], GRID, dtype=np.float32) for k in range(3)]
    return np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)


_CHILD = """
import json, sys, time
import numpy as np
from taperay.runtime.jax_walker import JaxWalker, compile_stats
from taperay.tools.bench_jax import scene, _lattice
from taperay.scenegraph import flatten
parts, form = int(sys.argv[1]), sys.argv[2]
tape = flatten(scene(parts))
pts = _lattice(tape)
w = JaxWalker(form=form)
t0 = time.perf_counter()
w.evaluate(tape, pts)
print(json.dumps({"first_s": time.perf_counter() - t0, **compile_stats()}))
"""


def _new_process(parts: int, form: str, cache: str) -> dict:
    env = dict(os.environ, TAPERAY_JAX_CACHE=cache)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(parts), form], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _forms(spec: str | None) -> tuple[str, ...]:
    """``--forms``' list (None: every form), checked."""
    if spec is None:
        return FORMS
    forms = tuple(f.strip() for f in spec.split(",") if f.strip())
    unknown = [f for f in forms if f not in FORMS]
    if unknown or not forms:
        raise TaperayError(f"bench jax: --forms takes some of {', '.join(FORMS)}; got {spec!r}")
    return forms


def bench_jax(opts) -> BenchResult:
    forms = _forms(opts.forms)
    cache = tempfile.mkdtemp(prefix="taperay-bench-jax-")
    os.environ["TAPERAY_JAX_CACHE"] = cache        # (before the walker module sets JAX's cache up)
    from taperay.runtime.cpu import CpuWalker
    from taperay.runtime.jax_walker import JaxWalker, generic_unsupported, compile_stats
    import jax                                      # (after the walker has set XLA's flags)
    from taperay.scenegraph import flatten
    rng = np.random.default_rng(opts.seed)
    rows = []
    cpu = CpuWalker()
    for parts in (18, 340):
        tape = flatten(scene(parts, opts.seed))
        pts = _lattice(tape)
        few = pts[rng.choice(len(pts), 1000, replace=False)]
        ones = np.ones(len(pts), np.float32)
        cpu.evaluate(tape, pts)
        twin = summarize(time_calls(lambda: cpu.evaluate(tape, pts), opts.repeat))["median_ms"]
        rows.append({"records": len(tape), "params": len(tape.params), "form": "twin (cpu, values)",
                     "value steady ms": twin})
        for form in forms:
            if form in ("generic", "cells") and generic_unsupported(tape):
                continue
            if form == "trace" and len(tape) > TRACE_MAX_RECORDS:
                continue
            walker = JaxWalker() if form == "default" else JaxWalker(form=form)
            t0 = time.perf_counter()
            walker.evaluate(tape, pts)
            v_first = time.perf_counter() - t0
            v = summarize(time_calls(lambda: walker.evaluate(tape, pts), opts.repeat, warmup=0))
            t0 = time.perf_counter()
            walker.vjp(tape, pts, ones)
            g_first = time.perf_counter() - t0
            g = summarize(time_calls(lambda: walker.vjp(tape, pts, ones), opts.repeat, warmup=0))
            plan = walker.cells_plan if form in ("cells", "default") else None     # (the 64³ call's cells)
            if form == "default":      # (value_and_grad: the pool gradient and 3 names' forward sweeps)
                names3 = sorted(tape.names)[:NAMES]
                t0 = time.perf_counter()
                walker.value_and_grad(tape, pts, names=names3)
                vg_first = time.perf_counter() - t0
                vg = summarize(time_calls(lambda: walker.value_and_grad(tape, pts, names=names3), opts.repeat,
                                          warmup=0))
            walker.evaluate(tape, few)
            walker.vjp(tape, few, np.ones(len(few), np.float32))
            names = sorted(tape.names)
            before = compile_stats()["compiles"]
            edited = flatten(scene(parts, opts.seed))
            for k in rng.integers(0, len(names), EDITS):
                edited.set_param(names[k], float(rng.uniform(0.1, 0.25)))
                walker.evaluate(edited, few)
                walker.vjp(edited, few, np.ones(len(few), np.float32))
            param_compiles = compile_stats()["compiles"] - before
            row = {"records": len(tape), "params": len(tape.params), "form": form,
                   "value first s": v_first, "value steady ms": v["median_ms"],
                   "value+grad first s": g_first, "value+grad steady ms": g["median_ms"],
                   "value+grad / twin": g["median_ms"] / twin,
                   "compiles / 100 param edits": param_compiles}
            if form == "default":
                row[f"value_and_grad, {NAMES} names, first s"] = vg_first
                row[f"value_and_grad, {NAMES} names, steady ms"] = vg["median_ms"]
            if plan is not None:
                row["steps kept / steps"] = f"{plan.point_steps / plan.n_points:.0f} / {plan.n_steps}"
            if form in ("generic", "cells"):
                before = compile_stats()["compiles"]
                for k in rng.integers(0, parts, EDITS):
                    edited = flatten(scene(parts, opts.seed, variant=int(k)))
                    walker.evaluate(edited, few)
                    if form == "cells":
                        walker.vjp(edited, few, np.ones(len(few), np.float32))
                row["compiles / 100 topology edits"] = compile_stats()["compiles"] - before
            if form != "default":
                row["first call, new process s"] = _new_process(parts, form, cache)["first_s"]
            rows.append(row)
    return BenchResult(rows, settings={"repeat": opts.repeat, "seed": opts.seed, "jax backend": jax.default_backend(),
                                       "jax devices": jax.device_count()},
                       notes=[f"{GRID}³ = {GRID ** 3} points on a lattice over the scene's bounds; value+grad: "
                              "the values and the gradient of their sum w.r.t. every pool entry (JaxWalker.vjp)",
                              "first call: trace + XLA compile into an empty persistent cache, then the call; "
                              "new process: the first call of a fresh process finding the programs in that cache",
                              f"edits: {EDITS} random named-parameter edits (Tape.set_param), each evaluated and "
                              "differentiated at 1000 points; topology edits: one part's shape swapped for a torus "
                              "(a new structure, the same capacity bucket)",
                              f"the trace form is measured up to {TRACE_MAX_RECORDS} records: its XLA compile grows "
                              "with the records (docs/JAX.md)",
                              "scene: moved spheres, boxes and capsules, smooth-blended in pairs, all unioned "
                              "(flatten adds culled unions); tools/bench_jax.py scene()",
                              f"default: JaxWalker() (the cells, but a small tape's values by the trace form); its "
                              f"value_and_grad: the values, df/dx, the pool gradient and {NAMES} names' per-point "
                              "derivatives; its first calls find the programs of the forms measured before it in "
                              "this process (--forms default alone: a new user's first calls)",
                              "cells: a grid over the points' box, about 512 points a cell on a CPU, one piece of up to "
                              "262,144 points a cell on a GPU (jax_cells.layout_for); steps kept: the "
                              "generic steps a point runs on average (of the tape's); its value+grad is "
                              "JaxWalker(form='cells').vjp, and its topology edits are evaluated and differentiated"])
