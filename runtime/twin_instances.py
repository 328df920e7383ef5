"""The CPU twin's instance lists (INSTANCES): the BVH walk and the compaction of a block.

Owns a point's frame in an instance (``instance_local``), the upper bound U' of the least
instance value (``instances_reach``), the walk of the BVH to the next leaf to evaluate
(``bvh_seek``, skipping by the node and child boxes, keeping the first of tied leaves), the point
of a leaf (``instance_point``), the compaction of the points still walking to the front of a block
and its undoing (``compact_instances``, ``undo_swaps``), the interpreter's INSTANCES and its
REPEAT_END (``instances_open``, ``instances_step``: inlined into it), and the BVH as the walk reads
it (``walk_nodes``). The rules are runtime.twin's docstring's (INSTANCES) and docs/ASSEMBLIES.md's.
"""
from __future__ import annotations

import numpy as np

from .jit_cache import njit
from .op_numbers import INSTANCE_REACH_POS, INSTANCE_REACH_REL
from .tape import Tape, derived
from .twin_ops import F0, FH, INF, JIT_OPTIONS as _JIT
from .twin_shapes import box_distance, capsule, rotate_conjugate

__all__ = ["COMPACT_MIN", "instance_local", "instances_reach", "node_distance", "child_distance", "ties_first",
           "bvh_seek", "instance_point", "compact_instances", "undo_swaps", "instances_open", "instances_step",
           "walk_nodes"]

_f = np.float32
COMPACT_MIN = 16                    # blocks this small run their instance lists without compacting
REACH_REL, REACH_POS = _f(INSTANCE_REACH_REL), _f(INSTANCE_REACH_POS)   # INSTANCES' U' (opcodes.py)


# The instance lists' helpers below (and box_distance, capsule) are forceinline: _run_block calls them
# per point, several a leaf, and as calls they cost an instance list of one sphere 133-138 ns a
# point against 78-84 inlined (the same bits; the cold compile the same; docs/ASSEMBLIES.md).
@njit(forceinline=True, **_JIT)
def instance_local(k, x, y, z, inst):
    """The point (x, y, z) in instance k's frame: conj(q) * (p - t) * q / s."""
    s = inst[k, 7]
    lx, ly, lz = rotate_conjugate(inst[k, 0], inst[k, 1], inst[k, 2], inst[k, 3], x - inst[k, 4], y - inst[k, 5],
                           z - inst[k, 6])
    return lx / s, ly / s, lz / s


@njit(forceinline=True, **_JIT)
def _grid_cell(v, lo, edge, count):
    """The cell of coordinate v on a grid axis, clamped into 0 .. count - 1 (NaN: 0)."""
    c = (v - lo) / edge
    if not c >= F0:
        return np.int64(0)
    if c >= count:
        return count - 1
    return min(np.int64(c), count - 1)


@njit(forceinline=True, **_JIT)
def instances_reach(prm, x, y, z, sc, params, inst):
    """INSTANCES' U' at (x, y, z, sc) (opcodes.py): the representative of the grid cell holding the
    point bounds the least instance value from above; +inf without a capsule."""
    r = params[prm + 12]
    if r < F0:
        return INF
    nx, ny, nz = np.int64(params[prm + 17]), np.int64(params[prm + 18]), np.int64(params[prm + 19])
    e = params[prm + 16]
    cx = _grid_cell(x, params[prm + 13], e, nx)
    cy = _grid_cell(y, params[prm + 14], e, ny)
    cz = _grid_cell(z, params[prm + 15], e, nz)
    k = np.int64(params[prm + 20 + (cz * ny + cy) * nx + cx])
    lx, ly, lz = instance_local(k, x, y, z, inst)
    ws = inst[k, 7] * sc
    u = max(capsule(lx, ly, lz, params[prm + 6], params[prm + 7], params[prm + 8], params[prm + 9],
                     params[prm + 10], params[prm + 11], r) * ws, F0)
    return u + REACH_REL * (u + r * ws) + REACH_POS * max(abs(x), max(abs(y), abs(z))) * sc


@njit(forceinline=True, **_JIT)
def node_distance(node, x, y, z, sc, bvhf):
    """b: the distance * sc from (x, y, z) to BVH node ``node``'s box (walk_nodes' arrays)."""
    return box_distance(x - bvhf[node, 0], y - bvhf[node, 1], z - bvhf[node, 2],
                bvhf[node, 4], bvhf[node, 5], bvhf[node, 6]) * sc


@njit(forceinline=True, **_JIT)
def child_distance(k, x, y, z, sc, prm, params, inst):
    """c: the distance * scale from instance k's local point of (x, y, z, sc) to the child's box
    (INSTANCES' params prm .. prm + 5)."""
    lx, ly, lz = instance_local(k, x, y, z, inst)
    x0, y0, z0, x1, y1, z1 = (params[prm], params[prm + 1], params[prm + 2], params[prm + 3],
                              params[prm + 4], params[prm + 5])
    return box_distance(lx - (x0 + x1) * FH, ly - (y0 + y1) * FH, lz - (z0 + z1) * FH,
                (x1 - x0) * FH, (y1 - y0) * FH, (z1 - z0) * FH) * (inst[k, 7] * sc)


@njit(forceinline=True, **_JIT)
def ties_first(v, node, acc, best):
    """v equals the running minimum acc and a leaf at or after ``node`` may precede ``best``, the
    leaf holding acc, in tree order. The walks keep the first of tied leaves in tree order, so a
    hinted walk (best the hinted leaf, run first) ends where a walk without a hint does."""
    return v == acc and node < best


@njit(forceinline=True, **_JIT)
def _walk_skips(b, node, acc, best, reach):
    """A node or leaf ``node`` of bound b cannot change the walk's answer: b > reach (U'), or b >=
    the running minimum acc (held by leaf ``best``; -1: none yet) unless it ties and may precede
    ``best`` (ties_first). NaN never skips."""
    return (b >= acc and not ties_first(b, node, acc, best)) or b > reach


@njit(forceinline=True, **_JIT)
def bvh_seek(node, end, x, y, z, sc, acc, best, reach, prm, params, bvhf, bvhi, inst, hinted):
    """Walk the BVH (walk_nodes' arrays) from ``node`` to the next leaf to evaluate; returns
    (node or end, the leaf's bound max(b, c)): nodes whose box distance b _walk_skips are
    skipped, and so are leaves whose max(b, c) does, c being the distance from their local point
    to the child's box, and the leaf ``hinted`` (already run; -1: none)."""
    while node < end:
        b = node_distance(node, x, y, z, sc, bvhf)
        if _walk_skips(b, node, acc, best, reach):
            node = np.int64(bvhi[node, 3])
        elif bvhi[node, 7] >= 0 and node != hinted:
            b = max(b, child_distance(bvhi[node, 7], x, y, z, sc, prm, params, inst))
            if _walk_skips(b, node, acc, best, reach):
                node += 1
            else:
                return node, b
        else:
            node += 1
    return end, INF


@njit(forceinline=True, **_JIT)
def instance_point(L, j, node, p, lp, lcell, bvhi, inst):
    """p = conj(q) * (p_saved - t) * q / s, scale = scale_saved * s for the leaf ``node``."""
    k = bvhi[node, 7]
    lcell[L, 0, j] = node
    lcell[L, 1, j] = k
    p[0, j], p[1, j], p[2, j] = instance_local(k, lp[L, 0, j], lp[L, 1, j], lp[L, 2, j], inst)
    p[3, j] = lp[L, 3, j] * inst[k, 7]


@njit(**_JIT)
def _swap_columns(i, k, sp, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, cdead, hint):
    """Exchange points i and k of the block: every per-point row an outermost instance list (frame
    0) reads (the registers, p, the point stack to depth sp, the frame's rows, cdead, hint)."""
    for r in range(regs.shape[0]):
        regs[r, i], regs[r, k] = regs[r, k], regs[r, i]
        mats[r, i], mats[r, k] = mats[r, k], mats[r, i]
    for r in range(4):
        p[r, i], p[r, k] = p[r, k], p[r, i]
        for s in range(sp):
            pstack[s, r, i], pstack[s, r, k] = pstack[s, r, k], pstack[s, r, i]
    for r in range(4):
        lp[0, r, i], lp[0, r, k] = lp[0, r, k], lp[0, r, i]
    lacc[0, i], lacc[0, k] = lacc[0, k], lacc[0, i]
    lmat[0, i], lmat[0, k] = lmat[0, k], lmat[0, i]
    lbound[0, i], lbound[0, k] = lbound[0, k], lbound[0, i]
    lcopy[0, i], lcopy[0, k] = lcopy[0, k], lcopy[0, i]
    for r in range(6):
        lcell[0, r, i], lcell[0, r, k] = lcell[0, r, k], lcell[0, r, i]
    cdead[i], cdead[k] = cdead[k], cdead[i]
    for r in range(2):
        hint[r, i], hint[r, k] = hint[r, k], hint[r, i]


@njit(**_JIT)
def compact_instances(n, end, nswap, sp, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell,
                       cdead, hint):
    """Move the points of the outermost instance list (frame 0) that still have a leaf to run
    (lcell[0, 0] < end) to the front of the block, logging each swap in swaps from nswap; returns
    (how many are in front, nswap). The body then runs for those only."""
    i, k = np.int64(0), n - 1
    while True:
        while i < k and lcell[0, 0, i] < end:
            i += 1
        while i < k and lcell[0, 0, k] >= end:
            k -= 1
        if i >= k:
            break
        _swap_columns(i, k, sp, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, cdead, hint)
        swaps[0, nswap], swaps[1, nswap] = i, k
        nswap += 1
    m = np.int64(0)
    while m < n and lcell[0, 0, m] < end:
        m += 1
    return m, nswap


@njit(**_JIT)
def undo_swaps(nswap, sp, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, cdead, hint):
    """Put the points of a compacted block back in their places (the swaps in reverse)."""
    for q in range(nswap - 1, -1, -1):
        _swap_columns(swaps[0, q], swaps[1, q], sp, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy,
                      lcell, cdead, hint)


@njit(inline="always", **_JIT)
def instances_open(pc, L, prm, aux, a, n, params, p, lp, lbound, lcopy, lcell, lint, cdead, hint, bvhf, bvhi,
                   inst):
    """INSTANCES at record pc opens frame L: each live point's U', its hinted leaf (run first
    where its bound is within U') or the first leaf its walk reaches, and p set for that leaf.
    Returns how many points have a leaf to run (0: the list's value is +inf everywhere)."""
    first, end = np.int64(aux), np.int64(aux) + np.int64(a)
    lint[L, 5], lint[L, 6], lint[L, 7] = first, end, n
    lint[L, 2] = 0
    active = 0
    for j in range(n):
        for r in range(4):
            lp[L, r, j] = p[r, j]
        # lcell rows: 0 the leaf running, 1 its instance, 2 the hinted leaf (run
        # first, skipped by the walk; -1 none), 4 the leaf holding the minimum
        lcell[L, 2, j], lcell[L, 4, j] = -1, -1
        if cdead[j] > 0:         # (its value is thrown away at a cull's target)
            node, bb = end, INF
        else:
            x, y, z, sc = p[0, j], p[1, j], p[2, j], p[3, j]
            lcopy[L, j] = instances_reach(prm, x, y, z, sc, params, inst)
            node, bb = end, INF
            h = hint[1, j] - 1
            if hint[0, j] == pc + 1 and first <= h < end and bvhi[h, 7] >= 0:
                bb = max(node_distance(h, x, y, z, sc, bvhf),
                         child_distance(bvhi[h, 7], x, y, z, sc, prm, params, inst))
                if bb <= lcopy[L, j]:         # the hinted leaf first
                    node = h
                    lcell[L, 2, j] = h
            if node == end:
                node, bb = bvh_seek(first, end, x, y, z, sc, INF, np.int64(-1), lcopy[L, j], prm, params,
                                     bvhf, bvhi, inst, np.int64(-1))
        lcell[L, 0, j] = node
        lcell[L, 1, j] = 0
        lbound[L, j] = bb
        if node < end:
            active += 1
            instance_point(L, j, node, p, lp, lcell, bvhi, inst)
    return active


@njit(inline="always", **_JIT)
def instances_step(L, a, n, csp, sp, nswap, params, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, lint, regs,
                   mats, cdead, hint, swaps, bvhf, bvhi, inst, compact_fn, undo_fn):
    """REPEAT_END of instance list L: the leaf just run (register a) counts as max(body, its
    bound) into each point's minimum (the first of tied leaves kept), each point walks on to its
    next leaf (or keeps its hint for the next walk of the same ray), and an outermost list
    compacts the points still walking to the front of the block, or, when none is left, undoes
    the swaps. Returns (a leaf is left, the block's points now run, the swaps logged).
    compact_fn / undo_fn: compact_instances / undo_swaps as function values (runtime.twin's
    _block_helpers)."""
    end = lint[L, 6]
    active = 0
    for j in range(n):
        node = lcell[L, 0, j]
        if node >= end:
            continue
        v = max(regs[a, j], lbound[L, j])
        if v < lacc[L, j] or ties_first(v, node, lacc[L, j], lcell[L, 4, j]):
            lacc[L, j] = v
            lmat[L, j] = mats[a, j]
            lcell[L, 4, j] = node
        if node == lcell[L, 2, j]:    # the hinted leaf ran: now the walk from the root
            node = lint[L, 5] - 1
        node, bb = bvh_seek(node + 1, end, lp[L, 0, j], lp[L, 1, j], lp[L, 2, j],
                             lp[L, 3, j], lacc[L, j], lcell[L, 4, j], lcopy[L, j], lint[L, 4], params,
                             bvhf, bvhi, inst, lcell[L, 2, j])
        lcell[L, 0, j] = node
        lbound[L, j] = bb
        if node < end:
            active += 1
            instance_point(L, j, node, p, lp, lcell, bvhi, inst)
        else:
            for r in range(4):
                p[r, j] = lp[L, r, j]
            if lcell[L, 4, j] >= 0:   # the next walk of this point runs it first
                hint[0, j] = lint[L, 0] + 1
                hint[1, j] = lcell[L, 4, j] + 1
    again = active > 0
    if again and L == 0 and csp == 0 and 2 * active <= n and n >= COMPACT_MIN:
        n, nswap = compact_fn(n, end, nswap, sp, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy,
                              lcell, cdead, hint)
    elif not again and L == 0:      # the whole block again, in its own order
        undo_fn(nswap, sp, swaps, regs, mats, p, pstack, lp, lacc, lmat, lbound, lcopy, lcell, cdead, hint)
        nswap = np.int64(0)
        n = lint[L, 7]
    return again, n, nswap


def walk_nodes(tape: Tape) -> tuple[np.ndarray, np.ndarray]:
    """The tape's BVH as bvh_seek walks it: f32 / i32 views of one (N, 8) array, each node's box
    centre (lo + hi) / 2 at columns 0-2 and half size (hi - lo) / 2 at 4-6, its skip and instance
    words at 3 and 7 as in the tape. The centres and half sizes are the float32 operations the
    walk used to do at every node it visited (the GPU's, bit for bit). Kept on the tape while it
    holds the same frozen BVH array (a copy of it: 64 MB for 2,000,000 nodes), as content_key is."""
    def make():
        nodes = np.ascontiguousarray(tape.bvh).view(np.float32).reshape(-1, 8)
        walk = nodes.copy()
        lo, hi = nodes[:, 0:3], nodes[:, 4:7]
        with np.errstate(over="ignore", invalid="ignore"):    # (inf / NaN where the walk made them)
            walk[:, 0:3] = (lo + hi) * FH
            walk[:, 4:7] = (hi - lo) * FH
        walk.flags.writeable = False
        return walk, walk.view(np.int32)
    return derived(tape, "walk_nodes", tape.bvh, make)
