// The tape interpreter: the one function (`run_tape`) every kernel uses to evaluate a tape at a point.
// Needs, concatenated before it by runtime/gpu.py: generated_tape.wgsl (OP_*, Instr, Material,
// Instance, Bvh, STACK_CAP, LOOP_CAP), one generated_regcap_<N>.wgsl (REG_CAP), generated_render.wgsl
// and bindings.wgsl. Semantics: runtime/opcodes.py (OpSpec docs) with every choice the table leaves
// open taken exactly as the Numba twin (runtime/cpu.py, evaluated one point at a time) takes it.

// Loop iterations this invocation has run (interpreter records, polygon edges, BVH nodes, fmod
// steps). Software rasterisers stop a kernel's loops after a fixed number of iterations (Mesa's
// gallivm: 65535 per invocation, all loops together), so kernels budget their work by it
// (U.iter_budget), run_tape stops at U.iter_cap and raises `overflow`, which the host reports.
var<private> iters: u32;
var<private> overflow: bool;

var<private> reg: array<f32, REG_CAP>;
var<private> regm: array<u32, REG_CAP>;
var<private> stack_p: array<vec4<f32>, STACK_CAP>;   // (p, scale) frames of PUSH / POP

// one open pattern loop (the twin's lp / lacc / lmat / lbound / lcell / lint rows)
struct LoopFrame {
    p: vec4<f32>,        // (p, scale) at the REPEAT_* / INSTANCES, restored at the end
    acc: f32,            // running minimum over the evaluated copies
    acc_mat: u32,
    bound: f32,          // bound of the unchecked copies (INSTANCES: box distance of the leaf)
    open: u32,           // index of the REPEAT_* / INSTANCES record
    op: u32,
    prm: u32,
    it: u32,             // iteration in progress
    n_iter: u32,
    cell0: vec3<i32>,    // nearest cell per axis (linear / polar: .x; INSTANCES: .x = BVH node)
    cell1: vec3<i32>,    // neighbour cell per axis (INSTANCES: .x = instance index)
    end_node: u32,       // INSTANCES: one past the last BVH node
}
var<private> loops: array<LoopFrame, LOOP_CAP>;

struct Eval {
    d: f32,
    mat: u32,
}

const TWO_PI: f32 = 6.2831854820251465;   // float32(2 pi), as the twin

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

// C's fmod, exact: subtract |b| * 2^k (Sterbenz-exact) from |a| until it is below |b|
fn fmod_exact(a: f32, b: f32) -> f32 {
    let y = abs(b);
    var r = abs(a);
    if (is_nan(a) || is_nan(b) || y == 0.0 || r == inf()) {
        return (a - a) / (a - a);   // NaN
    }
    if (y == inf() || r < y) {
        return a;
    }
    let ey = frexp(y).exp;
    for (var guard = 0u; guard < 320u && r >= y; guard++) {
        iters += 1u;
        var t = ldexp(y, frexp(r).exp - ey);
        if (t > r) {
            t = t * 0.5;
        }
        r = r - t;
    }
    return select(r, -r, a < 0.0);
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

// signed distance to the closed polygon params[off .. off + 2 nv] (even-odd inside)
fn sd_poly(off: u32, nv: u32, x: f32, y: f32) -> f32 {
    let v0x = params[off];
    let v0y = params[off + 1u];
    var d = (x - v0x) * (x - v0x) + (y - v0y) * (y - v0y);
    var s = 1.0;
    var j = nv - 1u;
    iters += nv;
    for (var i = 0u; i < nv; i++) {
        let vix = params[off + 2u * i];
        let viy = params[off + 2u * i + 1u];
        let vjx = params[off + 2u * j];
        let vjy = params[off + 2u * j + 1u];
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
        d = pmin(d, bx * bx + by * by);
        let c1 = y >= viy;
        let c2 = y < vjy;
        let c3 = ex * wy > ey * wx;
        if ((c1 && c2 && c3) || (!c1 && !c2 && !c3)) {
            s = -s;
        }
        j = i;
    }
    return s * sqrt(d);
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

fn shape(op: u32, p: vec4<f32>, k: u32, a: u32) -> f32 {
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
    } else if (op == OP_PLANE) {
        d = x * params[k] + y * params[k + 1u] + z * params[k + 2u] - params[k + 3u];
    } else if (op == OP_EXTRUDE_POLY) {
        d = cap2(sd_poly(k + 1u, a, x, y), abs(z) - params[k]);
    } else {   // OP_REVOLVE_POLY
        d = sd_poly(k, a, len2(x, y), z);
    }
    return d * p.w;
}

// ---- arithmetic -------------------------------------------------------------------------------

fn unary(op: u32, va: f32) -> f32 {
    if (op <= OP_SQUARE) {
        if (op == OP_COPY) { return va; }
        if (op == OP_NEG) { return -va; }
        if (op == OP_ABS) { return abs(va); }
        if (op == OP_RECIP) { return 1.0 / va; }
        if (op == OP_SQRT) { return sqrt(va); }
        return va * va;   // OP_SQUARE
    }
    if (op <= OP_TAN) {
        if (op == OP_FLOOR) { return floor(va); }
        if (op == OP_CEIL) { return ceil(va); }
        if (op == OP_ROUND) { return round_away(va); }
        if (op == OP_SIN) { return sin(va); }
        if (op == OP_COS) { return cos(va); }
        return tan(va);   // OP_TAN
    }
    if (op == OP_ASIN) { return asin(va); }
    if (op == OP_ACOS) { return acos(va); }
    if (op == OP_ATAN) { return atan(va); }
    if (op == OP_EXP) { return exp(va); }
    if (op == OP_LN) { return log(va); }
    return select(0.0, 1.0, va == 0.0);   // OP_NOT
}

fn binary(op: u32, va: f32, vb: f32, vc: f32) -> f32 {
    if (op <= OP_DIV) {
        if (op == OP_ADD) { return va + vb; }
        if (op == OP_SUB) { return va - vb; }
        if (op == OP_MUL) { return va * vb; }
        return va / vb;   // OP_DIV
    }
    if (op == OP_ATAN2) { return atan2(va, vb); }
    if (op == OP_COMPARE) {
        if (va < vb) { return -1.0; }
        if (va > vb) { return 1.0; }
        if (is_nan(va) || is_nan(vb)) { return va + vb; }
        return 0.0;
    }
    if (op == OP_MOD) {
        let r = fmod_exact(va, vb);
        return select(r, r + abs(vb), r < 0.0);
    }
    if (op == OP_AND) { return select(vb, va, va == 0.0); }
    if (op == OP_OR) { return select(vb, va, va != 0.0); }
    if (op == OP_MIX) { return va + (vb - va) * vc; }
    return rand_bits(bitcast<u32>(va), bitcast<u32>(vb));   // OP_RAND
}

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

fn emod(a: i32, n: i32) -> i32 {
    return ((a % n) + n) % n;
}

// open pattern frame L at point p: choose the cells and the unchecked bound
fn loop_enter(L: u32, op: u32, prm: u32, p: vec4<f32>) {
    loops[L].p = p;
    iters += 3u;
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
        loops[L].cell0 = vec3<i32>(cl.c, 0, 0);
        loops[L].cell1 = vec3<i32>(cl.c2, 0, 0);
        loops[L].bound = (cl.bnd * dlen - e) * p.w;
    } else if (op == OP_REPEAT_POLAR) {
        let cnt = i32(params[prm]);
        let cx = params[prm + 1u];
        let cy = params[prm + 2u];
        let cz = params[prm + 3u];
        let big_r = params[prm + 4u];
        let phic = atan2(cy, cx);
        let fcnt = f32(cnt);
        n_iter = select(2u, 1u, cnt == 1);
        let s = (atan2(p.y, p.x) - phic) * fcnt / TWO_PI;
        let r = i32(round_away(s));
        let step = select(-1, 1, s >= f32(r));
        loops[L].cell0 = vec3<i32>(emod(r, cnt), 0, 0);
        loops[L].cell1 = vec3<i32>(emod(r + step, cnt), 0, 0);
        var bnd = inf();
        if (cnt >= 3) {
            for (var side = 0; side < 2; side++) {
                let k = select(max(r, r + step) + 1, min(r, r + step) - 1, side == 0);
                let th = TWO_PI * f32(emod(k, cnt)) / fcnt;
                let cs = cos(th);
                let sn = sin(th);
                bnd = pmin(bnd, len3(p.x - (cs * cx - sn * cy), p.y - (sn * cx + cs * cy), p.z - cz));
            }
        }
        loops[L].bound = (bnd - big_r) * p.w;
    } else {  // OP_REPEAT_GRID
        var bound = inf();
        var c0 = vec3<i32>(0);
        var c1 = vec3<i32>(0);
        for (var ax = 0u; ax < 3u; ax++) {
            let s = params[prm + ax];
            let cnt = i32(params[prm + 3u + ax]);
            let e = params[prm + 6u + ax];
            if (cnt == 1) {
                continue;
            }
            n_iter *= 2u;
            let cl = cells(p[ax] / s, cnt);
            c0[ax] = cl.c;
            c1[ax] = cl.c2;
            bound = pmin(bound, (cl.bnd * abs(s) - e) * p.w);
        }
        loops[L].cell0 = c0;
        loops[L].cell1 = c1;
        loops[L].bound = bound;
    }
    loops[L].n_iter = n_iter;
    loops[L].it = 0u;
}

// the grid cell iteration `it` of frame L evaluates (x fastest over the axes with count > 1)
fn grid_pick(L: u32, it: u32) -> vec3<i32> {
    let prm = loops[L].prm;
    var sel = it;
    var out = vec3<i32>(0);
    iters += 3u;
    for (var ax = 0u; ax < 3u; ax++) {
        if (i32(params[prm + 3u + ax]) != 1) {
            out[ax] = select(loops[L].cell0[ax], loops[L].cell1[ax], (sel & 1u) == 1u);
            sel = sel >> 1u;
        }
    }
    return out;
}

// (p, scale) for iteration `it` of pattern frame L
fn loop_point(L: u32, it: u32) -> vec4<f32> {
    let op = loops[L].op;
    let prm = loops[L].prm;
    let lp = loops[L].p;
    if (op == OP_REPEAT_LINEAR) {
        let k = f32(select(loops[L].cell0.x, loops[L].cell1.x, it == 1u));
        return vec4<f32>(lp.x - k * params[prm], lp.y - k * params[prm + 1u], lp.z - k * params[prm + 2u], lp.w);
    }
    if (op == OP_REPEAT_POLAR) {
        let fcnt = params[prm];
        let th = TWO_PI * f32(select(loops[L].cell0.x, loops[L].cell1.x, it == 1u)) / fcnt;
        let cs = cos(th);
        let sn = sin(th);
        return vec4<f32>(cs * lp.x + sn * lp.y, cs * lp.y - sn * lp.x, lp.z, lp.w);
    }
    let g = vec3<f32>(grid_pick(L, it));
    return vec4<f32>(lp.x - g.x * params[prm], lp.y - g.y * params[prm + 1u], lp.z - g.z * params[prm + 2u], lp.w);
}

fn instance_index(L: u32) -> f32 {
    let op = loops[L].op;
    if (op == OP_INSTANCES) {
        return f32(loops[L].cell1.x);
    }
    if (op == OP_REPEAT_GRID) {
        let prm = loops[L].prm;
        let g = grid_pick(L, loops[L].it);
        return f32(g.x + i32(params[prm + 3u]) * (g.y + i32(params[prm + 4u]) * g.z));
    }
    return f32(select(loops[L].cell0.x, loops[L].cell1.x, loops[L].it == 1u));
}

struct Seek {
    node: u32,
    b: f32,
}

// walk the BVH from `node` to the next leaf to evaluate (node == end: none)
fn bvh_seek(start: u32, end: u32, lp: vec4<f32>, acc: f32) -> Seek {
    var node = start;
    while (node < end) {
        iters += 1u;
        let nd = bvh[node];
        let b = sd_box(lp.x - (nd.lo.x + nd.hi.x) * 0.5, lp.y - (nd.lo.y + nd.hi.y) * 0.5,
                       lp.z - (nd.lo.z + nd.hi.z) * 0.5, (nd.hi.x - nd.lo.x) * 0.5,
                       (nd.hi.y - nd.lo.y) * 0.5, (nd.hi.z - nd.lo.z) * 0.5) * lp.w;
        if (b >= acc) {
            node = nd.skip;
        } else if (nd.instance >= 0) {
            return Seek(node, b);
        } else {
            node += 1u;
        }
    }
    return Seek(end, inf());
}

// p = conj(q) * (p_saved - t) * q / s, scale = scale_saved * s for the leaf `node`
fn instance_point(L: u32, node: u32) -> vec4<f32> {
    let k = bvh[node].instance;
    loops[L].cell0.x = i32(node);
    loops[L].cell1.x = k;
    let inst = instances[k];
    let lp = loops[L].p;
    let v = qrot_conj(inst.q, lp.xyz - inst.t);
    return vec4<f32>(v.x / inst.s, v.y / inst.s, v.z / inst.s, lp.w * inst.s);
}

// ---- the interpreter --------------------------------------------------------------------------

fn run_tape(pin: vec3<f32>) -> Eval {
    var p = vec4<f32>(pin, 1.0);
    var sp = 0u;
    var lsp = 0u;
    var pc = 0u;
    let n_ins = U.n_instrs;
    while (pc < n_ins) {
        if (iters >= U.iter_cap) {
            overflow = true;
            break;
        }
        iters += 1u;
        let ins = instrs[pc];
        let op = ins.op;
        let dst = ins.dst;
        let prm = ins.param;
        var nxt = pc + 1u;
        if (op < OP_SPHERE) {                                          // ---- arithmetic
            if (op <= OP_CONST || op == OP_INSTANCE_INDEX) {
                var v = 0.0;
                if (op <= OP_VAR_Z) {
                    v = p[op];
                } else if (op == OP_CONST) {
                    v = params[prm];
                } else if (lsp > 0u) {
                    v = instance_index(lsp - 1u);
                }
                reg[dst] = v;
                regm[dst] = 0u;
            } else if (op == OP_MIN || op == OP_MAX) {
                let va = reg[ins.a];
                let vb = reg[ins.b];
                let ma = regm[ins.a];
                let mb = regm[ins.b];
                if (op == OP_MIN) {
                    reg[dst] = nmin(va, vb);
                    regm[dst] = select(ma, mb, vb < va);
                } else {
                    reg[dst] = nmax(va, vb);
                    regm[dst] = select(ma, mb, vb > va);
                }
            } else {
                let ma = regm[ins.a];
                let va = reg[ins.a];
                var v = 0.0;
                if (op <= OP_NOT) {
                    v = unary(op, va);
                } else {
                    v = binary(op, va, reg[ins.b], reg[ins.c]);
                }
                reg[dst] = v;
                regm[dst] = ma;
            }
        } else if (op < OP_PUSH) {                                     // ---- shapes
            reg[dst] = shape(op, p, prm, ins.a);
            regm[dst] = ins.aux;
        } else if (op < OP_UNION) {                                    // ---- point ops
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
            } else {   // OP_MIRROR
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
        } else if (op < OP_REPEAT_LINEAR) {                            // ---- combine
            let va = reg[ins.a];
            let ma = regm[ins.a];
            if (op == OP_OFFSET || op == OP_SHELL) {
                reg[dst] = select(va, abs(va), op == OP_SHELL) - params[prm];
                regm[dst] = ma;
            } else {
                let vb = reg[ins.b];
                let mb = regm[ins.b];
                if (op == OP_UNION) {
                    reg[dst] = nmin(va, vb);
                    regm[dst] = select(ma, mb, vb < va);
                } else if (op == OP_INTERSECT) {
                    reg[dst] = nmax(va, vb);
                    regm[dst] = select(ma, mb, vb > va);
                } else if (op == OP_XOR) {
                    reg[dst] = nmax(nmin(va, vb), -nmax(va, vb));
                    regm[dst] = select(ma, mb, vb < va);
                } else if (op == OP_DIFFERENCE) {
                    reg[dst] = nmax(va, -vb);
                    regm[dst] = ma;
                } else {   // smooth ops: smin(x, y) = min(x, y) - h*h*k/4, h = max(k - |x - y|, 0) / k
                    let k = params[prm];
                    var x = va;
                    var y = vb;
                    var sg = 1.0;
                    var m = select(ma, mb, vb < va);
                    if (op == OP_SMOOTH_INTERSECT) {
                        x = -va;
                        y = -vb;
                        sg = -1.0;
                        m = select(ma, mb, vb > va);
                    } else if (op == OP_SMOOTH_DIFFERENCE) {
                        x = -va;
                        sg = -1.0;
                        m = ma;
                    }
                    let h = pmax(k - abs(x - y), 0.0) / k;
                    reg[dst] = sg * (nmin(x, y) - h * h * k * 0.25);
                    regm[dst] = m;
                }
            }
        } else if (op <= OP_INSTANCES) {                               // ---- patterns
            if (op == OP_REPEAT_END) {
                let L = lsp - 1u;
                var again = false;
                if (loops[L].op == OP_INSTANCES) {
                    let v = pmax(reg[ins.a], loops[L].bound);
                    if (v < loops[L].acc) {
                        loops[L].acc = v;
                        loops[L].acc_mat = regm[ins.a];
                    }
                    let sk = bvh_seek(u32(loops[L].cell0.x) + 1u, loops[L].end_node, loops[L].p, loops[L].acc);
                    loops[L].cell0.x = i32(sk.node);
                    loops[L].bound = sk.b;
                    again = sk.node < loops[L].end_node;
                    if (again) {
                        p = instance_point(L, sk.node);
                    }
                } else {
                    let v = reg[ins.a];
                    if (loops[L].it == 0u || v < loops[L].acc) {
                        loops[L].acc = v;
                        loops[L].acc_mat = regm[ins.a];
                    }
                    loops[L].it += 1u;
                    again = loops[L].it < loops[L].n_iter;
                    if (again) {
                        p = loop_point(L, loops[L].it);
                    }
                }
                if (again) {
                    nxt = loops[L].open + 1u;
                } else {
                    if (loops[L].op == OP_INSTANCES) {
                        reg[dst] = loops[L].acc;
                    } else {
                        reg[dst] = nmin(loops[L].acc, loops[L].bound);
                    }
                    regm[dst] = loops[L].acc_mat;
                    p = loops[L].p;
                    lsp -= 1u;
                }
            } else {
                let L = lsp;
                lsp += 1u;
                loops[L].open = pc;
                loops[L].op = op;
                loops[L].prm = prm;
                loops[L].acc = inf();
                loops[L].acc_mat = 0u;
                if (op == OP_INSTANCES) {
                    let end = ins.aux + ins.a;
                    loops[L].end_node = end;
                    loops[L].it = 0u;
                    loops[L].p = p;
                    loops[L].cell1.x = 0;
                    let sk = bvh_seek(ins.aux, end, p, inf());
                    loops[L].cell0.x = i32(sk.node);
                    loops[L].bound = sk.b;
                    if (sk.node < end) {
                        p = instance_point(L, sk.node);
                    } else {                      // no leaf: the loop's value is +inf
                        let end_dst = instrs[ins.jump].dst;
                        reg[end_dst] = inf();
                        regm[end_dst] = 0u;
                        lsp -= 1u;
                        nxt = ins.jump + 1u;
                    }
                } else {
                    loop_enter(L, op, prm, p);
                    p = loop_point(L, 0u);
                }
            }
        } else if (op == OP_CULL_BOX) {                                // ---- cull
            let x0 = params[prm];
            let y0 = params[prm + 1u];
            let z0 = params[prm + 2u];
            let x1 = params[prm + 3u];
            let y1 = params[prm + 4u];
            let z1 = params[prm + 5u];
            let m = params[prm + 6u];
            let bb = sd_box(p.x - (x0 + x1) * 0.5, p.y - (y0 + y1) * 0.5, p.z - (z0 + z1) * 0.5,
                            (x1 - x0) * 0.5, (y1 - y0) * 0.5, (z1 - z0) * 0.5) * p.w;
            let culled = bb >= reg[ins.a] + m;
            reg[dst] = bb;
            regm[dst] = ins.aux;
            if (culled) {
                nxt = ins.jump;
            }
        } else {                                                       // ---- SET_MATERIAL
            reg[dst] = reg[ins.a];
            regm[dst] = ins.aux;
        }
        pc = nxt;
    }
    return Eval(reg[0], regm[0]);
}

// the field a render sees: the tape, capped by the section half-space when the settings ask
fn field(pin: vec3<f32>) -> Eval {
    var e = run_tape(pin);
    if (setting(SET_SECTION) != 0.0) {
        let n = setting3(SET_PLANE_N);
        let pv = pin.x * n.x + pin.y * n.y + pin.z * n.z - setting(SET_PLANE_D);
        if (pv > e.d) {
            e.d = pv;
        }
    }
    return e;
}
