// Per-tile interval pruning of arithmetic tapes for the 2D field / sign image (the design of
// runtime/pruning.py, one level of tiles). Mirrors MPR: `prune_tiles` runs one invocation per tile,
// `pruned_image` one per pixel.
//
// Uniforms (one set for both passes): n_items = tiles; width, height, rect as
// field_image; extra = (z, tile size in pixels, mode, 0), mode 1 = sign image (decided tiles are
// filled without evaluating pixels), 0 = field (every pixel evaluated with its tile's tape).
//
// out_u layout: per tile t a header out_u[2t] = index of the first record of its pruned tape,
// out_u[2t + 1] = TILE_AMBIGUOUS / TILE_INSIDE / TILE_OUTSIDE; then the tiles' regions, region t
// starting at word 2 n_tiles + 2 t n_instrs, record k at words 2k, 2k + 1 (see pack_record). The
// pruned tape of a tile fills records [start, n_instrs) of its region; before that, word 2i of
// the region holds the choice of MIN / MAX / AND / OR record i (the liveness pass reads it, then
// may overwrite it).
//
// Intervals (float32 pairs; "may be NaN" is lo = hi = NaN, as runtime/intervals.py) contain every
// value run_tape computes at the tile's pixel centres: add / sub / mul / square bounds move at
// least one ulp outward (and by TINY absolutely, which also covers flushed subnormals); div /
// recip / sqrt, whose WGSL accuracy is 2.5 ulp, move by REL_LOOSE; the transcendental ops, whose
// WGSL accuracy is looser still, by REL_WIDE + ABS_WIDE; sin / cos / tan / atan2 give their whole
// range and MOD [0, |b|]. (WGSL has no float64: bounds are looser than runtime/pruning.py's, so
// fewer ops may be decided than on the CPU twin; every decision is still exact.)
// MIN / MAX / AND / OR choices follow intervals.choice, so a decided op returns the chosen operand
// bit for bit at every pixel (nmin / nmax return a on ties): the pruned tape is exact.
// Every loop counts into run_tape's `iters` and stops at U.iter_cap (overflow, reported by the host).

const TILE_AMBIGUOUS: u32 = 0u;
const TILE_INSIDE: u32 = 1u;
const TILE_OUTSIDE: u32 = 2u;
const CH_BOTH: u32 = 0u;
const CH_A: u32 = 1u;
const CH_B: u32 = 2u;

const EPS: f32 = 1.1920928955078125e-07;        // 2^-23
const TINY: f32 = 8.077935669463161e-28;        // 2^-90: a normal float far above subnormals
const REL_LOOSE: f32 = 9.5367431640625e-07;     // 2^-20 (8 ulp)
const REL_WIDE: f32 = 0.001953125;              // 2^-9
const ABS_WIDE: f32 = 9.5367431640625e-07;      // 2^-20
const FMAX: f32 = 3.4028234663852886e+38;
const HALF_PI_UP: f32 = 1.5723;                 // > pi/2 (1 + 2^-9)
const PI_UP: f32 = 3.1447;                      // > pi (1 + 2^-9)
const TRIG_UP: f32 = 1.0009765625;              // |sin|, |cos| on the GPU: <= 1 + 2^-11

var<private> ilo: array<f32, REG_CAP>;
var<private> ihi: array<f32, REG_CAP>;
var<private> live: array<bool, REG_CAP>;   // the pruner's live registers (private: zeroed)

fn nan() -> f32 {
    return bitcast<f32>(0x7fc00000u);
}

// a float below / above x by `rel` of |x| and `abs_` (infinite bounds stay infinite, except that
// a lower bound of +inf becomes FMAX and an upper bound of -inf -FMAX, as runtime/pruning.py)
fn below(x: f32, rel: f32, abs_: f32) -> f32 {
    let r = x * (1.0 - select(rel, -rel, x < 0.0)) - abs_;
    return select(r, FMAX, r == inf());
}

fn above(x: f32, rel: f32, abs_: f32) -> f32 {
    let r = x * (1.0 + select(rel, -rel, x < 0.0)) + abs_;
    return select(r, -FMAX, r == -inf());
}

fn dn(x: f32) -> f32 {
    return below(x, EPS, TINY);
}

fn up(x: f32) -> f32 {
    return above(x, EPS, TINY);
}

struct Iv {
    lo: f32,
    hi: f32,
    ch: u32,
}

fn iv(lo: f32, hi: f32) -> Iv {
    if (is_nan(lo) || is_nan(hi)) {
        return Iv(nan(), nan(), CH_BOTH);
    }
    return Iv(lo, hi, CH_BOTH);
}

fn iv_nan() -> Iv {
    return Iv(nan(), nan(), CH_BOTH);
}

fn has0(lo: f32, hi: f32) -> bool {
    return lo <= 0.0 && hi >= 0.0;
}

fn iv_add(alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    if ((ahi == inf() && blo == -inf()) || (alo == -inf() && bhi == inf())) {
        return iv_nan();   // inf - inf inside
    }
    var lo = dn(alo + blo);
    if (alo >= 0.0 && blo >= 0.0) {
        lo = max(lo, 0.0);   // a sum of non-negatives is not below 0 (sqrt(x^2 + y^2) stays defined)
    }
    var hi = up(ahi + bhi);
    if (ahi <= 0.0 && bhi <= 0.0) {
        hi = min(hi, 0.0);
    }
    return iv(lo, hi);
}

fn iv_mul(alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    let a_inf = alo == -inf() || ahi == inf();
    let b_inf = blo == -inf() || bhi == inf();
    if ((has0(alo, ahi) && b_inf) || (has0(blo, bhi) && a_inf)) {
        return iv_nan();   // 0 * inf inside
    }
    let p0 = alo * blo;
    let p1 = alo * bhi;
    let p2 = ahi * blo;
    let p3 = ahi * bhi;
    return iv(dn(min(min(p0, p1), min(p2, p3))), up(max(max(p0, p1), max(p2, p3))));
}

fn iv_square(lo: f32, hi: f32) -> Iv {
    let l = max(max(lo, -hi), 0.0);
    let h = max(-lo, hi);
    return iv(max(dn(l * l), 0.0), up(h * h));
}

fn iv_div(alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    if (has0(blo, bhi)) {
        if (has0(alo, ahi)) {
            return iv_nan();   // 0 / 0
        }
        return iv(-inf(), inf());
    }
    if ((alo == -inf() || ahi == inf()) && (blo == -inf() || bhi == inf())) {
        return iv_nan();       // inf / inf
    }
    let q0 = alo / blo;
    let q1 = alo / bhi;
    let q2 = ahi / blo;
    let q3 = ahi / bhi;
    return iv(below(min(min(q0, q1), min(q2, q3)), REL_LOOSE, TINY),
              above(max(max(q0, q1), max(q2, q3)), REL_LOOSE, TINY));
}

// a monotone transcendental's bounds f(lo), f(hi) (increasing) moved outward by the wide margin
fn wide(lo: f32, hi: f32) -> Iv {
    return iv(below(lo, REL_WIDE, ABS_WIDE), above(hi, REL_WIDE, ABS_WIDE));
}

fn iv_unary(op: u32, lo: f32, hi: f32) -> Iv {
    if (is_nan(lo)) {
        return iv_nan();   // (WGSL's min / max of a NaN are unspecified: never reached with one)
    }
    if (op == OP_COPY) { return iv(lo, hi); }
    if (op == OP_NEG) { return iv(-hi, -lo); }
    if (op == OP_ABS) { return iv(max(max(lo, -hi), 0.0), max(-lo, hi)); }
    if (op == OP_SQUARE) { return iv_square(lo, hi); }
    if (op == OP_RECIP) {
        if (lo == 0.0 && hi == 0.0) {
            return iv_nan();
        }
        return iv_div(1.0, 1.0, lo, hi);
    }
    if (op == OP_SQRT) {
        if (lo < 0.0) {
            return iv_nan();
        }
        return iv(max(below(sqrt(lo), REL_LOOSE, TINY), 0.0), above(sqrt(hi), REL_LOOSE, TINY));
    }
    if (op == OP_FLOOR) { return iv(floor(lo), floor(hi)); }
    if (op == OP_CEIL) { return iv(ceil(lo), ceil(hi)); }
    if (op == OP_ROUND) { return iv(round_away(lo), round_away(hi)); }
    if (op == OP_NOT) {
        return iv(select(0.0, 1.0, lo == 0.0 && hi == 0.0), select(0.0, 1.0, has0(lo, hi)));
    }
    let finite = lo != -inf() && hi != inf();
    if (op == OP_SIN || op == OP_COS) {
        if (!finite) { return iv_nan(); }
        return iv(-TRIG_UP, TRIG_UP);
    }
    if (op == OP_TAN) {
        if (!finite) { return iv_nan(); }
        return iv(-inf(), inf());
    }
    if (op == OP_ATAN) {
        let w = wide(atan(lo), atan(hi));
        return iv(max(w.lo, -HALF_PI_UP), min(w.hi, HALF_PI_UP));
    }
    if (op == OP_ASIN || op == OP_ACOS) {
        if (lo < -1.0 || hi > 1.0) { return iv_nan(); }
        if (op == OP_ASIN) { return wide(asin(lo), asin(hi)); }
        return wide(acos(hi), acos(lo));
    }
    if (op == OP_EXP) {
        let w = wide(exp(lo), exp(hi));
        return iv(max(w.lo, 0.0), w.hi);
    }
    if (op == OP_LN) {
        if (lo < 0.0) { return iv_nan(); }
        return wide(log(lo), log(hi));
    }
    return iv_nan();
}

fn iv_binary(op: u32, alo: f32, ahi: f32, blo: f32, bhi: f32, clo: f32, chi: f32) -> Iv {
    let anan = is_nan(alo);
    let bnan = is_nan(blo);
    if (op == OP_AND || op == OP_OR) {
        if (anan) { return iv_nan(); }
        let nonzero = alo > 0.0 || ahi < 0.0;
        let zero_only = alo == 0.0 && ahi == 0.0;
        if (op == OP_AND) {
            let ch = select(select(CH_BOTH, CH_A, zero_only), CH_B, nonzero);
            if (zero_only) { return Iv(0.0, 0.0, ch); }
            if (bnan) { return Iv(nan(), nan(), ch); }
            if (nonzero) { return Iv(blo, bhi, ch); }
            return Iv(min(0.0, blo), max(0.0, bhi), ch);
        }
        let ch = select(select(CH_BOTH, CH_B, zero_only), CH_A, nonzero);
        if (nonzero) { return Iv(alo, ahi, ch); }
        if (bnan) { return Iv(nan(), nan(), ch); }
        if (zero_only) { return Iv(blo, bhi, ch); }
        return Iv(min(alo, blo), max(ahi, bhi), ch);
    }
    if (anan || bnan) { return iv_nan(); }
    if (op == OP_MIN || op == OP_MAX) {
        var pick_a = alo >= bhi;
        var pick_b = blo > ahi;
        var r = iv(max(alo, blo), max(ahi, bhi));
        if (op == OP_MIN) {
            pick_a = ahi <= blo;
            pick_b = bhi < alo;
            r = iv(min(alo, blo), min(ahi, bhi));
        }
        r.ch = select(select(CH_BOTH, CH_B, pick_b), CH_A, pick_a);
        return r;
    }
    if (op == OP_ADD) { return iv_add(alo, ahi, blo, bhi); }
    if (op == OP_SUB) { return iv_add(alo, ahi, -bhi, -blo); }
    if (op == OP_MUL) { return iv_mul(alo, ahi, blo, bhi); }
    if (op == OP_DIV) { return iv_div(alo, ahi, blo, bhi); }
    if (op == OP_COMPARE) {
        let lt = ahi < blo;
        let gt = alo > bhi;
        let eq = alo == ahi && blo == bhi && alo == blo;
        var lo = select(select(-1.0, 0.0, eq), 1.0, gt);
        var hi = select(select(1.0, 0.0, eq), -1.0, lt);
        if (!lt && !gt && !eq) {
            if (alo >= bhi) { lo = 0.0; }
            if (ahi <= blo) { hi = 0.0; }
        }
        return iv(lo, hi);
    }
    if (op == OP_MOD) {   // the Euclidean remainder lies in [0, |b|]
        if (has0(blo, bhi) || alo == -inf() || ahi == inf()) { return iv_nan(); }
        return iv(0.0, up(max(abs(blo), abs(bhi))));
    }
    if (op == OP_ATAN2) {
        if ((has0(alo, ahi) && has0(blo, bhi)) || alo == -inf() || ahi == inf() || blo == -inf() || bhi == inf()) {
            return iv_nan();
        }
        return iv(-PI_UP, PI_UP);
    }
    if (op == OP_MIX) {
        if (is_nan(clo)) { return iv_nan(); }
        let d = iv_add(blo, bhi, -ahi, -alo);
        if (is_nan(d.lo)) { return iv_nan(); }
        let m = iv_mul(d.lo, d.hi, clo, chi);
        if (is_nan(m.lo)) { return iv_nan(); }
        return iv_add(alo, ahi, m.lo, m.hi);
    }
    if (op == OP_RAND) { return iv(0.0, 1.0); }
    return iv_nan();
}

fn tile_size() -> u32 {
    return u32(U.extra.y);
}

fn tiles_x() -> u32 {
    return (U.width + tile_size() - 1u) / tile_size();
}

fn n_tiles() -> u32 {
    return tiles_x() * ((U.height + tile_size() - 1u) / tile_size());
}

fn region(t: u32) -> u32 {
    return 2u * n_tiles() + 2u * t * U.n_instrs;
}

// a pruned record in two words: op | dst << 8 | a << 16 | b << 24 (registers < 256, ops < 256),
// then c (MIX) or the bits of the constant (CONST)
fn pack_record(ins: Instr) -> vec2<u32> {
    var w1 = ins.c;
    if (ins.op == OP_CONST) {
        w1 = bitcast<u32>(params[ins.param]);
    }
    return vec2<u32>(ins.op | (ins.dst << 8u) | (ins.a << 16u) | (ins.b << 24u), w1);
}

fn n_reads(op: u32) -> u32 {
    if (op <= OP_CONST || op == OP_INSTANCE_INDEX) { return 0u; }
    if (op == OP_MIX) { return 3u; }
    return select(1u, 2u, op >= OP_ADD);
}

// one invocation per tile: interval-evaluate the tape over the tile's pixel centres (recording
// the MIN / MAX / AND / OR choices in the tile's region), classify the tile, and unless the sign
// image does not need it, write the pruned tape (backward liveness) into the region's end.
@compute @workgroup_size(WG)
fn prune_tiles(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = flat_index(wid, lid, nwg);
    if (t >= U.n_items) {
        return;
    }
    let ts = tile_size();
    let r0 = (t / tiles_x()) * ts;
    let c0 = (t % tiles_x()) * ts;
    let r1 = min(r0 + ts, U.height) - 1u;
    let c1 = min(c0 + ts, U.width) - 1u;
    // the range of the tile's pixel centres, widened for the rounding of their formula
    let r = U.rect;
    let mx = (abs(r.x) + abs(r.y - r.x)) * 3.814697265625e-06;   // 2^-18
    let my = (abs(r.w) + abs(r.w - r.z)) * 3.814697265625e-06;
    let xa = pixel_x(c0);
    let xb = pixel_x(c1);
    let ya = pixel_y(r0);
    let yb = pixel_y(r1);
    let box_lo = vec3<f32>(min(xa, xb) - mx, min(ya, yb) - my, U.extra.x);
    let box_hi = vec3<f32>(max(xa, xb) + mx, max(ya, yb) + my, U.extra.x);
    let base = region(t);
    let n = U.n_instrs;
    var i = 0u;
    loop {
        if (i >= n) {
            break;
        }
        if (iters >= U.iter_cap) {
            overflow = true;
            break;
        }
        iters += 1u;
        let ins = instrs[i];
        let op = ins.op;
        var v = Iv(0.0, 0.0, CH_BOTH);
        if (op <= OP_VAR_Z) {
            v = Iv(box_lo[op], box_hi[op], CH_BOTH);
        } else if (op == OP_CONST) {
            let c = params[ins.param];
            v = Iv(c, c, CH_BOTH);
        } else if (op == OP_INSTANCE_INDEX) {
            v = Iv(0.0, 0.0, CH_BOTH);
        } else if (op <= OP_NOT) {
            v = iv_unary(op, ilo[ins.a], ihi[ins.a]);
        } else {
            v = iv_binary(op, ilo[ins.a], ihi[ins.a], ilo[ins.b], ihi[ins.b], ilo[ins.c], ihi[ins.c]);
        }
        ilo[ins.dst] = v.lo;
        ihi[ins.dst] = v.hi;
        if (op == OP_MIN || op == OP_MAX || op == OP_AND || op == OP_OR) {
            out_u[base + 2u * i] = v.ch;   // (the liveness pass reads choices of these alone)
        }
        i += 1u;
    }
    var cls = TILE_AMBIGUOUS;
    if (ihi[0] < 0.0) {
        cls = TILE_INSIDE;
    } else if (ilo[0] >= 0.0) {
        cls = TILE_OUTSIDE;
    }
    out_u[2u * t + 1u] = cls;
    if (overflow) {
        note_overflow();
        out_u[2u * t] = n;
        return;
    }
    if (cls != TILE_AMBIGUOUS && U.extra.z != 0.0) {
        out_u[2u * t] = n;
        return;
    }
    // backward liveness (runtime/pruning.py _prune); the pruned tape is written downwards from
    // record n - 1. Writing record w overwrites choice words 2w >= 2j only: choices already read.
    live[0] = true;
    var w = n;
    var j = n;
    loop {
        if (j == 0u) {
            break;
        }
        if (iters >= U.iter_cap) {
            overflow = true;
            break;
        }
        iters += 1u;
        j -= 1u;
        let ins = instrs[j];
        let op = ins.op;
        if (!live[ins.dst]) {
            continue;
        }
        live[ins.dst] = false;
        if (op == OP_MIN || op == OP_MAX || op == OP_AND || op == OP_OR) {
            let ch = out_u[base + 2u * j];
            if (ch != CH_BOTH) {
                let src = select(ins.b, ins.a, ch == CH_A);
                live[src] = true;
                if (src != ins.dst) {
                    w -= 1u;
                    out_u[base + 2u * w] = OP_COPY | (ins.dst << 8u) | (src << 16u);
                    out_u[base + 2u * w + 1u] = 0u;
                }
                continue;
            }
        }
        let rec = pack_record(ins);
        w -= 1u;
        out_u[base + 2u * w] = rec.x;
        out_u[base + 2u * w + 1u] = rec.y;
        let nr = n_reads(op);
        if (nr >= 1u) {
            live[ins.a] = true;
        }
        if (nr >= 2u) {
            live[ins.b] = true;
        }
        if (nr == 3u) {
            live[ins.c] = true;
        }
    }
    if (overflow) {
        note_overflow();
        w = n;
    }
    out_u[2u * t] = w;
}

// one invocation per pixel: its tile's pruned tape at the pixel centre (run_tape's arithmetic,
// op for op: unary / binary / nmin / nmax and the exact fmod sub-steps), or, in the sign image,
// the tile's sign where the tile is decided (-1 inside, 1 outside). out_f[pixel] = the value.
@compute @workgroup_size(WG)
fn pruned_image(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.width * U.height) {
        return;
    }
    let row = i / U.width;
    let col = i % U.width;
    let ts = tile_size();
    let t = (row / ts) * tiles_x() + col / ts;
    let cls = out_u[2u * t + 1u];
    if (cls != TILE_AMBIGUOUS && U.extra.z != 0.0) {
        out_f[i] = select(1.0, -1.0, cls == TILE_INSIDE);
        return;
    }
    let p = vec3<f32>(pixel_x(col), pixel_y(row), U.extra.x);
    let base = region(t);
    var k = out_u[2u * t];
    let n = U.n_instrs;
    var fmod_steps = false;
    var fm_r = 0.0;
    var fm_y = 0.0;
    var fm_ey = 0;
    loop {
        if (k >= n) {
            break;
        }
        if (iters >= U.iter_cap) {
            overflow = true;
            break;
        }
        iters += 1u;
        let w0 = out_u[base + 2u * k];
        let w1 = out_u[base + 2u * k + 1u];
        let op = w0 & 0xffu;
        let dst = (w0 >> 8u) & 0xffu;
        let va = reg[(w0 >> 16u) & 0xffu];
        let vb = reg[w0 >> 24u];
        var wv = 0.0;
        var nxt = k + 1u;
        if (fmod_steps) {   // run_tape's STEP_FMOD
            var s = ldexp(fm_y, frexp(fm_r).exp - fm_ey);
            if (s > fm_r) {
                s = s * 0.5;
            }
            fm_r = fm_r - s;
            if (fm_r < fm_y) {
                let r = select(fm_r, -fm_r, va < 0.0);
                wv = select(r, r + abs(vb), r < 0.0);
                fmod_steps = false;
            } else {
                nxt = k;
            }
        } else if (op <= OP_VAR_Z) {
            wv = p[op];
        } else if (op == OP_CONST) {
            wv = bitcast<f32>(w1);
        } else if (op == OP_INSTANCE_INDEX) {
            wv = 0.0;
        } else if (op == OP_MIN) {
            wv = nmin(va, vb);
        } else if (op == OP_MAX) {
            wv = nmax(va, vb);
        } else if (op == OP_MOD) {
            let fs = fmod_start(va, vb);
            fm_y = fs.y;
            fm_r = fs.ax;
            if (fs.steps) {
                fm_ey = fs.ey;
                fmod_steps = true;
                nxt = k;
            }
            wv = select(fs.r, fs.r + abs(vb), fs.r < 0.0);
        } else if (op <= OP_NOT) {
            wv = unary(op, va);
        } else {
            wv = binary(op, va, vb, reg[w1 & 0xffu]);
        }
        if (nxt != k) {
            reg[dst] = wv;
        }
        k = nxt;
    }
    if (overflow) {
        note_overflow();
    }
    out_f[i] = reg[0];
}
