// The tape interpreter: the one function (`run_tape`) every kernel uses to evaluate a tape at a point.
// Needs, concatenated before it by runtime/gpu.py: generated_tape.wgsl (OP_*, Instr, Material,
// Instance, Bvh, STACK_CAP, LOOP_CAP), one generated_regcap_<N>.wgsl (REG_CAP), generated_render.wgsl
// and bindings.wgsl. Semantics: runtime/opcodes.py (OpSpec docs) with every choice the table leaves
// open taken exactly as the Numba twin (runtime/cpu.py, evaluated one point at a time) takes it.

// Loop iterations this invocation has run. Mesa's gallivm (lavapipe) stops a kernel's loops after
// 65535 iterations in all, and runs every loop nested in a branch at least once even when no lane
// takes the branch; so run_tape has ONE loop: polygon edges, BVH nodes and fmod steps are
// sub-steps of it, and the small fixed loops are unrolled. `iters` then counts exactly what the
// driver counts: kernels budget their work by it (U.iter_budget) and run_tape stops at U.iter_cap,
// raising `overflow`, which the host reports.
var<private> iters: u32;
var<private> overflow: bool;

// one more iteration of a loop bounded by U.iter_cap: false (overflow set) once the cap is spent
fn take_iteration() -> bool {
    if (iters >= U.iter_cap) {
        overflow = true;
        return false;
    }
    iters += 1u;
    return true;
}

// `n` iterations at once (a run of records counted before it is walked): false (overflow set,
// nothing counted) where they would pass the cap
fn take_iterations(n: u32) -> bool {
    if (n > U.iter_cap - iters) {
        overflow = true;
        return false;
    }
    iters += n;
    return true;
}

var<private> reg: array<f32, REG_CAP>;
var<private> regm: array<u32, REG_CAP>;
// Whether run_tape tracks material ids: a pipeline constant, off for the kernels that need
// distances only (march, light: runtime/gpu.py KERNEL_CONSTANTS), where the compiler then drops
// `regm` and its loads and stores; their Evals carry material 0.
override WITH_MATERIALS: bool = true;
var<private> stack_p: array<vec4<f32>, STACK_CAP>;   // (p, scale) frames of PUSH / POP

// The INSTANCES walk's hint, kept across the field evaluations of one invocation (the steps of a
// ray, its gradient taps, a shadow ray): the leaf that held the last walk's minimum, as (record + 1,
// BVH node + 1); 0: none. A walk of that record runs that leaf first when its bound is within U', so
// the running minimum starts from a leaf's value (nearer than U', as the last step's nearest part
// usually is) and the walk skips more. The least leaf value does not depend on the order the leaves
// are run in: the value is the twin's, bit for bit; only where two leaves tie exactly may the
// material come from the other one, and no output shows it: the kernels that write a material
// (eval_points, surface) evaluate once an invocation, before any hint is set.
var<private> walk_hint: vec2<u32>;

// one open pattern loop (the twin's lp / lacc / lmat / lbound / lcell / lint rows)
struct LoopFrame {
    p: vec4<f32>,        // (p, scale) at the REPEAT_* / INSTANCES, restored at the end
    acc: f32,            // running minimum over the evaluated copies
    acc_mat: u32,
    bound: f32,          // bound of the unchecked copies (INSTANCES: box distance of the leaf)
    copy_bound: f32,     // REPEAT_*: bound of the copy being evaluated (copy_bound()); INSTANCES: U'
    open: u32,           // index of the REPEAT_* / INSTANCES record
    op: u32,
    prm: u32,
    it: u32,             // iteration in progress
    n_iter: u32,
    cell0: vec3<i32>,    // nearest cell per axis (linear / polar: .x; INSTANCES: .x = BVH node,
                         // .y = 1 while the hinted leaf runs, .z = the hinted leaf or -1)
    cell1: vec3<i32>,    // neighbour cell per axis (INSTANCES: .x = instance index, .y = the leaf
                         // holding the running minimum or -1, .z = the walk's first node)
    end_node: u32,       // INSTANCES: one past the last BVH node
}
var<private> loops: array<LoopFrame, LOOP_CAP>;

struct Eval {
    d: f32,
    mat: u32,
}

const TWO_PI: f32 = 6.2831854820251465;   // float32(2 pi), as the twin
const TWO_PI_HI: f32 = 6.28125;              // 2 pi = HI + LO, HI with 8 significant bits
const TWO_PI_LO: f32 = 0.0019353071795864769;
const INV_TWO_PI: f32 = 0.15915494309189535;

// x - 2 pi round(x / 2 pi) (Cody-Waite, two constants): WGSL states sin / cos accuracy only on
// [-pi, pi], so every angle is brought there first (polar copies reach 2 pi)
fn reduce_angle(x: f32) -> f32 {
    let k = round(x * INV_TWO_PI);
    return (x - k * TWO_PI_HI) - k * TWO_PI_LO;
}

// ---- scalar helpers (the twin's) -------------------------------------------------------------

fn len3(x: f32, y: f32, z: f32) -> f32 {
    return sqrt(x * x + y * y + z * z);
}

fn len2(x: f32, y: f32) -> f32 {
    return sqrt(x * x + y * y);
}

// round half away from zero, exact in float32
fn round_away(x: f32) -> f32 {
    let ax = abs(x);
    var r = floor(ax);
    if (ax - r >= 0.5) {
        r += 1.0;
    }
    return select(-r, r, x >= 0.0);
}

// the value of an opcode the interpreter does not know: NaN (validate() rejects such tapes, so
// kernels never see one; value-returning dispatch still needs a last branch)
fn unknown_op() -> f32 {
    return bitcast<f32>(0x7fc00000u);
}

fn rand_bits(x: u32, y: u32) -> f32 {
    var h = (x * 0x9E3779B1u) ^ (y + 0x7F4A7C15u);
    h = (h ^ (h >> 16u)) * 0x45D9F3Bu;
    h = (h ^ (h >> 16u)) * 0x45D9F3Bu;
    h = h ^ (h >> 16u);
    return f32(h >> 8u) / 16777216.0;
}

// ---- shapes (the twin's formulas, in its order of operations) ------------------------------

fn sd_box(x: f32, y: f32, z: f32, hx: f32, hy: f32, hz: f32) -> f32 {
    let qx = abs(x) - hx;
    let qy = abs(y) - hy;
    let qz = abs(z) - hz;
    let outside = len3(pmax(qx, 0.0), pmax(qy, 0.0), pmax(qz, 0.0));
    return outside + pmin(pmax(qx, pmax(qy, qz)), 0.0);
}

fn cap2(dx: f32, dy: f32) -> f32 {
    let ox = pmax(dx, 0.0);
    let oy = pmax(dy, 0.0);
    return pmin(pmax(dx, dy), 0.0) + sqrt(ox * ox + oy * oy);
}

fn sd_capped_cone(x: f32, y: f32, z: f32, h: f32, r1: f32, r2: f32) -> f32 {
    let qx = len2(x, y);
    let qy = z;
    let k2x = r2 - r1;
    let k2y = 2.0 * h;
    let cax = qx - pmin(qx, select(r2, r1, qy < 0.0));
    let cay = abs(qy) - h;
    var t = ((r2 - qx) * k2x + (h - qy) * k2y) / (k2x * k2x + k2y * k2y);
    t = pmin(pmax(t, 0.0), 1.0);
    let cbx = qx - r2 + k2x * t;
    let cby = qy - h + k2y * t;
    let s = select(1.0, -1.0, cbx < 0.0 && cay < 0.0);
    return s * sqrt(pmin(cax * cax + cay * cay, cbx * cbx + cby * cby));
}

fn sd_capsule(x: f32, y: f32, z: f32, k: u32) -> f32 {
    let pax = x - params[k];
    let pay = y - params[k + 1u];
    let paz = z - params[k + 2u];
    let bax = params[k + 3u] - params[k];
    let bay = params[k + 4u] - params[k + 1u];
    let baz = params[k + 5u] - params[k + 2u];
    let bb = bax * bax + bay * bay + baz * baz;
    var h = 0.0;
    if (bb > 0.0) {
        h = pmin(pmax((pax * bax + pay * bay + paz * baz) / bb, 0.0), 1.0);
    }
    return len3(pax - bax * h, pay - bay * h, paz - baz * h) - params[k + 6u];
}

fn sd_ellipsoid(x: f32, y: f32, z: f32, rx: f32, ry: f32, rz: f32) -> f32 {
    let k0 = len3(x / rx, y / ry, z / rz);
    let k1 = len3(x / (rx * rx), y / (ry * ry), z / (rz * rz));
    if (k1 == 0.0) {
        return -pmin(rx, pmin(ry, rz));
    }
    return k0 * (k0 - 1.0) / k1;
}

// conj(q) * v * q for a unit quaternion q = (w, qx, qy, qz)
fn qrot_conj(q: vec4<f32>, v: vec3<f32>) -> vec3<f32> {
    let ux = -q.y;
    let uy = -q.z;
    let uz = -q.w;
    let tx = 2.0 * (uy * v.z - uz * v.y);
    let ty = 2.0 * (uz * v.x - ux * v.z);
    let tz = 2.0 * (ux * v.y - uy * v.x);
    return vec3<f32>(v.x + q.x * tx + (uy * tz - uz * ty),
                     v.y + q.x * ty + (uz * tx - ux * tz),
                     v.z + q.x * tz + (ux * ty - uy * tx));
}

fn shape(op: u32, p: vec4<f32>, k: u32) -> f32 {
    // if-chains, not `switch`: Mesa lowers a switch to a loop, which spends loop iterations
    let x = p.x;
    let y = p.y;
    let z = p.z;
    var d = 0.0;
    if (op == OP_SPHERE) {
        d = len3(x, y, z) - params[k];
    } else if (op == OP_BOX) {
        d = sd_box(x, y, z, params[k], params[k + 1u], params[k + 2u]);
    } else if (op == OP_ROUND_BOX) {
        let rr = params[k + 3u];
        d = sd_box(x, y, z, params[k] - rr, params[k + 1u] - rr, params[k + 2u] - rr) - rr;
    } else if (op == OP_CYLINDER) {
        d = cap2(len2(x, y) - params[k], abs(z) - params[k + 1u]);
    } else if (op == OP_CAPPED_CONE) {
        d = sd_capped_cone(x, y, z, params[k], params[k + 1u], params[k + 2u]);
    } else if (op == OP_CAPSULE) {
        d = sd_capsule(x, y, z, k);
    } else if (op == OP_TORUS) {
        let qx = len2(x, y) - params[k];
        d = sqrt(qx * qx + z * z) - params[k + 1u];
    } else if (op == OP_ELLIPSOID) {
        d = sd_ellipsoid(x, y, z, params[k], params[k + 1u], params[k + 2u]);
    } else if (op == OP_PLANE) {   // (EXTRUDE_POLY / REVOLVE_POLY are sub-steps of run_tape)
        d = x * params[k] + y * params[k + 1u] + z * params[k + 2u] - params[k + 3u];
    } else {
        d = unknown_op();
    }
    return d * p.w;
}

// ---- arithmetic -------------------------------------------------------------------------------

// COMPARE: by comparisons (compare(inf, inf) is 0), NaN if either is NaN
fn compare_values(va: f32, vb: f32) -> f32 {
    if (va < vb) { return -1.0; }
    if (va > vb) { return 1.0; }
    if (is_nan(va) || is_nan(vb)) { return va + vb; }
    return 0.0;
}

// ---- BEGIN GENERATED arith by taperay.runtime.op_codegen from runtime/opcodes.py: do not edit ----
// the arithmetic ops' cases (OpSpec.wgsl), range branches by number, hottest first inside;
// ops of OpSpec.wgsl_walk (MIN, MAX: materials; MOD: sub-steps) are run_tape's and packed.wgsl's
fn unary(op: u32, va: f32) -> f32 {
    if (op <= OP_SQUARE) {
        if (op == OP_COPY) { return va; }
        if (op == OP_NEG) { return -va; }
        if (op == OP_SQUARE) { return va * va; }
        if (op == OP_SQRT) { return sqrt(va); }
        if (op == OP_ABS) { return abs(va); }
        if (op == OP_RECIP) { return 1.0 / va; }
    } else if (op <= OP_TAN) {
        if (op == OP_FLOOR) { return floor(va); }
        if (op == OP_CEIL) { return ceil(va); }
        if (op == OP_ROUND) { return round_away(va); }
        if (op == OP_SIN) { return sin(reduce_angle(va)); }
        if (op == OP_COS) { return cos(reduce_angle(va)); }
        if (op == OP_TAN) { return tan(reduce_angle(va)); }
    } else {
        if (op == OP_ASIN) { return asin(va); }
        if (op == OP_ACOS) { return acos(va); }
        if (op == OP_ATAN) { return atan(va); }
        if (op == OP_EXP) { return exp(va); }
        if (op == OP_LN) { return log(va); }
        if (op == OP_NOT) { return select(0.0, 1.0, va == 0.0); }
    }
    return unknown_op();
}

fn binary(op: u32, va: f32, vb: f32, vc: f32) -> f32 {
    if (op <= OP_COMPARE) {
        if (op == OP_SUB) { return va - vb; }
        if (op == OP_ADD) { return va + vb; }
        if (op == OP_MUL) { return va * vb; }
        if (op == OP_DIV) { return va / vb; }
        if (op == OP_ATAN2) { return atan2_full(va, vb); }
        if (op == OP_COMPARE) { return compare_values(va, vb); }
    } else {
        if (op == OP_AND) { return select(vb, va, va == 0.0); }
        if (op == OP_OR) { return select(vb, va, va != 0.0); }
        if (op == OP_MIX) { return va + (vb - va) * vc; }
        if (op == OP_RAND) { return rand_bits(bitcast<u32>(va), bitcast<u32>(vb)); }
    }
    return unknown_op();
}
// ---- END GENERATED arith ----

// ---- patterns ---------------------------------------------------------------------------------

struct Cells {
    c: i32,
    c2: i32,
    bnd: f32,   // min |t - k| over the unchecked k (inf if none)
}

// the twin's _cells: nearest index, its neighbour (chosen with t clamped to [-1, n]) and the
// distance, in steps of the unclamped t, to the nearest unchecked index
fn cells(t: f32, cnt: i32) -> Cells {
    var tc = select(-1.0, t, t >= -1.0);
    if (tc > f32(cnt)) {
        tc = f32(cnt);
    }
    let c = min(max(i32(round_away(tc)), 0), cnt - 1);
    let step = select(-1, 1, tc >= f32(c));
    var c2 = c + step;
    if (c2 < 0 || c2 > cnt - 1) {
        c2 = c - step;
    }
    if (cnt == 1) {
        c2 = c;
    }
    let lo = min(c, c2);
    let hi = max(c, c2);
    var bnd = inf();
    if (lo - 1 >= 0) {
        bnd = abs(t - f32(lo - 1));
    }
    if (hi + 1 <= cnt - 1) {
        bnd = pmin(bnd, abs(f32(hi + 1) - t));
    }
    return Cells(c, c2, bnd);
}

// atan2 with IEEE / numpy values where WGSL leaves them undefined: both arguments zero
// (0 or +-pi by the signs of the zeros), as the CPU twin's np.arctan2
fn atan2_full(y: f32, x: f32) -> f32 {
    if (y == 0.0 && x == 0.0) {
        let v = select(0.0, bitcast<f32>(0x40490fdbu), (bitcast<u32>(x) >> 31u) == 1u);
        return select(v, -v, (bitcast<u32>(y) >> 31u) == 1u);
    }
    return atan2(y, x);
}

// MOD's start, shared by every interpreter loop: C's fmod, exact, subtracts |b| 2^k
// (Sterbenz-exact) from |a| while it is >= |b|, one sub-step per k. r: the result when no
// sub-steps are needed (a itself, or NaN); steps: sub-steps needed, from y = |b|, ax = |a|, ey.
struct FmodStart {
    r: f32,
    y: f32,
    ax: f32,
    ey: i32,
    steps: bool,
}

// MOD's value from fmod's remainder r (the sign of a): r, or r + |b| when r < 0
fn mod_value(r: f32, vb: f32) -> f32 {
    return select(r, r + abs(vb), r < 0.0);
}

// one sub-step of the exact fmod: r less the largest y 2^k not above it (y = |b|, ey its exponent);
// done when r < y, with MOD's value (the run_tape / run_packed sub-step, one function)
struct FmodStep {
    r: f32,
    done: bool,
    value: f32,
}

fn fmod_step(r: f32, y: f32, ey: i32, va: f32, vb: f32) -> FmodStep {
    var t = ldexp(y, frexp(r).exp - ey);
    if (t > r) {
        t = t * 0.5;
    }
    let rn = r - t;
    return FmodStep(rn, rn < y, mod_value(select(rn, -rn, va < 0.0), vb));
}

fn fmod_start(va: f32, vb: f32) -> FmodStart {
    let y = abs(vb);
    let ax = abs(va);
    if (is_nan(va) || is_nan(vb) || y == 0.0 || ax == inf()) {
        return FmodStart((va - va) / (va - va), y, ax, 0, false);   // NaN
    }
    if (!(y == inf() || ax < y)) {
        return FmodStart(va, y, ax, frexp(y).exp, true);
    }
    return FmodStart(va, y, ax, 0, false);
}

// Python's a % n for n >= 1 and |a| <= 3 n (sector indices): shifted positive first, because a
// signed % of a negative dividend came out wrong on NVIDIA's Vulkan driver (as if n were 4)
fn emod(a: i32, n: i32) -> i32 {
    return i32(u32(a + 4 * n) % u32(n));
}

struct GridAxis {
    c: i32,
    c2: i32,
    bound: f32,
    n_iter: u32,
}

// one axis of REPEAT_GRID as REPEAT_LINEAR with d = s e_axis (count 1: one cell, no bound)
fn grid_axis(prm: u32, ax: u32, x: f32, scale: f32) -> GridAxis {
    let s = params[prm + ax];
    let cnt = i32(params[prm + 3u + ax]);
    if (cnt == 1) {
        return GridAxis(0, 0, inf(), 1u);
    }
    let cl = cells(x / s, cnt);
    return GridAxis(cl.c, cl.c2, (cl.bnd * abs(s) - params[prm + 6u + ax]) * scale, 2u);
}

// open pattern frame fr (op, prm set) at point p: choose the cells and the unchecked bound
fn loop_enter(fr: ptr<function, LoopFrame>, p: vec4<f32>) {
    let op = (*fr).op;
    let prm = (*fr).prm;
    (*fr).p = p;
    var n_iter = 1u;
    if (op == OP_REPEAT_LINEAR) {
        let dx = params[prm];
        let dy = params[prm + 1u];
        let dz = params[prm + 2u];
        let cnt = i32(params[prm + 3u]);
        let e = params[prm + 4u];
        let dd = dx * dx + dy * dy + dz * dz;
        let dlen = sqrt(dd);
        n_iter = select(2u, 1u, cnt == 1);
        let t = (p.x * dx + p.y * dy + p.z * dz) / dd;
        let cl = cells(t, cnt);
        (*fr).cell0 = vec3<i32>(cl.c, 0, 0);
        (*fr).cell1 = vec3<i32>(cl.c2, 0, 0);
        (*fr).bound = (cl.bnd * dlen - e) * p.w;
    } else if (op == OP_REPEAT_POLAR) {
        let cnt = i32(params[prm]);
        let cx = params[prm + 1u];
        let cy = params[prm + 2u];
        let cz = params[prm + 3u];
        let big_r = params[prm + 4u];
        let phic = atan2_full(cy, cx);
        let fcnt = f32(cnt);
        n_iter = select(2u, 1u, cnt == 1);
        let s = (atan2_full(p.y, p.x) - phic) * fcnt / TWO_PI;
        let r = i32(round_away(s));
        let step = select(-1, 1, s >= f32(r));
        (*fr).cell0 = vec3<i32>(emod(r, cnt), 0, 0);
        (*fr).cell1 = vec3<i32>(emod(r + step, cnt), 0, 0);
        var bnd = inf();
        if (cnt >= 3) {   // the two unchecked neighbours lo - 1, then hi + 1 (unrolled)
            let th0 = reduce_angle(TWO_PI * f32(emod(min(r, r + step) - 1, cnt)) / fcnt);
            let cs0 = cos(th0);
            let sn0 = sin(th0);
            bnd = pmin(bnd, len3(p.x - (cs0 * cx - sn0 * cy), p.y - (sn0 * cx + cs0 * cy), p.z - cz));
            let th1 = reduce_angle(TWO_PI * f32(emod(max(r, r + step) + 1, cnt)) / fcnt);
            let cs1 = cos(th1);
            let sn1 = sin(th1);
            bnd = pmin(bnd, len3(p.x - (cs1 * cx - sn1 * cy), p.y - (sn1 * cx + cs1 * cy), p.z - cz));
        }
        (*fr).bound = (bnd - big_r) * p.w;
    } else if (op == OP_REPEAT_GRID) {   // the three axes unrolled
        let gx = grid_axis(prm, 0u, p.x, p.w);
        let gy = grid_axis(prm, 1u, p.y, p.w);
        let gz = grid_axis(prm, 2u, p.z, p.w);
        n_iter = gx.n_iter * gy.n_iter * gz.n_iter;
        (*fr).cell0 = vec3<i32>(gx.c, gy.c, gz.c);
        (*fr).cell1 = vec3<i32>(gx.c2, gy.c2, gz.c2);
        (*fr).bound = pmin(pmin(pmin(inf(), gx.bound), gy.bound), gz.bound);
    }
    (*fr).n_iter = n_iter;
    (*fr).it = 0u;
}

// the grid cell iteration `it` of frame fr evaluates (x fastest over the axes with count > 1)
fn grid_pick(fr: LoopFrame, it: u32) -> vec3<i32> {
    let prm = fr.prm;
    var sel = it;
    var out = vec3<i32>(0);
    if (i32(params[prm + 3u]) != 1) {
        out.x = select(fr.cell0.x, fr.cell1.x, (sel & 1u) == 1u);
        sel = sel >> 1u;
    }
    if (i32(params[prm + 4u]) != 1) {
        out.y = select(fr.cell0.y, fr.cell1.y, (sel & 1u) == 1u);
        sel = sel >> 1u;
    }
    if (i32(params[prm + 5u]) != 1) {
        out.z = select(fr.cell0.z, fr.cell1.z, (sel & 1u) == 1u);
    }
    return out;
}

// (p, scale) for iteration `it` of pattern frame fr
fn loop_point(fr: LoopFrame, it: u32) -> vec4<f32> {
    let prm = fr.prm;
    let lp = fr.p;
    if (fr.op == OP_REPEAT_LINEAR) {
        let k = f32(select(fr.cell0.x, fr.cell1.x, it == 1u));
        return vec4<f32>(lp.x - k * params[prm], lp.y - k * params[prm + 1u], lp.z - k * params[prm + 2u], lp.w);
    }
    if (fr.op == OP_REPEAT_POLAR) {
        let fcnt = params[prm];
        let th = reduce_angle(TWO_PI * f32(select(fr.cell0.x, fr.cell1.x, it == 1u)) / fcnt);
        let cs = cos(th);
        let sn = sin(th);
        return vec4<f32>(cs * lp.x + sn * lp.y, cs * lp.y - sn * lp.x, lp.z, lp.w);
    }
    let g = vec3<f32>(grid_pick(fr, it));
    return vec4<f32>(lp.x - g.x * params[prm], lp.y - g.y * params[prm + 1u], lp.z - g.z * params[prm + 2u], lp.w);
}

fn instance_index(fr: LoopFrame) -> f32 {
    if (fr.op == OP_INSTANCES) {
        return f32(fr.cell1.x);
    }
    if (fr.op == OP_REPEAT_GRID) {
        let g = grid_pick(fr, fr.it);
        return f32(g.x + i32(params[fr.prm + 3u]) * (g.y + i32(params[fr.prm + 4u]) * g.z));
    }
    return f32(select(fr.cell0.x, fr.cell1.x, fr.it == 1u));
}

// p = conj(q) * (p_saved - t) * q / s, scale = scale_saved * s for the leaf `node`
fn instance_point(fr: ptr<function, LoopFrame>, node: u32) -> vec4<f32> {
    let k = bvh[node].instance;
    (*fr).cell0.x = i32(node);
    (*fr).cell1.x = k;
    return instance_local(k, (*fr).p);
}

// the twin's _copy_bound: the distance, times the scale, from the copy's point q (loop_point) to
// the child's box (grid: half extents e), slab (linear: |q . d| / |d| <= e) or sphere (polar: c, R)
fn copy_bound(fr: LoopFrame, q: vec4<f32>) -> f32 {
    let prm = fr.prm;
    if (fr.op == OP_REPEAT_LINEAR) {
        let dx = params[prm];
        let dy = params[prm + 1u];
        let dz = params[prm + 2u];
        let dlen = sqrt(dx * dx + dy * dy + dz * dz);
        return (abs(q.x * dx + q.y * dy + q.z * dz) / dlen - params[prm + 4u]) * q.w;
    }
    if (fr.op == OP_REPEAT_POLAR) {
        return (len3(q.x - params[prm + 1u], q.y - params[prm + 2u], q.z - params[prm + 3u]) - params[prm + 4u]) * q.w;
    }
    return sd_box(q.x, q.y, q.z, params[prm + 6u], params[prm + 7u], params[prm + 8u]) * q.w;
}

// ---- the interpreter --------------------------------------------------------------------------

// One polygon edge (the twin's _poly loop body), a no-op once all n edges are done: edge i from
// vertex i to the previous vertex j, the squared distance d and the winding sign s so far, at q.
// STEP_POLY runs four per iteration of run_tape's loop, written out (no nested loop: see `iters`).
fn poly_edge(off: u32, q: vec2<f32>, n: u32, i: ptr<function, u32>, j: ptr<function, u32>,
             d: ptr<function, f32>, s: ptr<function, f32>) {
    if (*i >= n) {
        return;
    }
    let acc = poly_edge_acc(vec2<f32>(*d, *s), q.x, q.y, params[off + 2u * *i], params[off + 2u * *i + 1u],
                            params[off + 2u * *j], params[off + 2u * *j + 1u]);
    *d = acc.x;
    *s = acc.y;
    *j = *i;
    *i += 1u;
}

// the twin's _poly loop body at (x, y) for the edge from vertex i to the previous vertex j:
// acc = (squared distance so far, winding sign so far) -> the same after this edge
fn poly_edge_acc(acc: vec2<f32>, x: f32, y: f32, vix: f32, viy: f32, vjx: f32, vjy: f32) -> vec2<f32> {
    let ex = vjx - vix;
    let ey = vjy - viy;
    let wx = x - vix;
    let wy = y - viy;
    let ee = ex * ex + ey * ey;
    var t = 0.0;
    if (ee > 0.0) {
        t = pmin(pmax((wx * ex + wy * ey) / ee, 0.0), 1.0);
    }
    let bx = wx - ex * t;
    let by = wy - ey * t;
    let c1 = y >= viy;
    let c2 = y < vjy;
    let c3 = ex * wy > ey * wx;
    let flip = (c1 && c2 && c3) || (!c1 && !c2 && !c3);
    return vec2<f32>(pmin(acc.x, bx * bx + by * by), select(acc.y, -acc.y, flip));
}

// instance k's local point of (p, scale): conj(q) * (p - t) * q / s, scale * s
fn instance_local(k: i32, lp: vec4<f32>) -> vec4<f32> {
    let inst = instances[k];
    let v = qrot_conj(inst.q, lp.xyz - inst.t);
    return vec4<f32>(v.x / inst.s, v.y / inst.s, v.z / inst.s, lp.w * inst.s);
}

// the cell of coordinate v on a grid axis, clamped into 0 .. count - 1 (NaN: 0): the twin's _grid_cell
fn grid_cell(v: f32, lo: f32, edge: f32, count: u32) -> u32 {
    let c = (v - lo) / edge;
    if (!(c >= 0.0)) {
        return 0u;
    }
    if (c >= f32(count)) {
        return count - 1u;
    }
    return min(u32(c), count - 1u);
}

// INSTANCES' U' at (p, scale) (opcodes.py; the twin's _instances_reach): the representative of the
// grid cell holding p bounds the least instance value from above; +inf without a capsule
fn instances_reach(prm: u32, lp: vec4<f32>) -> f32 {
    let r = params[prm + 12u];
    if (r < 0.0) {
        return inf();
    }
    let nx = u32(params[prm + 17u]);
    let ny = u32(params[prm + 18u]);
    let nz = u32(params[prm + 19u]);
    let e = params[prm + 16u];
    let cx = grid_cell(lp.x, params[prm + 13u], e, nx);
    let cy = grid_cell(lp.y, params[prm + 14u], e, ny);
    let cz = grid_cell(lp.z, params[prm + 15u], e, nz);
    let k = i32(params[prm + 20u + (cz * ny + cy) * nx + cx]);
    let q = instance_local(k, lp);
    let u = pmax(sd_capsule(q.x, q.y, q.z, prm + 6u) * q.w, 0.0);
    return u + INSTANCE_REACH_REL * (u + r * q.w) + INSTANCE_REACH_POS * pmax(abs(lp.x), pmax(abs(lp.y), abs(lp.z))) * lp.w;
}

// the distance, times the scale, from (p, scale) to a BVH node's box
fn node_box_distance(nd: Bvh, lp: vec4<f32>) -> f32 {
    return sd_box(lp.x - (nd.lo.x + nd.hi.x) * 0.5, lp.y - (nd.lo.y + nd.hi.y) * 0.5,
                  lp.z - (nd.lo.z + nd.hi.z) * 0.5, (nd.hi.x - nd.lo.x) * 0.5,
                  (nd.hi.y - nd.lo.y) * 0.5, (nd.hi.z - nd.lo.z) * 0.5) * lp.w;
}

// the distance, times the scale, from instance k's local point of (p, scale) to the child's box
// (INSTANCES' params prm .. prm + 5)
fn child_box_distance(prm: u32, k: i32, lp: vec4<f32>) -> f32 {
    let q = instance_local(k, lp);
    let lo = vec3<f32>(params[prm], params[prm + 1u], params[prm + 2u]);
    let hi = vec3<f32>(params[prm + 3u], params[prm + 4u], params[prm + 5u]);
    return sd_box(q.x - (lo.x + hi.x) * 0.5, q.y - (lo.y + hi.y) * 0.5, q.z - (lo.z + hi.z) * 0.5,
                  (hi.x - lo.x) * 0.5, (hi.y - lo.y) * 0.5, (hi.z - lo.z) * 0.5) * q.w;
}

// One node of the INSTANCES walk (the twin's _bvh_seek loop body), a no-op once a leaf is found
// or the walk has passed the last node: skip the node's subtree when its box distance b is >= the
// running minimum (+inf before the first leaf) or > U' (fr.copy_bound), step into it, or stop at
// a leaf unless its bound max(b, c) (c: from its local point to the child's box) is. STEP_SEEK
// runs four per iteration of run_tape's loop, written out (no nested loop: see `iters`).
fn seek_node(fr: LoopFrame, from_end: bool, node: ptr<function, u32>, leaf: ptr<function, bool>,
             b: ptr<function, f32>) {
    if (*leaf || *node >= fr.end_node) {
        return;
    }
    let nd = bvh[*node];
    let lp = fr.p;
    let acc = select(inf(), fr.acc, from_end);
    *b = node_box_distance(nd, lp);
    if (*b >= acc || *b > fr.copy_bound) {
        *node = nd.skip;
    } else if (nd.instance < 0) {
        *node += 1u;
    } else if (i32(*node) == fr.cell0.z) {   // the hinted leaf, run before the walk
        *node += 1u;
    } else {
        *b = pmax(*b, child_box_distance(fr.prm, nd.instance, lp));
        if (*b >= acc || *b > fr.copy_bound) {
            *node += 1u;
        } else {
            *leaf = true;
        }
    }
}

// sub-step modes of run_tape's one loop
const STEP_RECORD: u32 = 0u;      // fetch and run the record at pc
const STEP_POLY: u32 = 1u;        // four polygon edges of EXTRUDE_POLY / REVOLVE_POLY at pc
const STEP_SEEK: u32 = 2u;        // four BVH nodes of the INSTANCES loop opened / continued at pc
const STEP_FMOD: u32 = 3u;        // one exact-fmod subtraction of MOD at pc
const STEP_NEXT_COPY: u32 = 4u;   // REPEAT_END at pc: copy fr.it, run unless its bound >= fr.acc

// Written for a SIMD rasteriser that runs every branch of every iteration (lavapipe): registers
// are read once and written once per iteration, and the innermost pattern frame lives in `fr`
// (outer frames are spilled to `loops` only when patterns nest), since dynamically indexed
// private arrays are what such a target pays for most.
fn run_tape(pin: vec3<f32>) -> Eval {
    var p = vec4<f32>(pin, 1.0);
    var sp = 0u;
    var lsp = 0u;                 // open pattern loops; the innermost is fr, outer ones in loops[]
    var fr: LoopFrame;
    var pc = 0u;
    let n_ins = U.n_instrs;
    var mode = STEP_RECORD;
    // polygon sub-steps (the twin's _poly): edge i, previous vertex j, squared distance, sign
    var pg_i = 0u;
    var pg_j = 0u;
    var pg_off = 0u;
    var pg_q = vec2<f32>(0.0);
    var pg_d = 0.0;
    var pg_s = 1.0;
    // BVH sub-steps (the twin's _bvh_seek): node, and whether a REPEAT_END continues the walk
    var sk_node = 0u;
    var sk_from_end = false;
    // fmod sub-steps: remainder |r| of |a| by y = |b|, exponent of y
    var fm_r = 0.0;
    var fm_y = 0.0;
    var fm_ey = 0;
    loop {
        if (mode == STEP_RECORD && pc >= n_ins) {
            break;
        }
        if (!take_iteration()) {
            break;
        }
        let ins = instrs[pc];
        let op = ins.op;
        let prm = ins.param;
        let va = reg[ins.a];
        let vb = reg[ins.b];
        let vc = reg[ins.c];
        var ma = 0u;
        var mb = 0u;
        if (WITH_MATERIALS) {
            ma = regm[ins.a];
            mb = regm[ins.b];
        }
        var nxt = pc + 1u;        // the record after this iteration (pc itself while sub-stepping)
        var wr = true;            // this iteration writes (wv, wm) into register wd
        var wd = ins.dst;
        var wv = 0.0;
        var wm = ma;
        if (mode == STEP_POLY) {
            poly_edge(pg_off, pg_q, ins.a, &pg_i, &pg_j, &pg_d, &pg_s);
            poly_edge(pg_off, pg_q, ins.a, &pg_i, &pg_j, &pg_d, &pg_s);
            poly_edge(pg_off, pg_q, ins.a, &pg_i, &pg_j, &pg_d, &pg_s);
            poly_edge(pg_off, pg_q, ins.a, &pg_i, &pg_j, &pg_d, &pg_s);
            wr = pg_i == ins.a;
            if (wr) {
                var d = pg_s * sqrt(pg_d);
                if (op == OP_EXTRUDE_POLY) {
                    d = cap2(d, abs(p.z) - params[prm]);
                }
                wv = d * p.w;
                wm = ins.aux;
                mode = STEP_RECORD;
            } else {
                nxt = pc;
            }
        } else if (mode == STEP_SEEK) {
            wr = false;
            nxt = pc;
            var leaf = false;
            var b = inf();
            seek_node(fr, sk_from_end, &sk_node, &leaf, &b);
            seek_node(fr, sk_from_end, &sk_node, &leaf, &b);
            seek_node(fr, sk_from_end, &sk_node, &leaf, &b);
            seek_node(fr, sk_from_end, &sk_node, &leaf, &b);
            if (leaf || sk_node >= fr.end_node) {   // the walk ends: at a leaf or past the last node
                mode = STEP_RECORD;
                fr.cell0.x = i32(sk_node);
                fr.bound = select(inf(), b, leaf);
                if (leaf) {
                    p = instance_point(&fr, sk_node);
                    nxt = fr.open + 1u;
                } else {
                    wr = true;
                    if (sk_from_end) {        // REPEAT_END: the loop's value
                        wv = fr.acc;
                        wm = fr.acc_mat;
                        p = fr.p;
                        nxt = pc + 1u;
                        if (fr.cell1.y >= 0) {
                            walk_hint = vec2<u32>(fr.open + 1u, u32(fr.cell1.y) + 1u);
                        }
                    } else {                  // no leaf at all: the loop's value is +inf
                        wd = instrs[ins.jump].dst;
                        wv = inf();
                        wm = 0u;
                        nxt = ins.jump + 1u;
                    }
                    lsp -= 1u;
                    if (lsp > 0u) {
                        fr = loops[lsp - 1u];
                    }
                }
            }
        } else if (mode == STEP_NEXT_COPY) {
            // a copy's value is max(body, copy bound): one whose bound is >= the running minimum
            // cannot change the pattern's value, and is skipped
            wr = false;
            nxt = pc;
            if (fr.it < fr.n_iter) {
                let q = loop_point(fr, fr.it);
                let b = copy_bound(fr, q);
                if (b >= fr.acc) {
                    fr.it += 1u;
                } else {
                    fr.copy_bound = b;
                    p = q;
                    nxt = fr.open + 1u;
                    mode = STEP_RECORD;
                }
            } else {
                wr = true;
                wv = nmin(fr.acc, fr.bound);
                wm = fr.acc_mat;
                p = fr.p;
                lsp -= 1u;
                if (lsp > 0u) {
                    fr = loops[lsp - 1u];
                }
                nxt = pc + 1u;
                mode = STEP_RECORD;
            }
        } else if (mode == STEP_FMOD) {
            let st = fmod_step(fm_r, fm_y, fm_ey, va, vb);
            fm_r = st.r;
            wr = st.done;
            if (wr) {
                wv = st.value;
                mode = STEP_RECORD;
            } else {
                nxt = pc;
            }
        } else if (op <= OP_TERNARY_LAST) {                            // ---- arithmetic
            if (op == OP_VAR_X || op == OP_VAR_Y || op == OP_VAR_Z) {
                wv = p[op - OP_VAR_X];
                wm = 0u;
            } else if (op == OP_CONST) {
                wv = params[prm];
                wm = 0u;
            } else if (op == OP_INSTANCE_INDEX) {
                if (lsp > 0u) {
                    wv = instance_index(fr);
                }
                wm = 0u;
            } else if (op == OP_MIN) {
                wv = nmin(va, vb);
                wm = select(ma, mb, vb < va);
            } else if (op == OP_MAX) {
                wv = nmax(va, vb);
                wm = select(ma, mb, vb > va);
            } else if (op == OP_MOD) {
                let fs = fmod_start(va, vb);
                fm_y = fs.y;
                fm_r = fs.ax;
                if (fs.steps) {
                    fm_ey = fs.ey;
                    mode = STEP_FMOD;
                    wr = false;
                    nxt = pc;
                }
                wv = mod_value(fs.r, vb);
            } else if (op <= OP_UNARY_LAST) {
                wv = unary(op, va);
            } else {
                wv = binary(op, va, vb, vc);
            }
        } else if (op <= OP_SHAPE_LAST) {                              // ---- shapes
            if (op == OP_EXTRUDE_POLY || op == OP_REVOLVE_POLY) {
                pg_off = select(prm, prm + 1u, op == OP_EXTRUDE_POLY);
                pg_q = select(vec2<f32>(len2(p.x, p.y), p.z), p.xy, op == OP_EXTRUDE_POLY);
                let v0 = vec2<f32>(params[pg_off], params[pg_off + 1u]);
                pg_d = (pg_q.x - v0.x) * (pg_q.x - v0.x) + (pg_q.y - v0.y) * (pg_q.y - v0.y);
                pg_s = 1.0;
                pg_i = 0u;
                pg_j = ins.a - 1u;
                mode = STEP_POLY;
                wr = false;
                nxt = pc;
            } else {
                wv = shape(op, p, prm);
                wm = ins.aux;
            }
        } else if (op <= OP_POINT_LAST) {                              // ---- point ops
            wr = false;
            if (op == OP_PUSH) {
                stack_p[sp] = p;
                sp += 1u;
            } else if (op == OP_POP) {
                sp -= 1u;
                p = stack_p[sp];
            } else if (op == OP_TRANSLATE) {
                p = vec4<f32>(p.x - params[prm], p.y - params[prm + 1u], p.z - params[prm + 2u], p.w);
            } else if (op == OP_ELONGATE) {
                let tx = params[prm];
                let ty = params[prm + 1u];
                let tz = params[prm + 2u];
                p = vec4<f32>(p.x - pmin(pmax(p.x, -tx), tx), p.y - pmin(pmax(p.y, -ty), ty),
                              p.z - pmin(pmax(p.z, -tz), tz), p.w);
            } else if (op == OP_ROTATE) {
                let q = vec4<f32>(params[prm], params[prm + 1u], params[prm + 2u], params[prm + 3u]);
                p = vec4<f32>(qrot_conj(q, p.xyz), p.w);
            } else if (op == OP_SCALE) {
                let s = params[prm];
                p = vec4<f32>(p.x / s, p.y / s, p.z / s, p.w * s);
            } else if (op == OP_MIRROR) {
                let nx = params[prm];
                let ny = params[prm + 1u];
                let nz = params[prm + 2u];
                let d = params[prm + 3u];
                let dp = p.x * nx + p.y * ny + p.z * nz;
                if (dp < d) {
                    let k = 2.0 * (dp - d);
                    p = vec4<f32>(p.x - k * nx, p.y - k * ny, p.z - k * nz, p.w);
                }
            }
        } else if (op <= OP_COMBINE_LAST) {                            // ---- combine
            if (op == OP_OFFSET || op == OP_SHELL) {
                wv = select(va, abs(va), op == OP_SHELL) - params[prm];
            } else if (op == OP_UNION) {
                wv = nmin(va, vb);
                wm = select(ma, mb, vb < va);
            } else if (op == OP_INTERSECT) {
                wv = nmax(va, vb);
                wm = select(ma, mb, vb > va);
            } else if (op == OP_XOR) {
                wv = nmax(nmin(va, vb), -nmax(va, vb));
                wm = select(ma, mb, vb < va);
            } else if (op == OP_DIFFERENCE) {
                wv = nmax(va, -vb);
            } else if (op == OP_SMOOTH_UNION || op == OP_SMOOTH_INTERSECT || op == OP_SMOOTH_DIFFERENCE) {
                // smin(x, y) = min(x, y) - h*h*k/4, h = max(k - |x - y|, 0) / k
                let k = params[prm];
                var x = va;
                var y = vb;
                var sg = 1.0;
                wm = select(ma, mb, vb < va);
                if (op == OP_SMOOTH_INTERSECT) {
                    x = -va;
                    y = -vb;
                    sg = -1.0;
                    wm = select(ma, mb, vb > va);
                } else if (op == OP_SMOOTH_DIFFERENCE) {
                    x = -va;
                    sg = -1.0;
                    wm = ma;
                }
                let h = pmax(k - abs(x - y), 0.0) / k;
                wv = sg * (nmin(x, y) - h * h * k * 0.25);
            }
        } else if (op == OP_REPEAT_END) {                              // ---- patterns
            wr = false;
            if (fr.op == OP_INSTANCES) {
                let v = pmax(va, fr.bound);
                if (v < fr.acc) {
                    fr.acc = v;
                    fr.acc_mat = ma;
                    fr.cell1.y = fr.cell0.x;
                }
                sk_node = select(u32(fr.cell0.x) + 1u, u32(fr.cell1.z), fr.cell0.y != 0);   // (after the hint: from the root)
                fr.cell0.y = 0;
                sk_from_end = true;
                mode = STEP_SEEK;
                nxt = pc;
            } else {
                let v = pmax(va, fr.copy_bound);
                if (fr.it == 0u || v < fr.acc) {
                    fr.acc = v;
                    fr.acc_mat = ma;
                }
                fr.it += 1u;
                mode = STEP_NEXT_COPY;
                nxt = pc;
            }
        } else if (op <= OP_PATTERN_LAST) {   // REPEAT_LINEAR / POLAR / GRID, INSTANCES: open a loop
            wr = false;
            if (lsp > 0u) {
                loops[lsp - 1u] = fr;
            }
            lsp += 1u;
            fr.open = pc;
            fr.op = op;
            fr.prm = prm;
            fr.acc = inf();
            fr.acc_mat = 0u;
            if (op == OP_INSTANCES) {
                fr.end_node = ins.aux + ins.a;
                fr.it = 0u;
                fr.p = p;
                fr.cell0 = vec3<i32>(0, 0, -1);
                fr.cell1 = vec3<i32>(0, -1, i32(ins.aux));
                fr.copy_bound = instances_reach(prm, p);   // U'
                sk_node = ins.aux;
                sk_from_end = false;
                mode = STEP_SEEK;
                nxt = pc;
                let h = walk_hint.y - 1u;
                if (walk_hint.x == pc + 1u && h >= ins.aux && h < fr.end_node) {   // run the hinted leaf first
                    let nd = bvh[h];
                    if (nd.instance >= 0) {
                        let b = pmax(node_box_distance(nd, p), child_box_distance(prm, nd.instance, p));
                        if (b <= fr.copy_bound) {
                            fr.cell0 = vec3<i32>(0, 1, i32(h));
                            fr.bound = b;
                            p = instance_point(&fr, h);
                            mode = STEP_RECORD;
                            nxt = pc + 1u;
                        }
                    }
                }
            } else {
                loop_enter(&fr, p);
                p = loop_point(fr, 0u);
                fr.copy_bound = copy_bound(fr, p);
            }
        } else if (op == OP_CULL_BOX) {                                // ---- cull
            let x0 = params[prm];
            let y0 = params[prm + 1u];
            let z0 = params[prm + 2u];
            let x1 = params[prm + 3u];
            let y1 = params[prm + 4u];
            let z1 = params[prm + 5u];
            let m = params[prm + 6u];
            wv = sd_box(p.x - (x0 + x1) * 0.5, p.y - (y0 + y1) * 0.5, p.z - (z0 + z1) * 0.5,
                        (x1 - x0) * 0.5, (y1 - y0) * 0.5, (z1 - z0) * 0.5) * p.w;
            wm = ins.aux;
            if (wv >= va + m) {
                nxt = ins.jump;
            }
        } else if (op == OP_FIELD_RESULT) {                            // ---- material
            wv = va * p.w;
            wm = ins.aux;
        } else {
            wr = false;
        }
        if (wr) {
            reg[wd] = wv;
            if (WITH_MATERIALS) {
                regm[wd] = wm;
            }
        }
        pc = nxt;
    }
    var mat = 0u;
    if (WITH_MATERIALS) {
        mat = regm[0];
    }
    return Eval(reg[0], mat);
}

// run_tape, counting an evaluation that hit the iteration cap in counters[COUNT_OVERFLOW]
fn eval_checked(pin: vec3<f32>) -> Eval {
    let e = run_tape(pin);
    if (overflow) {
        note_overflow();
    }
    return e;
}

// the field a render sees: the tape (with FIELD_CELLS, set for the pruned march, surface and light
// of an arithmetic tape or a scene's lowering: its pruned cell tapes, packed.wgsl cell_eval),
// capped by the section half-space when the settings ask
override FIELD_CELLS: bool = false;

fn field(pin: vec3<f32>) -> Eval {
    return trace_field(pin, pin, pin, 0.0, false, 0.0).e;
}

// a tracing step's field at p = o + t d: field(p), or, with FIELD_CELLS and `skip`, a step over
// a cell proven empty (packed.wgsl cell_find, `cone` the trace's hit cone): skip_to >= 0 is where
// the ray moves on to, and e is not evaluated
struct FieldStep {
    e: Eval,
    skip_to: f32,
}

fn trace_field(p: vec3<f32>, o: vec3<f32>, d: vec3<f32>, t: f32, skip: bool, cone: f32) -> FieldStep {
    var e: Eval;
    if (FIELD_CELLS) {
        let g = march_cells();
        let found = cell_find(g, p, skip, o, d, t, cone);
        if (found.skip_to >= 0.0) {
            return FieldStep(Eval(0.0, 0u), found.skip_to);
        }
        e = cell_eval(g, found.tile, p);
    } else {
        e = run_tape(p);
    }
    if (setting(SET_SECTION) != 0.0) {
        let n = setting3(SET_PLANE_N);
        let pv = p.x * n.x + p.y * n.y + p.z * n.z - setting(SET_PLANE_D);
        if (pv > e.d) {
            e.d = pv;
        }
    }
    return FieldStep(e, -1.0);
}
