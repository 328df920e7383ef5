"""The CPU twin's march and light: sphere tracing, normals, shadows and ambient occlusion.

Owns the sphere trace of a block of rays (``trace_rays``: hit threshold, soft shadow, a side per
ray for rays inside a glass; the path tracer's march is this one), the ray's slab through the
march box (``slab``), the tetrahedron gradient (``gradients``), the 16 x 16 pixel tiles and their
scratch (``tile_count``, ``tile_setup``), and the march and light kernels (``march_kernel``,
``light_kernel``: one thread's tiles each) that runtime.twin's ``march`` and ``light_pass`` run.
"""
from __future__ import annotations

import numpy as np

from .jit_cache import njit
from .twin_field import BLOCK, WS_HINT, WS_OUT_D, WS_OUT_M, WS_PIN, field_block, workspace
from .twin_ops import F0, F1, F4, FH, INF, JIT_OPTIONS as _JIT, len3

_f = np.float32
__all__ = ["hit_threshold", "trace_rays", "slab", "TETRA", "gradients", "tile_count", "tile_setup", "march_kernel",
           "light_kernel"]


@njit(**_JIT)
def hit_threshold(eps, cone, t):
    """A march's hit threshold at t: eps, or with a hit cone (RenderSettings.hit_cone, cone > 0)
    max(eps, cone t) (kernels_render.wgsl trace_step, packed.wgsl cell_find)."""
    return max(eps, cone * t) if cone > 0 else eps


@njit(inline="always", **_JIT)
def trace_rays(tp, sec, ws, ws1, n, rays, rule, out):
    """Sphere-trace n rays, rays = (ro, rd, side, t, tfar) (3, n), (3, n), (n,) ...: each from t
    to tfar, by rule = (eps, cone, max_steps, step_scale, soft_k), into out = (steps, hit, mat, res,
    idx, rhint) (idx: scratch). Each ray marches through side f (side[i] +1, or -1 for a ray inside a
    glass: the path tracer's, which traces the negated field): hit when side f < eps, or with
    cone > 0 when side f < max(eps, cone t) (RenderSettings.hit_cone); t is left at the hit.
    soft_k > 0 also tracks the penumbra res = min(1, k * f / t) (iq's soft shadow). rhint (2, n):
    each ray's INSTANCES walk hint (workspace), carried from step to step, read at the start and
    left as the last step's. The twin's march and light kernels and the path kernel all trace
    with it (kernels_render.wgsl trace_step)."""
    ro, rd, side, t, tfar = rays
    eps, cone, max_steps, step_scale, soft_k = rule
    steps, hit, mat, res, idx, rhint = out
    pin, out_d, out_m, hint = ws[WS_PIN], ws[WS_OUT_D], ws[WS_OUT_M], ws[WS_HINT]
    na = np.int64(0)
    for i in range(n):
        steps[i] = 0
        hit[i] = False
        mat[i] = 0
        res[i] = F1
        if t[i] <= tfar[i]:
            idx[na] = i
            na += 1
    while na > 0:
        for q in range(na):
            i = idx[q]
            for r in range(3):
                pin[r, q] = ro[r, i] + t[i] * rd[r, i]
            hint[0, q], hint[1, q] = rhint[0, i], rhint[1, i]
        field_block(tp, na, ws, ws1, sec)
        m = np.int64(0)
        for q in range(na):
            i = idx[q]
            rhint[0, i], rhint[1, i] = hint[0, q], hint[1, q]
            d = side[i] * out_d[q]
            steps[i] += 1
            if d < hit_threshold(eps, cone, t[i]):
                hit[i] = True
                mat[i] = out_m[q]
                res[i] = F0
                continue
            if soft_k > F0 and t[i] > F0:
                res[i] = min(res[i], soft_k * d / t[i])
            t[i] += d * step_scale
            if not t[i] <= tfar[i] or steps[i] >= max_steps:
                continue
            idx[m] = i
            m += 1
        na = m


@njit(**_JIT)
def slab(o, d, box):
    """Entry and exit t of the ray o + t d through the box (t0 > t1: no intersection)."""
    t0, t1 = -INF, INF
    for r in range(3):
        if d[r] == F0:
            if o[r] < box[0, r] or o[r] > box[1, r]:
                return INF, -INF
            continue
        ta = (box[0, r] - o[r]) / d[r]
        tb = (box[1, r] - o[r]) / d[r]
        t0 = max(t0, min(ta, tb))
        t1 = min(t1, max(ta, tb))
    return max(t0, F0), t1


TETRA = np.array([[1, -1, -1], [-1, -1, 1], [-1, 1, -1], [1, 1, 1]], np.float32)


@njit(inline="always", **_JIT)
def gradients(tp, sec, ws, ws1, n, px, neps, grad):
    """grad[:, i] = sum_k k f(px_i + neps k) / (4 neps) over the tetrahedron taps k."""
    pin, out_d = ws[WS_PIN], ws[WS_OUT_D]
    for i in range(n):
        grad[0, i], grad[1, i], grad[2, i] = F0, F0, F0
    for tap in range(4):
        for i in range(n):
            for r in range(3):
                pin[r, i] = px[r, i] + neps * TETRA[tap, r]
        field_block(tp, n, ws, ws1, sec)
        for i in range(n):
            for r in range(3):
                grad[r, i] += TETRA[tap, r] * out_d[i]
    for i in range(n):
        for r in range(3):
            grad[r, i] /= F4 * neps


_TW, _TH = 16, BLOCK // 16    # the march / light kernels' pixel tiles (BLOCK pixels each)


@njit(**_JIT)
def tile_count(dirs):
    """Tiles of _TW x _TH pixels covering the (H, W, 3) ray directions."""
    return ((dirs.shape[1] + _TW - 1) // _TW) * ((dirs.shape[0] + _TH - 1) // _TH)


@njit(inline="always", **_JIT)
def tile_setup(tile, dirs, n_regs, n_save):
    """Tile ``tile`` (row-major) of the march / light kernels: its pixel rows r0:r1 and columns
    c0:c1 and its scratch: (r0, r1, c0, c1, ws, ws1, ro, rd, v3, t, tfar, steps, hit, mat, res,
    idx, pix, rhint), ws / ws1 the workspaces of field_block, the rest per ray (ro, rd, v3: (3,
    BLOCK); pix: (2, BLOCK) row, col; rhint: (2, BLOCK) the rays' walk hints, none yet)."""
    H, W = dirs.shape[0], dirs.shape[1]
    ntx = (W + _TW - 1) // _TW
    r0, c0 = (tile // ntx) * _TH, (tile % ntx) * _TW
    return (r0, min(r0 + _TH, H), c0, min(c0 + _TW, W),
            workspace(n_regs, np.int64(BLOCK), n_save), workspace(n_regs, np.int64(1), np.int64(0)),
            np.empty((3, BLOCK), np.float32), np.empty((3, BLOCK), np.float32),
            np.empty((3, BLOCK), np.float32), np.empty(BLOCK, np.float32), np.empty(BLOCK, np.float32),
            np.empty(BLOCK, np.int32), np.empty(BLOCK, np.bool_), np.empty(BLOCK, np.uint32),
            np.empty(BLOCK, np.float32), np.empty(BLOCK, np.int64), np.empty((2, BLOCK), np.int64),
            np.zeros((2, BLOCK), np.int64))


@njit(nogil=True, **_JIT)
def march_kernel(tp, n_regs, sec, view, rule, neps, out, thread, n_threads):
    """Thread ``thread``'s tiles (every n_threads-th, row-major) of the march: view = (eye, dirs
    (H, W, 3), box (2, 3)), rule = trace_rays' (eps, cone, max_steps, step_scale, 0), neps the
    gradient's tap distance, out = (t, hit, steps, mat, grad, normal), each (H, W) or (H, W, 3)."""
    eye, dirs, box = view
    out_t, out_hit, out_steps, out_mat, out_grad, out_normal = out
    n_save = tp[7]
    side = np.ones(BLOCK, np.float32)      # (every ray outside: trace_rays' side)
    for tile in range(thread, tile_count(dirs), n_threads):
        r0, r1, c0, c1, ws, ws1, ro, rd, grad, t, tfar, steps, hit, mat, res, idx, pix, rhint = \
            tile_setup(tile, dirs, n_regs, n_save)
        n = np.int64(0)
        for row in range(r0, r1):
            for col in range(c0, c1):
                d = dirs[row, col]
                t0, t1 = slab(eye, d, box)
                for r in range(3):
                    ro[r, n] = eye[r]
                    rd[r, n] = d[r]
                t[n], tfar[n] = t0, t1
                pix[0, n], pix[1, n] = row, col
                n += 1
        trace_rays(tp, sec, ws, ws1, n, (ro, rd, side, t, tfar), rule, (steps, hit, mat, res, idx, rhint))
        m = np.int64(0)
        for i in range(n):
            row, col = pix[0, i], pix[1, i]
            out_hit[row, col] = hit[i]
            out_t[row, col] = t[i] if hit[i] else INF
            out_steps[row, col] = steps[i]
            out_mat[row, col] = mat[i]
            for r in range(3):
                out_grad[row, col, r] = F0
                out_normal[row, col, r] = F0
            if hit[i]:
                idx[m] = i
                for r in range(3):
                    ro[r, m] = eye[r] + t[i] * rd[r, i]
                m += 1
        hint = ws[WS_HINT]      # (the hit's material is the trace's: the instance lists' walks keep
        for q in range(m):      # the first of tied leaves, hinted or not, as the GPU's surface pass)
            hint[0, q], hint[1, q] = rhint[0, idx[q]], rhint[1, idx[q]]     # (the gradient taps keep it)
        gradients(tp, sec, ws, ws1, m, ro, neps, grad)
        for q in range(m):
            i = idx[q]
            gl = np.sqrt(grad[0, q] * grad[0, q] + grad[1, q] * grad[1, q] + grad[2, q] * grad[2, q])
            for r in range(3):
                out_grad[pix[0, i], pix[1, i], r] = grad[r, q]
                if gl > F0:                      # (no gradient: normal 0)
                    out_normal[pix[0, i], pix[1, i], r] = grad[r, q] / gl


@njit(nogil=True, **_JIT)
def light_kernel(tp, n_regs, sec, view, rule, light, hits, out, thread, n_threads):
    """Key-light visibility (occlusion march from p + 4 eps n) and 5-tap ambient occlusion, on
    thread ``thread``'s tiles (every n_threads-th, row-major): view = (eye, dirs, box) as
    march_kernel's, rule = the shadow rays' trace_rays rule (eps, 0, shadow_steps, step_scale,
    soft_k or 0), light = (shadow_mode, key_dir, ao_strength, ao_dist), hits = the march's (t,
    grad), out = (shadow, ao) (H, W)."""
    eye, dirs, box = view
    eps = rule[0]
    shadow_mode, key_dir, ao_strength, ao_dist = light
    in_t, in_grad = hits
    out_shadow, out_ao = out
    n_save = tp[7]
    side = np.ones(BLOCK, np.float32)
    for tile in range(thread, tile_count(dirs), n_threads):
        r0, r1, c0, c1, ws, ws1, ro, rd, nrm, t, tfar, steps, hit, mat, res, idx, pix, rhint = \
            tile_setup(tile, dirs, n_regs, n_save)
        occ = np.zeros(BLOCK, np.float32)
        n = np.int64(0)
        for row in range(r0, r1):
            for col in range(c0, c1):
                out_shadow[row, col] = F1
                out_ao[row, col] = F1
                th = in_t[row, col]
                if not th < INF:
                    continue
                g = in_grad[row, col]
                gl = len3(g[0], g[1], g[2])
                if not gl > F0:
                    gl = F1
                for r in range(3):
                    nrm[r, n] = g[r] / gl
                    ro[r, n] = eye[r] + th * dirs[row, col, r] + F4 * eps * nrm[r, n]
                    rd[r, n] = key_dir[r]
                pix[0, n], pix[1, n] = row, col
                n += 1
        if n == 0:
            continue
        if shadow_mode > 0:
            o = np.empty(3, np.float32)
            for i in range(n):
                o[0], o[1], o[2] = ro[0, i], ro[1, i], ro[2, i]
                t[i] = F0
                tfar[i] = slab(o, key_dir, box)[1]
            trace_rays(tp, sec, ws, ws1, n, (ro, rd, side, t, tfar), rule, (steps, hit, mat, res, idx, rhint))
            for i in range(n):
                out_shadow[pix[0, i], pix[1, i]] = F0 if hit[i] else max(min(res[i], F1), F0)
        if ao_strength > F0:
            pin, out_d, hint = ws[WS_PIN], ws[WS_OUT_D], ws[WS_HINT]
            for i in range(n):
                hint[0, i] = 0               # (the taps along the normal keep their own)
            wsum = F0
            w = F1
            for tap in range(5):
                h = ao_dist * _f(tap + 1) / _f(5)
                wsum += w
                for i in range(n):
                    for r in range(3):
                        pin[r, i] = ro[r, i] - F4 * eps * nrm[r, i] + h * nrm[r, i]
                field_block(tp, n, ws, ws1, sec)
                for i in range(n):
                    occ[i] += w * max(h - out_d[i], F0) / h
                w *= FH
            for i in range(n):
                out_ao[pix[0, i], pix[1, i]] = max(F1 - ao_strength * occ[i] / wsum, F0)
