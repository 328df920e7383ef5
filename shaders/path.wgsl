// The path tracer's kernel (runtime/path_tracing.py; the twin's _path_kernel there runs the same
// integrator on the same random numbers). Concatenated after kernels_render.wgsl (camera_dir,
// eye, slab, Trace, trace_step, ray_point, tetra). One invocation traces one sample of pixel i:
// a jittered primary ray, sphere-traced through the tape (RenderSettings' march: hit_eps,
// step_scale, max_steps, the march box); at a hit the material's emission times the throughput
// is added, the normal taken by the tetrahedron taps (normal_eps), the throughput times the
// material's colour (a diffuse, Lambertian surface: the
// cosine-weighted bounce's weight is the albedo), a cosine-weighted bounce from p + 4 hit_eps n;
// a ray that leaves the box or spends its steps sees the constant environment. Russian roulette
// from bounce U.extra.x on (survival max(throughput) capped at 0.95, the survivors divided by
// it); at most U.rect.w bounces (the path ends after them, absorbed).
// Uniforms: U.sample the sample's index; U.rect.xyz the environment's radiance; U.extra.y the
// first sample of this accumulation (it clears accum), U.extra.z the sequence's seed.
// points[3 m ..]: material m's emitted radiance rgb (PathSettings.emission_table).
// accum[i] = (sum of the samples' radiance rgb, sum of the squares of their mean over rgb).
// One field evaluation per loop iteration (phase 0 tracing, 1..4 the gradient's taps), so the
// interpreter is inlined once. Not resumable: a path whose evaluations pass U.iter_cap counts an
// overflow (the host refuses the image).

// PCG's output permutation of a 32-bit state (Jarzynski and Olano 2020, "pcg" hash)
fn pcg_hash(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

// the random number in [0, 1) of (pixel, sample, bounce, dimension): 24 bits, exact in float32
fn path_random(pixel: u32, bounce: u32, dim: u32) -> f32 {
    let h = pcg_hash(pcg_hash(pcg_hash(pcg_hash(u32(U.extra.z)) + 8u * bounce + dim) + U.sample) + pixel);
    return f32(h >> 8u) * 5.9604644775390625e-08;
}

// a cosine-weighted direction about the unit normal n from (u1, u2) (orthonormal basis of Duff
// et al. 2017)
fn cosine_dir(n: vec3<f32>, u1: f32, u2: f32) -> vec3<f32> {
    let s = select(-1.0, 1.0, n.z >= 0.0);
    let a = -1.0 / (s + n.z);
    let b = n.x * n.y * a;
    let t1 = vec3<f32>(1.0 + s * n.x * n.x * a, s * b, -s * n.x);
    let t2 = vec3<f32>(b, s + n.y * n.y * a, -n.y);
    let r = sqrt(u1);
    let phi = TWO_PI * u2;
    let x = r * cos(phi);
    let y = r * sin(phi);
    let z = sqrt(max(1.0 - u1, 0.0));
    return vec3<f32>(x * t1.x + y * t2.x + z * n.x, x * t1.y + y * t2.y + z * n.y,
                     x * t1.z + y * t2.z + z * n.z);
}

const PATH_DIM_JITTER: u32 = 0u;   // dimensions 0, 1: the primary ray's jitter (bounce 0)
const PATH_DIM_BOUNCE: u32 = 2u;   // 2, 3: the bounce direction
const PATH_DIM_ROULETTE: u32 = 4u; // 4: Russian roulette

@compute @workgroup_size(WG)
fn path(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    let env = U.rect.xyz;
    let max_bounces = u32(U.rect.w);
    let rr_from = u32(U.extra.x);
    let eps4 = 4.0 * setting(SET_HIT_EPS);
    let neps = setting(SET_NORMAL_EPS);
    let max_steps = u32(setting(SET_MAX_STEPS));
    let n_mat = arrayLength(&materials);
    var o = eye();
    var d = camera_dir(f32(i % U.width) + path_random(i, 0u, PATH_DIM_JITTER),
                       f32(i / U.width) + path_random(i, 0u, PATH_DIM_JITTER + 1u));
    var se = slab(o, d);
    var tr = Trace(se.x, se.y, 0u, max_steps, false, 0u, 1.0, 0.0, 0.0);
    var thr = vec3<f32>(1.0);
    var rad = vec3<f32>(0.0);
    var bounce = 0u;
    var phase = 0u;
    var hp = vec3<f32>(0.0);
    var g = vec3<f32>(0.0);
    var alive = se.x <= se.y;
    if (!alive) {
        rad = env;
    }
    while (alive) {
        var q = ray_point(o, d, tr.t);
        if (phase > 0u) {
            let k = tetra(phase - 1u);
            q = vec3<f32>(hp.x + neps * k.x, hp.y + neps * k.y, hp.z + neps * k.z);
        }
        let e = field(q);
        if (overflow) {
            note_overflow();
            rad = vec3<f32>(nan());
            break;
        }
        if (phase == 0u) {
            if (!trace_step(&tr, e)) {
                if (tr.hit) {
                    hp = ray_point(o, d, tr.t);
                    g = vec3<f32>(0.0);
                    phase = 1u;
                } else {
                    rad += thr * env;
                    alive = false;
                }
            }
            continue;
        }
        let k = tetra(phase - 1u);
        g = vec3<f32>(g.x + k.x * e.d, g.y + k.y * e.d, g.z + k.z * e.d);
        phase += 1u;
        if (phase < 5u) {
            continue;
        }
        // the hit's bounce: the gradient's direction is the normal (none: the path ends)
        g = g / (4.0 * neps);
        let gl = len3(g.x, g.y, g.z);
        if (!(gl > 0.0)) {
            break;
        }
        let n = g / gl;
        let m = min(tr.mat, n_mat - 1u);
        rad += thr * vec3<f32>(points[3u * m], points[3u * m + 1u], points[3u * m + 2u]);
        thr = thr * materials[m].color;
        bounce += 1u;
        if (bounce >= max_bounces) {
            break;
        }
        if (bounce >= rr_from) {
            let keep = min(max(thr.x, max(thr.y, thr.z)), 0.95);
            if (!(path_random(i, bounce, PATH_DIM_ROULETTE) < keep)) {
                break;
            }
            thr = thr / keep;
        }
        o = vec3<f32>(hp.x + eps4 * n.x, hp.y + eps4 * n.y, hp.z + eps4 * n.z);
        d = cosine_dir(n, path_random(i, bounce, PATH_DIM_BOUNCE), path_random(i, bounce, PATH_DIM_BOUNCE + 1u));
        se = slab(o, d);
        tr = Trace(se.x, se.y, 0u, max_steps, false, 0u, 1.0, 0.0, 0.0);
        phase = 0u;
        if (!(se.x <= se.y)) {
            rad += thr * env;
            alive = false;
        }
    }
    let y = (rad.x + rad.y + rad.z) / 3.0;
    let add = vec4<f32>(rad, y * y);
    if (U.sample == u32(U.extra.y)) {
        accum[i] = add;
    } else {
        accum[i] = accum[i] + add;
    }
}
