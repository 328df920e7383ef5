"""The twin's 3D march and light pass of an arithmetic tape on its march cells (``runtime.cells``).

Owns ``march_pruned`` (``CpuWalker.march`` bit for bit, every evaluation on a pruned cell tape),
``light_pruned`` (the light pass likewise), the cells they keep per tape content and march box
(``march_cell_tapes``, ``cells_shorten``, ``CELLS_PAY_SHARE``) and the wavefront: the rays
advance together, a step at a time, by the twin's rules (``_trace``, ``_slab``: ``ray_slabs``,
``_gradients``), each step's points bucketed by cell. Scene fields (``pruner.FIELD_OPS``) are
marched too, their materials at the hits taken from the full tape.
"""
from __future__ import annotations

import numpy as np

from . import twin
from .cells import CellTapes
from .jit_cache import njit
from .opcodes import Op
from .pruner import is_arithmetic
from .shading import RenderSettings
from .tape import Tape, TaperayError, content_key
from .twin import section_words, settings_value
from .twin_march import TETRA, hit_threshold
from .twin_ops import JIT_OPTIONS as _JIT

__all__ = ["march_pruned", "light_pruned", "march_cell_tapes", "cells_shorten", "ray_slabs", "CELLS_PAY_SHARE",
           "CELL_CACHE"]

# CpuWalker.render's "auto" marches on cells only where their tapes are at most this share of the
# whole tape (cells_shorten): the wavefront's per-step bucketing must be paid for. The level-7
# Menger sponge's cells keep 0.68 of its records, and its frames ran 20 % slower on them (twin,
# 2 cores, 320x180, 122-126 against 103-104 ms); 100 lowered primitives keep 0.11, Prospero 0.05.
CELLS_PAY_SHARE = 0.5
CELL_CACHE: dict[tuple, CellTapes] = {}   # march_pruned: the last (tape content, box, grid, levels)'s cells


def march_cell_tapes(tape: Tape, packed: np.ndarray, grid: int, levels: int) -> CellTapes:
    """march_pruned's cells of ``tape`` over the march box of ``packed`` (kept per tape content,
    box, grid and levels)."""
    box = np.asarray(settings_value(packed, "box_lo", "box_hi"), np.float32).reshape(2, 3)
    key = (content_key(tape), box.tobytes(), grid, levels)
    if key not in CELL_CACHE:
        CELL_CACHE.clear()          # (one: the cells of a big tape take up to CELL_TAPES_MAX_BYTES)
        CELL_CACHE[key] = CellTapes(tape, box[0], box[1], grid, levels)
    return CELL_CACHE[key]


def cells_shorten(tape: Tape, packed: np.ndarray, grid: int = 4, levels: int = 2) -> float:
    """The mean length of march_pruned's finest cell tapes (the grid's, not the outside cell's)
    over the length of ``tape``: what a step on cells runs, as a share of the whole tape. The
    cells are built (and kept) to find out; CellsTooLarge past their memory cap."""
    cells = march_cell_tapes(tape, packed, grid, levels)
    return float(np.mean((cells.end - cells.first)[:-1])) / max(len(tape.instrs), 1)


def _pruned_field(tape: Tape, packed: np.ndarray, grid: int, levels: int):
    """The field of ``tape`` (arithmetic, scene fields allowed) on march_pruned's cells over the
    march box of ``packed`` (kept per tape content and box), capped by the section half-space as
    the twin's _field: a function of (N, 3) float32 points."""
    sec = section_words(packed)
    cells = march_cell_tapes(tape, packed, grid, levels)

    def field(p):
        d = cells.evaluate(p)
        if sec[0] != 0:
            pv = p[:, 0] * sec[1] + p[:, 1] * sec[2] + p[:, 2] * sec[3] - sec[4]
            d = np.where(pv > d, pv, d)
        return d
    return field


def ray_slabs(ro: np.ndarray, rd: np.ndarray, box: np.ndarray):
    """The twin's _slab for every ray (N, 3) at once: entry max(t0, 0) and exit t1 (inf, -inf
    where a ray parallel to a slab lies outside it)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t0 = np.full(len(rd), -np.inf, np.float32)
        t1 = np.full(len(rd), np.inf, np.float32)
        miss = np.zeros(len(rd), bool)
        for r in range(3):
            flat = rd[:, r] == 0
            miss |= flat & ((ro[:, r] < box[0, r]) | (ro[:, r] > box[1, r]))
            ta = (box[0, r] - ro[:, r]) / rd[:, r]
            tb = (box[1, r] - ro[:, r]) / rd[:, r]
            t0 = np.where(flat, t0, np.maximum(t0, np.minimum(ta, tb)))
            t1 = np.where(flat, t1, np.minimum(t1, np.maximum(ta, tb)))
        return (np.where(miss, np.float32(np.inf), np.maximum(t0, np.float32(0))),
                np.where(miss, np.float32(-np.inf), t1))


@njit(**_JIT)
def _wavefront_points(ro, rd, t, live, out):
    """out[q] = ro + t rd of ray live[q] (ro: one row for every ray, or a row per ray)."""
    one_origin = ro.shape[0] == 1
    for q in range(live.size):
        i = live[q]
        o = 0 if one_origin else i
        for r in range(3):
            out[q, r] = ro[o, r] + t[i] * rd[i, r]


@njit(**_JIT)
def _wavefront_advance(live, d, rays, rule, out_live):
    """One step of the rays ``live`` with their field values d, by _trace's rules (``rule``: eps,
    cone, max_steps, step_scale, soft_k), each ray's state in ``rays`` (t, tfar, steps, hit, res);
    the rays still marching into out_live, in order; returns how many."""
    t, tfar, steps, hit, res = rays
    eps, cone, max_steps, step_scale, soft_k = rule
    m = 0
    for q in range(live.size):
        i = live[q]
        steps[i] += 1
        dq = d[q]
        if dq < hit_threshold(eps, cone, t[i]):
            hit[i] = True
            res[i] = 0
            continue
        if soft_k > 0:
            tg = t[i]
            pen = soft_k * dq / tg if tg > 0 else res[i]
            if pen < res[i]:
                res[i] = pen
        t[i] += dq * step_scale
        if t[i] <= tfar[i] and steps[i] < max_steps:
            out_live[m] = i
            m += 1
    return m


def _wavefront(field, ro, rd, t, tfar, eps, max_steps: int, step_scale, soft_k, cells: CellTapes | None = None,
               cone=0.0):
    """The twin's _trace for every ray at once, a step at a time (``cone``: _trace's): ``t`` advanced in place;
    returns steps, hit and the soft-shadow penumbra res (iq's min(1, k f / t) where soft_k > 0).
    ``ro`` is (3,) or (N, 3). The steps' bookkeeping is Numba (_wavefront_points / _advance).
    With ``cells`` (empty-space skipping, RenderSettings.cell_skip; hard shadows and primary rays
    only), a step whose point lies in a cell proven empty moves on to CellTapes.skip_to without
    a field value, and counts as a step, as the GPU's march on cells does (kernels_render.wgsl
    skip_step)."""
    steps = np.zeros(len(rd), np.int32)
    hit = np.zeros(len(rd), bool)
    res = np.ones(len(rd), np.float32)
    origins = np.asarray(ro, np.float32).reshape(-1, 3)
    live = np.flatnonzero(t <= tfar)
    spare = np.empty_like(live)
    pts = np.empty((live.size, 3), np.float32)
    rule = (np.float32(eps), np.float32(cone), max_steps, np.float32(step_scale), np.float32(soft_k))
    while live.size:
        step_pts = pts[:live.size]
        _wavefront_points(origins, rd, t, live, step_pts)
        jumped = live[:0]
        if cells is not None:
            to = cells.skip_to(origins, rd, t, live, step_pts, eps, step_scale, cone)
            jump = to >= 0
            if jump.any():
                j = live[jump]
                steps[j] += 1
                t[j] = to[jump]
                jumped = j[(t[j] <= tfar[j]) & (steps[j] < max_steps)]
                live, step_pts = live[~jump], step_pts[~jump]
        d = field(step_pts)
        m = _wavefront_advance(live, d, (t, tfar, steps, hit, res), rule, spare)
        if jumped.size:
            live, spare = np.sort(np.concatenate([spare[:m], jumped])), np.empty_like(spare)
        else:
            live, spare = spare[:m], live
    return steps, hit, res


def march_pruned(tape: Tape, camera, width: int, height: int, settings=None, view: str = "shade",
                 grid: int = 4, levels: int = 2) -> dict:
    """CpuWalker.march of an arithmetic tape, bit for bit, with every evaluation on a pruned tape:
    the march box is cut into grid^3 cells, each interval-evaluated and pruned once (kept: 24
    bytes per record and cell, and kept for the next call on the same tape content and box), with
    ``levels`` 2 each cell's 4 x 4 x 4 sub-cells again from the cell's tape, and each step's
    points are bucketed by finest cell and run on its tape (points outside the box on the whole
    tape).
    The rays advance together, a step at a time (a wavefront), by the twin's rules (_trace,
    _slab, _gradients: the same float32 operations in the same order). Scene fields (FIELD_OPS)
    are pruned too, their materials at the hits taken from the full tape. Other tapes:
    CpuWalker.march."""
    if not is_arithmetic(tape, fields=True):
        return twin.march(tape, camera, width, height, settings or RenderSettings(), view)
    if grid < 1 or levels not in (1, 2):
        raise TaperayError(f"march_pruned: grid {grid} must be at least 1 and levels {levels} 1 or 2")
    settings = settings or RenderSettings()
    packed = settings.pack(tape, view)
    box = np.asarray(settings_value(packed, "box_lo", "box_hi"), np.float32).reshape(2, 3)
    eps, neps, step_scale = (np.float32(settings_value(packed, k)) for k in ("hit_eps", "normal_eps", "step_scale"))
    max_steps = int(settings_value(packed, "max_steps"))
    sec = section_words(packed)
    field = _pruned_field(tape, packed, grid, levels)
    skip = march_cell_tapes(tape, packed, grid, levels) if settings_value(packed, "cell_skip") else None
    eye_out, dirs = camera.rays(width, height)
    eye = np.asarray(eye_out, np.float32)
    rd = np.ascontiguousarray(dirs, np.float32).reshape(-1, 3)
    t, tfar = ray_slabs(np.broadcast_to(eye, rd.shape), rd, box)
    steps, hit, _ = _wavefront(field, eye, rd, t, tfar, eps, max_steps, step_scale, np.float32(0), skip,
                               np.float32(settings_value(packed, "hit_cone")))
    grad = np.zeros((len(rd), 3), np.float32)
    at = np.flatnonzero(hit)
    if at.size:                                                 # the twin's _gradients
        px = eye + t[at, None] * rd[at]
        g = np.zeros((at.size, 3), np.float32)
        for k in TETRA:
            g += k * field(px + neps * k)[:, None]
        grad[at] = g / (np.float32(4) * neps)
    mat = np.zeros(len(rd), np.uint32)
    if at.size and (tape.instrs["op"] == Op.FIELD_RESULT).any():    # the twin's material at the hit
        mat[at] = twin.evaluate_field(tape, eye + t[at, None] * rd[at], sec)[1]
    shape = (height, width)
    g = grad.reshape(height, width, 3)
    norm = np.linalg.norm(g, axis=-1, keepdims=True)
    return dict(t=np.where(hit, t, np.float32(np.inf)).reshape(shape), hit=hit.reshape(shape),
                steps=steps.reshape(shape), mat=mat.reshape(shape), grad=g,
                normal=np.where(norm > 0, g / np.where(norm > 0, norm, 1), 0).astype(np.float32),
                dirs=dirs, eye=eye_out)


def light_pruned(tape: Tape, packed: np.ndarray, mr: dict, grid: int = 4, levels: int = 2) -> dict:
    """The twin's light pass (cpu._light_kernel: the key light's occlusion march from p + 4 eps n,
    5-tap ambient occlusion) of march_pruned's result ``mr``, bit for bit, every evaluation on
    march_pruned's cells (kept from the march). Returns shadow and ao (H, W) float32 (1 on
    misses)."""
    field = _pruned_field(tape, packed, grid, levels)
    box = np.asarray(settings_value(packed, "box_lo", "box_hi"), np.float32).reshape(2, 3)
    eps, step_scale, soft_k, ao_strength, ao_dist = (np.float32(settings_value(packed, k)) for k in
                                                     ("hit_eps", "step_scale", "soft_k", "ao_strength", "ao_dist"))
    key_dir = np.asarray(settings_value(packed, "key_dir"), np.float32)
    shadow_steps, shadow_mode = int(settings_value(packed, "shadow_steps")), int(settings_value(packed, "shadow_mode"))
    h, w = mr["t"].shape
    shadow = np.ones(h * w, np.float32)
    ao = np.ones(h * w, np.float32)
    th_all = mr["t"].reshape(-1)
    at = np.flatnonzero(th_all < np.inf)
    if at.size:
        th = th_all[at]
        g = mr["grad"].reshape(-1, 3)[at]
        gl = np.sqrt(g[:, 0] * g[:, 0] + g[:, 1] * g[:, 1] + g[:, 2] * g[:, 2])
        gl = np.where(gl > 0, gl, np.float32(1))
        nrm = g / gl[:, None]
        dirs = np.asarray(mr["dirs"], np.float32).reshape(-1, 3)[at]
        lift = np.float32(4) * eps
        ro = np.asarray(mr["eye"], np.float32) + th[:, None] * dirs + lift * nrm
        if shadow_mode > 0:
            rd = np.broadcast_to(key_dir, ro.shape)
            tfar = ray_slabs(ro, rd, box)[1]
            t = np.zeros(len(at), np.float32)
            hard = shadow_mode == 1                          # (0 off, 1 hard, 2 soft: shading.SHADOW_MODES)
            skip = march_cell_tapes(tape, packed, grid, levels) if hard and settings_value(packed, "cell_skip") else None
            _, hit, res = _wavefront(field, ro, rd, t, tfar, eps, shadow_steps, step_scale,
                                     soft_k if shadow_mode == 2 else np.float32(0), skip)
            one = np.where(np.float32(1) < res, np.float32(1), res)
            shadow[at] = np.where(hit, np.float32(0), np.where(np.float32(0) > one, np.float32(0), one))
        if ao_strength > 0:
            occ = np.zeros(len(at), np.float32)
            wsum, wt = np.float32(0), np.float32(1)
            for tap in range(5):
                hh = ao_dist * np.float32(tap + 1) / np.float32(5)
                wsum += wt
                d = field((ro - lift * nrm) + hh * nrm)
                gap = hh - d
                occ += wt * np.where(np.float32(0) > gap, np.float32(0), gap) / hh
                wt *= np.float32(0.5)
            v = np.float32(1) - ao_strength * occ / wsum
            ao[at] = np.where(np.float32(0) > v, np.float32(0), v)
    return dict(shadow=shadow.reshape(h, w), ao=ao.reshape(h, w))
