"""Irregular assemblies: instance lists (one body, an array of rigid + uniform-scale placements)
and the vectorised BVH over them that the INSTANCES op walks.

Everything here is numpy over whole arrays: 10^5 or 10^6 instances cost no Python loop.
"""
from __future__ import annotations

import numpy as np

from taperay.runtime.tape import BVH_DTYPE, INSTANCE_DTYPE, TaperayError, quat_matrices

__all__ = ["placements", "instance_boxes", "build_bvh", "quat_matrices"]


def placements(translations, rotations=None, scales=None) -> np.ndarray:
    """An INSTANCE_DTYPE array from (N,3) translations, optional (N,4) unit quaternions (w,x,y,z)
    and optional (N,) uniform scales."""
    t = np.asarray(translations, np.float64)
    if t.ndim != 2 or t.shape[1] != 3 or len(t) == 0:
        raise TaperayError(f"instance translations must be an (N,3) array with N >= 1, got shape {t.shape}")
    n = len(t)
    q = np.tile([1.0, 0, 0, 0], (n, 1)) if rotations is None else np.asarray(rotations, np.float64)
    s = np.ones(n) if scales is None else np.broadcast_to(np.asarray(scales, np.float64), (n,))
    if q.shape != (n, 4):
        raise TaperayError(f"instance rotations must be an ({n},4) quaternion array, got shape {q.shape}")
    norms = np.linalg.norm(q, axis=1)
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(q)) and np.all(np.isfinite(s))):
        raise TaperayError("instance placements hold a non-finite number")
    if np.any(np.abs(norms - 1) > 1e-4):
        raise TaperayError(f"instance rotation {int(np.argmax(np.abs(norms - 1)))} is not a unit quaternion")
    if np.any(s <= 0):
        raise TaperayError(f"instance scale {int(np.argmax(s <= 0))} is not > 0")
    out = np.zeros(n, INSTANCE_DTYPE)
    out["q"], out["t"], out["s"] = q / norms[:, None], t, s
    return out


def instance_boxes(child_box: np.ndarray, inst: np.ndarray) -> np.ndarray:
    """(N, 2, 3) world boxes of every placed copy of a child with local box ``child_box``: the
    rotated box's exact axis-aligned box, centre t + s R c and half extents s |R| h."""
    b = np.asarray(child_box, np.float64)
    c, h = (b[0] + b[1]) / 2, (b[1] - b[0]) / 2
    rot = quat_matrices(inst["q"].astype(np.float64))
    s = inst["s"].astype(np.float64)[:, None]
    centre = inst["t"].astype(np.float64) + s * (rot @ c)
    half = s * (np.abs(rot) @ h)
    return np.stack([centre - half, centre + half], axis=1)


def _morton(centres: np.ndarray) -> np.ndarray:
    lo, hi = centres.min(0), centres.max(0)
    q = ((centres - lo) / np.maximum(hi - lo, 1e-30) * 1023).astype(np.uint64)
    code = np.zeros(len(centres), np.uint64)
    for bit in range(10):
        for axis in range(3):
            code |= ((q[:, axis] >> np.uint64(bit)) & np.uint64(1)) << np.uint64(3 * bit + axis)
    return code


def _binary_bvh(boxes: np.ndarray, instance_ids: np.ndarray, first_node: int) -> np.ndarray:
    """A binary BVH over (L,2,3) boxes in depth-first preorder (2L-1 nodes); leaf k names
    ``instance_ids[k]``. Leaves are sorted by the Morton code of their box centres; node ranges
    split at the middle, so a subtree over L leaves holds 2L-1 nodes and its preorder position is
    computed per level with numpy."""
    n = len(boxes)
    order = np.argsort(_morton(boxes.mean(1)), kind="stable")
    sorted_boxes = boxes[order]
    out = np.zeros(2 * n - 1, BVH_DTYPE)
    inner_levels = []   # per level: (node, left child, right child) preorder indices
    lo, hi, pre = np.array([0]), np.array([n]), np.array([0])
    while lo.size:
        size = hi - lo
        out["skip"][pre] = pre + 2 * size - 1 + first_node
        leaf = size == 1
        out["instance"][pre[leaf]] = instance_ids[order[lo[leaf]]]
        out["instance"][pre[~leaf]] = -1
        out["lo"][pre[leaf]] = sorted_boxes[lo[leaf], 0]
        out["hi"][pre[leaf]] = sorted_boxes[lo[leaf], 1]
        lo, hi, pre = lo[~leaf], hi[~leaf], pre[~leaf]
        mid = (lo + hi) // 2
        left, right = pre + 1, pre + 2 * (mid - lo)
        inner_levels.append((pre, left, right))
        lo, hi, pre = np.concatenate([lo, mid]), np.concatenate([mid, hi]), np.concatenate([left, right])
    for pre, left, right in reversed(inner_levels):   # boxes bottom-up
        out["lo"][pre] = np.minimum(out["lo"][left], out["lo"][right])
        out["hi"][pre] = np.maximum(out["hi"][left], out["hi"][right])
    return out


def sample_levels(centres: np.ndarray) -> list[np.ndarray]:
    """Instances in groups of ever denser spatial samples: group j holds one not yet taken
    instance per cell of a grid of cubes 2^-j of the largest extent (j = 1, 2, ...), while a
    level takes fewer than half of those left; the last group holds the rest."""
    n = len(centres)
    lo = centres.min(0)
    extent = max(float((centres.max(0) - lo).max()), 1e-30)
    free = np.ones(n, bool)
    groups = []
    for level in range(1, 21):
        left = np.flatnonzero(free)
        cells = np.minimum(((centres[left] - lo) / extent * (1 << level)).astype(np.int64), (1 << level) - 1)
        key = (cells[:, 0] << 42) | (cells[:, 1] << 21) | cells[:, 2]
        picks = left[np.unique(key, return_index=True)[1]]
        if 2 * len(picks) > len(left):
            break
        groups.append(picks)
        free[picks] = False
    rest = np.flatnonzero(free)
    return groups + ([rest] if len(rest) else [])


def build_bvh(boxes: np.ndarray, first_node: int = 0, first_instance: int = 0) -> np.ndarray:
    """A binary BVH over (N,2,3) boxes in depth-first preorder with skip indices (BVH_DTYPE,
    2N-1 nodes).

    The INSTANCES walk visits children in preorder with a running minimum that starts at +inf,
    so what it meets first decides how much it can skip. The tree is therefore a chain over the
    ``sample_levels`` groups, coarsest first: each chain node's left child is the binary subtree
    of one group, its right child the chain of the denser groups. A point meets an instance near
    it within a few dozen nodes, and that distance then culls most of each denser group. (A plain
    Morton-ordered tree makes the walk sweep space in Z order from a far corner: on 100,000
    random bolts it evaluated about 10x the leaves.) Any tree is exact; this one is faster.
    ``first_node`` / ``first_instance`` offset the indices into the tape's arrays.
    """
    n = len(boxes)
    ids = np.arange(n) + first_instance
    groups = sample_levels(boxes.mean(1)) if n > 8 else [np.arange(n)]
    # the box of groups k, k+1, ... (what chain node k holds)
    lo = np.minimum.accumulate(np.array([boxes[g, 0].min(0) for g in groups])[::-1])[::-1]
    hi = np.maximum.accumulate(np.array([boxes[g, 1].max(0) for g in groups])[::-1])[::-1]
    parts, at = [], first_node
    for k, g in enumerate(groups):
        if k < len(groups) - 1:                  # chain node over this group and all denser ones
            link = np.zeros(1, BVH_DTYPE)
            link["lo"], link["hi"], link["instance"] = lo[k], hi[k], -1
            link["skip"] = first_node + 2 * n - 1
            parts.append(link)
            at += 1
        parts.append(_binary_bvh(boxes[g], ids[g], at))
        at += len(parts[-1])
    return np.concatenate(parts)
