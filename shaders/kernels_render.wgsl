// Render kernels: primary march, key-light shadow + ambient occlusion, the colour of every view
// (shading.compose), the slice view, and accumulate / resolve. Mirrors CpuWalker.march / render
// and runtime/shading.py. Buffers (N = U.n_items pixels, row-major, row 0 at the top):
//   out_f[4i ..]       march: t (inf = miss; the current t while unfinished), gradient at the hit
//   out_u[4i ..]       march: steps, material (written by surface), hit, phase
//   out_f[4N + 4i ..]  light: key-light visibility, ambient occlusion, shadow-ray t, penumbra
//   out_u[4N + 4i ..]  light: shadow-ray steps, phase, shadow hit, occlusion sum (f32 bits)
//   out_u[8N + i]      resolve: the RGB bytes of the image, four a word (byte 3p + c: pixel p, channel c)
//   accum[i]           linear colour sums over the samples (the view colour before to_rgb8)
// march and light are resumable: a pixel whose work would pass U.iter_budget saves its state,
// counts itself in counters[COUNT_UNFINISHED] and the host dispatches again with U.resume = 1.

// the unit ray direction through the image point (x, y) in pixels (a pixel's centre is col + 0.5,
// row + 0.5) by runtime/camera.py's convention (pixel_ray)
fn camera_dir(x: f32, y: f32) -> vec3<f32> {
    let w = f32(U.width);
    let h = f32(U.height);
    let th = U.camera[0].w;
    let aspect = w / h;
    let ndc_x = (2.0 * x / w - 1.0) * aspect * th;
    let ndc_y = (1.0 - 2.0 * y / h) * th;
    let d = U.camera[3].xyz + ndc_x * U.camera[1].xyz + ndc_y * U.camera[2].xyz;
    return d / sqrt(d.x * d.x + d.y * d.y + d.z * d.z);
}

// the ray direction of pixel i (+ the sub-pixel jitter U.extra.zw)
fn pixel_dir(i: u32) -> vec3<f32> {
    return camera_dir(f32(i % U.width) + U.extra.z + 0.5, f32(i / U.width) + U.extra.w + 0.5);
}

fn eye() -> vec3<f32> {
    return U.camera[0].xyz;
}

// entry and exit t of the ray o + t d through the march box (t0 > t1: none); the twin's _slab
fn slab(o: vec3<f32>, d: vec3<f32>) -> vec2<f32> {
    let lo = setting3(SET_BOX_LO);
    let hi = setting3(SET_BOX_HI);
    var t0 = -inf();
    var t1 = inf();
    for (var r = 0u; r < 3u; r++) {
        if (d[r] == 0.0) {
            if (o[r] < lo[r] || o[r] > hi[r]) {
                return vec2<f32>(inf(), -inf());
            }
            continue;
        }
        let ta = (lo[r] - o[r]) / d[r];
        let tb = (hi[r] - o[r]) / d[r];
        t0 = pmax(t0, pmin(ta, tb));
        t1 = pmin(t1, pmax(ta, tb));
    }
    return vec2<f32>(pmax(t0, 0.0), t1);
}

struct Trace {
    t: f32,
    tfar: f32,
    steps: u32,
    max_steps: u32,
    hit: bool,
    mat: u32,
    res: f32,      // soft-shadow penumbra min(1, k f / t) (1 when soft_k == 0)
    soft_k: f32,
    cone: f32,     // the hit threshold's growth per unit of t (SET_HIT_CONE; 0: hit_eps alone)
}

// one sphere-tracing step with the field value e at o + t d (the twin's _trace); false when the
// trace is done. Kernels evaluate the field once, in one loop, so the interpreter is inlined once.
fn trace_step(tr: ptr<function, Trace>, e: Eval) -> bool {
    (*tr).steps += 1u;
    var thr = setting(SET_HIT_EPS);
    if ((*tr).cone > 0.0) {
        thr = max(thr, (*tr).cone * (*tr).t);
    }
    if (e.d < thr) {
        (*tr).hit = true;
        (*tr).mat = e.mat;
        (*tr).res = 0.0;
        return false;
    }
    if ((*tr).soft_k > 0.0 && (*tr).t > 0.0) {
        (*tr).res = pmin((*tr).res, (*tr).soft_k * e.d / (*tr).t);
    }
    (*tr).t += e.d * setting(SET_STEP_SCALE);
    return (*tr).t <= (*tr).tfar && (*tr).steps < (*tr).max_steps;
}

// a tracing step over an empty cell (packed.wgsl cell_find) to `t`: counted as a step, without a
// field value; false when the trace is done (a miss)
fn skip_step(tr: ptr<function, Trace>, t: f32) -> bool {
    (*tr).steps += 1u;
    (*tr).t = t;
    return (*tr).t <= (*tr).tfar && (*tr).steps < (*tr).max_steps;
}

fn ray_point(o: vec3<f32>, d: vec3<f32>, t: f32) -> vec3<f32> {
    return vec3<f32>(o.x + t * d.x, o.y + t * d.y, o.z + t * d.z);
}

// tap k of the tetrahedron gradient (shading.py's normal rule)
fn tetra(k: u32) -> vec3<f32> {
    if (k == 0u) {
        return vec3<f32>(1.0, -1.0, -1.0);
    }
    if (k == 1u) {
        return vec3<f32>(-1.0, -1.0, 1.0);
    }
    if (k == 2u) {
        return vec3<f32>(-1.0, 1.0, -1.0);
    }
    return vec3<f32>(1.0, 1.0, 1.0);
}

// whether another field evaluation fits this dispatch's budget (the first always does)
fn budget_allows(cost: u32) -> bool {
    return iters == 0u || iters + cost <= U.iter_budget;
}

const MARCH_DONE: u32 = 5u;   // march phases: 0 tracing, 1..4 gradient tap phase-1, 5 done

// primary ray: sphere-trace, then (on a hit) the 4 tetrahedron taps of the gradient
@compute @workgroup_size(WG)
fn march(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
         @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    let o = eye();
    let d = pixel_dir(i);
    let se = slab(o, d);
    var tr = Trace(se.x, se.y, 0u, u32(setting(SET_MAX_STEPS)), false, 0u, 1.0, 0.0, setting(SET_HIT_CONE));
    var g = vec3<f32>(0.0);
    var phase = select(MARCH_DONE, 0u, se.x <= se.y);
    if (U.resume != 0u) {
        phase = out_u[4u * i + 3u];
        if (phase == MARCH_DONE) {
            return;
        }
        tr.t = out_f[4u * i];
        tr.steps = out_u[4u * i];
        tr.mat = out_u[4u * i + 1u];
        tr.hit = out_u[4u * i + 2u] != 0u;
        g = vec3<f32>(out_f[4u * i + 1u], out_f[4u * i + 2u], out_f[4u * i + 3u]);
    }
    let neps = setting(SET_NORMAL_EPS);
    let skip = setting(SET_CELL_SKIP) != 0.0;
    var cost = U.n_instrs;
    while (phase < MARCH_DONE) {
        if (!budget_allows(cost)) {
            atomicAdd(&counters[COUNT_UNFINISHED], 1u);
            break;
        }
        var q = ray_point(o, d, tr.t);
        if (phase > 0u) {
            let k = tetra(phase - 1u);
            let hp = ray_point(o, d, tr.t);
            q = vec3<f32>(hp.x + neps * k.x, hp.y + neps * k.y, hp.z + neps * k.z);
        }
        let before = iters;
        let fs = trace_field(q, o, d, tr.t, phase == 0u && skip, tr.cone);
        if (fs.skip_to >= 0.0) {
            if (!skip_step(&tr, fs.skip_to)) {
                phase = MARCH_DONE;
            }
            continue;
        }
        let e = fs.e;
        cost = max(cost, iters - before);
        if (overflow) {
            note_overflow();
            phase = MARCH_DONE;
            tr.hit = false;
            break;
        }
        if (phase == 0u) {
            if (!trace_step(&tr, e)) {
                phase = select(MARCH_DONE, 1u, tr.hit);
            }
        } else {
            let k = tetra(phase - 1u);
            g = vec3<f32>(g.x + k.x * e.d, g.y + k.y * e.d, g.z + k.z * e.d);
            phase += 1u;
        }
    }
    if (phase == MARCH_DONE) {
        if (tr.hit) {
            g = g / (4.0 * neps);
        }
        out_f[4u * i] = select(inf(), tr.t, tr.hit);
    } else {
        out_f[4u * i] = tr.t;
    }
    out_f[4u * i + 1u] = g.x;
    out_f[4u * i + 2u] = g.y;
    out_f[4u * i + 3u] = g.z;
    out_u[4u * i] = tr.steps;
    out_u[4u * i + 1u] = tr.mat;
    out_u[4u * i + 2u] = u32(tr.hit);
    out_u[4u * i + 3u] = phase;
}

// the material of each hit: march runs without materials (WITH_MATERIALS off), so the field is
// evaluated once more, with them, at the march's final point (the point whose value was the hit)
@compute @workgroup_size(WG)
fn surface(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
           @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items || out_u[4u * i + 2u] == 0u) {
        return;
    }
    let e = field(ray_point(eye(), pixel_dir(i), out_f[4u * i]));
    if (overflow) {
        note_overflow();
    }
    out_u[4u * i + 1u] = e.mat;
}

const LIGHT_DONE: u32 = 6u;   // light phases: 0 shadow ray, 1..5 AO tap phase-1, 6 done
const AO_WEIGHT_SUM: f32 = 1.9375;   // 1 + 1/2 + 1/4 + 1/8 + 1/16, exact in float32

// key-light visibility by an occlusion march from p + 4 eps n, then 5-tap ambient occlusion
@compute @workgroup_size(WG)
fn light(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
         @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    let n_px = U.n_items;
    if (i >= n_px) {
        return;
    }
    let fo = 4u * n_px + 4u * i;
    let th = out_f[4u * i];
    if (!(th < inf())) {
        out_f[fo] = 1.0;
        out_f[fo + 1u] = 1.0;
        out_u[fo + 1u] = LIGHT_DONE;
        return;
    }
    let g = vec3<f32>(out_f[4u * i + 1u], out_f[4u * i + 2u], out_f[4u * i + 3u]);
    var gl = len3(g.x, g.y, g.z);
    if (!(gl > 0.0)) {
        gl = 1.0;
    }
    let nrm = g / gl;
    let eps4 = 4.0 * setting(SET_HIT_EPS);
    let o = eye();
    let d = pixel_dir(i);
    let ro = vec3<f32>(o.x + th * d.x + eps4 * nrm.x, o.y + th * d.y + eps4 * nrm.y,
                       o.z + th * d.z + eps4 * nrm.z);
    let key = setting3(SET_KEY_DIR);
    let mode = u32(setting(SET_SHADOW_MODE));
    let soft_k = select(0.0, setting(SET_SOFT_K), mode == SHADOW_SOFT);
    let ao_strength = setting(SET_AO_STRENGTH);
    let ao_dist = setting(SET_AO_DIST);
    var tr = Trace(0.0, slab(ro, key).y, 0u, u32(setting(SET_SHADOW_STEPS)), false, 0u, 1.0, soft_k, 0.0);
    var occ = 0.0;
    var phase = 0u;
    if (mode == SHADOW_OFF || !(tr.t <= tr.tfar)) {
        phase = select(LIGHT_DONE, 1u, ao_strength > 0.0);
    }
    if (U.resume != 0u) {
        phase = out_u[fo + 1u];
        if (phase == LIGHT_DONE) {
            return;
        }
        tr.t = out_f[fo + 2u];
        tr.res = out_f[fo + 3u];
        tr.steps = out_u[fo];
        tr.hit = out_u[fo + 2u] != 0u;
        occ = bitcast<f32>(out_u[fo + 3u]);
    }
    let skip = setting(SET_CELL_SKIP) != 0.0 && soft_k == 0.0;   // (a penumbra needs every step's value)
    var cost = U.n_instrs;
    while (phase < LIGHT_DONE) {
        if (!budget_allows(cost)) {
            atomicAdd(&counters[COUNT_UNFINISHED], 1u);
            break;
        }
        let h = ao_dist * f32(phase) / 5.0;
        var q = ray_point(ro, key, tr.t);
        if (phase > 0u) {
            q = vec3<f32>(ro.x - eps4 * nrm.x + h * nrm.x, ro.y - eps4 * nrm.y + h * nrm.y,
                          ro.z - eps4 * nrm.z + h * nrm.z);
        }
        let before = iters;
        let fs = trace_field(q, ro, key, tr.t, phase == 0u && skip, tr.cone);
        if (fs.skip_to >= 0.0) {
            if (!skip_step(&tr, fs.skip_to)) {
                phase = select(LIGHT_DONE, 1u, ao_strength > 0.0);
            }
            continue;
        }
        let e = fs.e;
        cost = max(cost, iters - before);
        if (overflow) {
            note_overflow();
            phase = LIGHT_DONE;
            break;
        }
        if (phase == 0u) {
            if (!trace_step(&tr, e)) {
                phase = select(LIGHT_DONE, 1u, ao_strength > 0.0);
            }
        } else {
            occ += ldexp(1.0, 1 - i32(phase)) * pmax(h - e.d, 0.0) / h;
            phase += 1u;
        }
    }
    if (phase == LIGHT_DONE) {
        var shadow = 1.0;
        if (mode != SHADOW_OFF) {
            shadow = select(pmax(pmin(tr.res, 1.0), 0.0), 0.0, tr.hit);
        }
        var ao = 1.0;
        if (ao_strength > 0.0) {
            ao = pmax(1.0 - ao_strength * occ / AO_WEIGHT_SUM, 0.0);
        }
        out_f[fo] = shadow;
        out_f[fo + 1u] = ao;
    }
    out_f[fo + 2u] = tr.t;
    out_f[fo + 3u] = tr.res;
    out_u[fo] = tr.steps;
    out_u[fo + 1u] = phase;
    out_u[fo + 2u] = u32(tr.hit);
    out_u[fo + 3u] = bitcast<u32>(occ);
}

// shading.heat: dark purple -> red -> yellow -> white, x in [0, 1]
fn heat(x_in: f32) -> vec3<f32> {
    var x = x_in;
    if (is_nan(x)) {
        x = 1.0;
    }
    x = clamp(x, 0.0, 1.0) * 4.0;
    let i = min(u32(x), 3u);
    let f = x - f32(i);
    var stops = array<vec3<f32>, 5>(vec3<f32>(0.05, 0.03, 0.20), vec3<f32>(0.45, 0.10, 0.55),
                                    vec3<f32>(0.90, 0.35, 0.20), vec3<f32>(1.00, 0.80, 0.30),
                                    vec3<f32>(1.00, 1.00, 0.90));
    return stops[i] * (1.0 - f) + stops[i + 1u] * f;
}

fn pow_pos(x: f32, y: f32) -> f32 {
    return select(0.0, pow(x, y), x > 0.0);
}

// the display colour of a marched pixel for every view but slice (shading.compose)
fn view_colour(i: u32, view: u32) -> vec3<f32> {
    let n_px = U.n_items;
    let hit = out_u[4u * i + 2u] != 0u;
    if (view == VIEW_STEPS) {
        return heat(f32(out_u[4u * i]) / setting(SET_MAX_STEPS));
    }
    if (!hit) {
        return setting3(SET_BACKGROUND);
    }
    let g = vec3<f32>(out_f[4u * i + 1u], out_f[4u * i + 2u], out_f[4u * i + 3u]);
    let glen = len3(g.x, g.y, g.z);
    let n = g / select(1.0, glen, glen > 0.0);
    if (view == VIEW_NORMALS) {
        return 0.5 + 0.5 * n;
    }
    if (view == VIEW_DEPTH) {
        let lo = setting3(SET_BOX_LO);
        let hi = setting3(SET_BOX_HI);
        let dist = length(eye() - (lo + hi) / 2.0);
        let rad = length(hi - lo) / 2.0;
        let near = max(dist - rad, 0.0);
        let far = dist + rad;
        let grey = 0.15 + 0.85 * (1.0 - clamp((out_f[4u * i] - near) / (far - near), 0.0, 1.0));
        return vec3<f32>(grey);
    }
    if (view == VIEW_GRADIENT) {
        let x = clamp(log2(select(1e-30, glen, glen > 0.0)), -1.0, 1.0);
        let green = vec3<f32>(0.2, 0.75, 0.3);
        let blue = vec3<f32>(0.2, 0.35, 0.95);
        let red = vec3<f32>(0.95, 0.25, 0.2);
        return select(green + (red - green) * x, green + (blue - green) * -x, x < 0.0);
    }
    // shade / section
    let n_mat = arrayLength(&materials);
    let mt = materials[min(out_u[4u * i + 1u], n_mat - 1u)];
    let base = mt.color;
    let rough = mt.roughness;
    let shadow = out_f[4u * n_px + 4u * i];
    let ao = out_f[4u * n_px + 4u * i + 1u];
    let key = setting3(SET_KEY_DIR);
    let fill = setting3(SET_FILL_DIR);
    let sky = setting3(SET_SKY_COLOR);
    let ground = setting3(SET_GROUND_COLOR);
    let key_col = setting3(SET_KEY_COLOR);
    let fill_col = setting3(SET_FILL_COLOR);
    let v = -pixel_dir(i);
    let amb = ground + (sky - ground) * (0.5 + 0.5 * n.z);
    let ndk = dot(n, key);
    let kd = max(ndk, 0.0) * shadow;
    let fd = max(dot(n, fill), 0.0);
    let hv = normalize(key + v);
    let shin = 2.0 + 126.0 * (1.0 - rough) * (1.0 - rough);
    var spec = setting(SET_SPECULAR) * (1.0 - rough) * pow_pos(max(dot(n, hv), 0.0), shin);
    if (!(ndk > 0.0)) {
        spec = 0.0;
    }
    let lin = base * (amb * ao + key_col * kd + fill_col * fd) + key_col * spec * shadow;
    let c = clamp(lin, vec3<f32>(0.0), vec3<f32>(1.0));
    return vec3<f32>(pow_pos(c.x, 1.0 / 2.2), pow_pos(c.y, 1.0 / 2.2), pow_pos(c.z, 1.0 / 2.2));
}

fn accumulate(i: u32, c: vec3<f32>) {
    if (U.sample == 0u) {
        accum[i] = vec4<f32>(c, 1.0);
    } else {
        accum[i] = accum[i] + vec4<f32>(c, 1.0);
    }
}

// colour of the marched pixels (after march, and light for shade / section) into the accumulator
@compute @workgroup_size(WG)
fn shade(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
         @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    accumulate(i, view_colour(i, u32(setting(SET_VIEW))));
}

// the slice view: the field where the pixel's ray meets the plane, contoured (shading.compose)
@compute @workgroup_size(WG)
fn slice(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
         @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    let o = eye();
    let d = pixel_dir(i);
    let pn = setting3(SET_PLANE_N);
    let lo = setting3(SET_BOX_LO);
    let hi = setting3(SET_BOX_HI);
    let denom = d.x * pn.x + d.y * pn.y + d.z * pn.z;
    let t = (setting(SET_PLANE_D) - (o.x * pn.x + o.y * pn.y + o.z * pn.z)) / denom;
    let p = vec3<f32>(o.x + t * d.x, o.y + t * d.y, o.z + t * d.z);
    let valid = t > 0.0 && t < inf() && all(p >= lo) && all(p <= hi);
    var c = setting3(SET_BACKGROUND);
    if (valid) {
        let f = eval_checked(p).d;
        let sp = max(setting(SET_CONTOUR_SPACING), 1e-12);
        let base = select(vec3<f32>(0.95, 0.62, 0.28), vec3<f32>(0.25, 0.45, 0.85), f < 0.0);
        c = base * (0.8 + 0.2 * cos(reduce_angle(TWO_PI * f / sp)));
        let q = f / sp;
        if (abs(q - round(q)) < 0.05) {
            c = c * 0.55;
        }
        if (abs(f) < 0.06 * sp) {
            c = vec3<f32>(0.0);
        }
    }
    accumulate(i, c);
}

// word i of an image as packed RGB bytes (pixel-major, 3 bytes a pixel, four bytes a word: the
// host reads 3n bytes and reshapes them, with no per-pixel copy): channel c of pixel p is
// accum[p][c] / divisor (divisor <= 0: accum[p].w), NaN -> 0, clamped to [0, 1], raised to
// `power` unless it is 1, rounded to nearest even (shading.to_rgb8)
fn rgb8_word(i: u32, n_bytes: u32, divisor: f32, power: f32) -> u32 {
    var word = 0u;
    for (var b = 0u; b < 4u; b++) {
        let q = 4u * i + b;
        if (q >= n_bytes) {
            break;
        }
        let a = accum[q / 3u];
        var v = a[q % 3u] / select(a.w, divisor, divisor > 0.0);
        if (is_nan(v)) {
            v = 0.0;
        }
        v = clamp(v, 0.0, 1.0);
        if (power != 1.0) {
            v = pow_pos(v, power);
        }
        word = word | (u32(round(v * 255.0)) << (8u * b));
    }
    return word;
}

// mean over the samples -> 8-bit RGB by shading.to_rgb8, after the march's words in out_u
@compute @workgroup_size(WG)
fn resolve(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
           @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    let n_bytes = 3u * U.n_items;
    if (4u * i >= n_bytes) {
        return;
    }
    out_u[8u * U.n_items + i] = rgb8_word(i, n_bytes, 0.0, 1.0);
}
