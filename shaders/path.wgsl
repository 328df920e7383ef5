// The path tracer's kernels (runtime/path_tracing.py: its module docstring states the integrator;
// the twin's _path_kernel there runs it on the same random numbers, and each function below
// mirrors the jitted function of the same name there). Concatenated after kernels_render.wgsl
// (camera_dir, eye, slab, Trace, trace_step, ray_point, tetra). One sample of a pixel: a jittered
// primary ray, sphere-traced through the tape (RenderSettings' march: hit_eps, step_scale,
// max_steps, the march box; a ray inside a glass traces the negated field); at a hit the material
// record's emission times the throughput is added, the normal taken by the tetrahedron taps
// (normal_eps); glass reflects or refracts (Fresnel), other materials take a light sample toward
// the environment or an emitter's cone (a shadow ray, MIS; the lights in the points buffer,
// path_tracing.light_data) and a BSDF sample (GGX lobe or Lambertian base); a ray that leaves
// the box or spends its steps sees the environment (constant, times a map's pixel). Russian
// roulette from bounce U.camera[1].w on; at most U.rect.w bounces.
// Fixed kernels (below: path_generate, path_trace, path_accumulate, path_tonemap), the paths'
// state in out_f / out_u between them; path_trace is resumable under U.iter_budget, so no path
// is refused for its length (one field evaluation past U.iter_cap still is, as the march's).
// Uniforms: U.n_items the wave's pixels, U.extra.y's bits its first pixel; U.sample the
// sample's index (path_tonemap: the samples accumulated); U.rect.xyz the environment's
// constant; U.extra.z the sequence's seed, U.extra.w the PATH_FLAG_* bits; U.camera[2].w's bits
// the paths' state's first word in out_u; with FIELD_CELLS (path_trace_cells), U.extra.x's bits
// the cells' descriptor word in points (packed.wgsl march_cells).
// accum[pixel] = (sum of the samples' radiance rgb, sum of the squares of their mean over rgb).

// PCG's output permutation of a 32-bit state (Jarzynski and Olano 2020, "pcg" hash)
fn pcg_hash(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

// Burley's (2020) Laine-Karras permutation of a bit-reversed word (path_tracing._laine_karras)
fn laine_karras(v: u32, seed: u32) -> u32 {
    var x = v + seed;
    x ^= x * 0x6c50b47cu;
    x ^= x * 0xb82f1e52u;
    x ^= x * 0xc7afe638u;
    x ^= x * 0x8d22f6e6u;
    return x;
}

// the second Sobol dimension of index i, bit-reversed (Pascal's triangle mod 2: a superset sum)
fn sobol1_reversed(v: u32) -> u32 {
    var i = v;
    i ^= (i >> 1u) & 0x55555555u;
    i ^= (i >> 2u) & 0x33333333u;
    i ^= (i >> 4u) & 0x0F0F0F0Fu;
    i ^= (i >> 8u) & 0x00FF00FFu;
    i ^= (i >> 16u) & 0x0000FFFFu;
    return i;
}

// Sobol dimension dim (0 or 1) of point index under hash-based Owen scrambling with seed
fn sobol_owen(index: u32, dim: u32, seed: u32) -> u32 {
    let z = select(index, sobol1_reversed(index), dim == 1u);
    return reverseBits(laine_karras(z, seed));
}

// the independent sampler (PathSettings.sampler "hash"): 24 bits of the chained PCG hash
fn hash_random(pixel: u32, bounce: u32, dim: u32) -> f32 {
    let h = pcg_hash(pcg_hash(pcg_hash(pcg_hash(u32(U.extra.z)) + 8u * bounce + dim) + U.sample) + pixel);
    return f32(h >> 8u) * 5.9604644775390625e-08;
}

// the random number in [0, 1) of (pixel, sample, bounce, dimension): dimension pairs of a
// scrambled, shuffled 2D Sobol sequence (path_tracing.path_random); 24 bits, exact in float32
fn path_random(pixel: u32, bounce: u32, dim: u32) -> f32 {
    if ((u32(U.extra.w) & PATH_FLAG_HASH) != 0u) {
        return hash_random(pixel, bounce, dim);
    }
    let pair = pcg_hash(pcg_hash(pcg_hash(u32(U.extra.z)) + 8u * bounce + (dim >> 1u)) + pixel);
    let index = reverseBits(laine_karras(reverseBits(U.sample), pair));
    let x = sobol_owen(index, dim & 1u, pcg_hash(pair + 1u + (dim & 1u)));
    return f32(x >> 8u) * 5.9604644775390625e-08;
}

// x t1 + y t2 + z n in the orthonormal basis (t1, t2, n) about the unit n (Duff et al. 2017)
fn frame_dir(n: vec3<f32>, x: f32, y: f32, z: f32) -> vec3<f32> {
    let s = select(-1.0, 1.0, n.z >= 0.0);
    let a = -1.0 / (s + n.z);
    let b = n.x * n.y * a;
    let t1 = vec3<f32>(1.0 + s * n.x * n.x * a, s * b, -s * n.x);
    let t2 = vec3<f32>(b, s + n.y * n.y * a, -n.y);
    return vec3<f32>(x * t1.x + y * t2.x + z * n.x, x * t1.y + y * t2.y + z * n.y,
                     x * t1.z + y * t2.z + z * n.z);
}

// a cosine-weighted direction about the unit normal n from (u1, u2)
fn cosine_dir(n: vec3<f32>, u1: f32, u2: f32) -> vec3<f32> {
    let r = sqrt(u1);
    let phi = TWO_PI * u2;
    return frame_dir(n, r * cos(phi), r * sin(phi), sqrt(max(1.0 - u1, 0.0)));
}

// a GGX microfacet normal about n drawn from D(h) cos(theta_h)
fn ggx_half(n: vec3<f32>, a2: f32, u1: f32, u2: f32) -> vec3<f32> {
    let c2 = (1.0 - u1) / (1.0 + (a2 - 1.0) * u1);
    let c = sqrt(c2);
    let s = sqrt(max(1.0 - c2, 0.0));
    let phi = TWO_PI * u2;
    return frame_dir(n, s * cos(phi), s * sin(phi), c);
}

// a uniform direction on the unit sphere
fn uniform_dir(u1: f32, u2: f32) -> vec3<f32> {
    let z = 1.0 - 2.0 * u1;
    let r = sqrt(max(1.0 - z * z, 0.0));
    let phi = TWO_PI * u2;
    return vec3<f32>(r * cos(phi), r * sin(phi), z);
}

fn smith_g1(c: f32, a2: f32) -> f32 {
    return 2.0 * c / (c + sqrt(a2 + (1.0 - a2) * c * c));
}

const PATH_PI: f32 = 3.1415927410125732;         // float32(pi)
const PATH_INV_PI: f32 = 0.31830987334251404;    // float32(1 / pi)
const PATH_INV_4PI: f32 = 0.07957746833562851;   // float32(1 / (4 pi)): the light sample's pdf
const PATH_ALPHA_MIN: f32 = 0.0020000000949949026;   // float32(0.002) (path_tracing.ALPHA_MIN)
const PATH_COS_MIN: f32 = 9.999999747378752e-05;     // float32(1e-4)

struct Lobes {
    kd: vec3<f32>,     // the Lambertian base's albedo
    f0: vec3<f32>,     // the GGX lobe's Fresnel at normal incidence
    f90: f32,          // ... and at grazing
    a2: f32,           // alpha^2
    ps: f32,           // the GGX lobe's sampling probability
}

// the material's lobes at view cosine co
fn lobes(mt: Material, co: f32) -> Lobes {
    let c = mt.color;
    let metal = mt.metallic;
    let spec = mt.specular;
    let f0d = 0.08 * spec;
    let w = 1.0 - co;
    let w5 = w * w * w * w * w;
    let kd_scale = (1.0 - metal) * (1.0 - (f0d + (spec - f0d) * w5));
    let f90 = spec + (1.0 - spec) * metal;
    let kd = vec3<f32>(c.x * kd_scale, c.y * kd_scale, c.z * kd_scale);
    let f0 = vec3<f32>(f0d + (c.x - f0d) * metal, f0d + (c.y - f0d) * metal, f0d + (c.z - f0d) * metal);
    var fs = pmax(f0.x, pmax(f0.y, f0.z));
    fs = fs + (f90 - fs) * w5;
    let fd = pmax(kd.x, pmax(kd.y, kd.z));
    var ps = 0.0;
    if (fs + fd > 0.0) {
        ps = fs / (fs + fd);
    }
    let a = pmax(mt.roughness * mt.roughness, PATH_ALPHA_MIN);
    return Lobes(kd, f0, f90, a * a, ps);
}

// (f rgb times cos(n, wi), the sampling pdf of wi) of an opaque material; zero below the surface
fn bsdf(mt: Material, n: vec3<f32>, o: vec3<f32>, i: vec3<f32>) -> vec4<f32> {
    let co = pmax(n.x * o.x + n.y * o.y + n.z * o.z, PATH_COS_MIN);
    let ci = n.x * i.x + n.y * i.y + n.z * i.z;
    if (!(ci > 0.0)) {
        return vec4<f32>(0.0);
    }
    let lb = lobes(mt, co);
    var h = vec3<f32>(o.x + i.x, o.y + i.y, o.z + i.z);
    let hl = sqrt(h.x * h.x + h.y * h.y + h.z * h.z);
    h = vec3<f32>(h.x / hl, h.y / hl, h.z / hl);
    let nh = pmax(n.x * h.x + n.y * h.y + n.z * h.z, 0.0);
    let vh = pmax(o.x * h.x + o.y * h.y + o.z * h.z, PATH_COS_MIN);
    let q = nh * nh * (lb.a2 - 1.0) + 1.0;
    let d = lb.a2 / (PATH_PI * q * q);
    let g = smith_g1(co, lb.a2) * smith_g1(ci, lb.a2);
    let w = 1.0 - vh;
    let w5 = w * w * w * w * w;
    let spec = d * g / (4.0 * co);
    let diff = ci * PATH_INV_PI;
    let pdf = (1.0 - lb.ps) * diff + lb.ps * d * nh / (4.0 * vh);
    return vec4<f32>(lb.kd.x * diff + spec * (lb.f0.x + (lb.f90 - lb.f0.x) * w5),
                     lb.kd.y * diff + spec * (lb.f0.y + (lb.f90 - lb.f0.y) * w5),
                     lb.kd.z * diff + spec * (lb.f0.z + (lb.f90 - lb.f0.z) * w5), pdf);
}

// a direction from the opaque material's sampling: the GGX lobe with its probability, else
// cosine-weighted
fn sample_bsdf(mt: Material, n: vec3<f32>, o: vec3<f32>, u0: f32, u1: f32, u2: f32) -> vec3<f32> {
    let co = pmax(n.x * o.x + n.y * o.y + n.z * o.z, PATH_COS_MIN);
    let lb = lobes(mt, co);
    if (u0 < lb.ps) {
        let h = ggx_half(n, lb.a2, u1, u2);
        let vh2 = 2.0 * (o.x * h.x + o.y * h.y + o.z * h.z);
        return vec3<f32>(vh2 * h.x - o.x, vh2 * h.y - o.y, vh2 * h.z - o.z);
    }
    return cosine_dir(n, u1, u2);
}

// the power heuristic's weight of a sample of pdf pa against another strategy's pb
fn power_weight(pa: f32, pb: f32) -> f32 {
    let a2 = pa * pa;
    return a2 / (a2 + pb * pb);
}

// (reflectance, cos of the refracted angle) at incidence cosine c >= 0, relative index eta
fn fresnel_dielectric(c: f32, eta: f32) -> vec2<f32> {
    let s2 = eta * eta * (1.0 - c * c);
    if (s2 >= 1.0) {
        return vec2<f32>(1.0, 0.0);
    }
    let ct = sqrt(1.0 - s2);
    let rs = (eta * c - ct) / (eta * c + ct);
    let rp = (c - eta * ct) / (c + eta * ct);
    return vec2<f32>(0.5 * (rs * rs + rp * rp), ct);
}

const PATH_DIM_JITTER: u32 = 0u;   // bounce 0: dimensions 0, 1: the primary ray's jitter
const PATH_DIM_BSDF: u32 = 0u;     // at a hit: 0, 1: the BSDF direction
const PATH_DIM_LIGHT: u32 = 2u;    // 2, 3: the light direction
const PATH_DIM_LOBE: u32 = 4u;     // 4: the lobe (glass: reflect or refract)
const PATH_DIM_ROULETTE: u32 = 5u; // 5: Russian roulette
const PATH_DIM_PICK: u32 = 6u;     // 6: the light sample's environment or emitter
// U.extra.w's bits (runtime/gpu.py path_samples)
const PATH_FLAG_LIGHT: u32 = 1u;   // light samples (PathSettings.light_samples)
const PATH_FLAG_HASH: u32 = 2u;    // the independent sampler (PathSettings.sampler "hash")

// The light samples' data (path_tracing.light_data) in the points buffer (light_word): [0] the
// number of emitters, [1] the environment's share of the light samples, [2] the environment
// map's width (0: none), [3] its height, [4] [5] [6] the offsets of its radiance (rgb rows),
// marginal CDF and conditional CDFs, [7] 1 where the map is importance sampled; from
// PATH_LIGHTS_HEADER the emitters' records of PATH_EMITTER_WORDS (bounding sphere centre xyz,
// radius, the probability of picking it, the sum of the probabilities up to it). The map's
// directions: runtime/environment.py.
const PATH_LIGHTS_HEADER: u32 = 8u;
const PATH_EMITTER_WORDS: u32 = 8u;
const PATH_TWO_PI: f32 = 6.2831854820251465;     // float32(2 pi)

// word k of the light data, which starts at U.camera[3].w's bits in points (after the cells'
// layout where path_trace_cells runs)
fn light_word(k: u32) -> f32 {
    return points[bitcast<u32>(U.camera[3].w) + k];
}

struct Cone {
    axis: vec3<f32>,
    c: f32,            // cos of the half angle; -2: the point lies in the sphere (all directions)
    omc: f32,          // 1 - c
}

// the cone from x that emitter k's bounding sphere subtends (path_tracing._cone)
fn cone(k: u32, x: vec3<f32>) -> Cone {
    let b = PATH_LIGHTS_HEADER + PATH_EMITTER_WORDS * k;
    let a = vec3<f32>(light_word(b) - x.x, light_word(b + 1u) - x.y, light_word(b + 2u) - x.z);
    let r = light_word(b + 3u);
    let d2 = a.x * a.x + a.y * a.y + a.z * a.z;
    if (!(d2 > r * r * 1.0001)) {
        return Cone(vec3<f32>(0.0, 0.0, 1.0), -2.0, 2.0);
    }
    let dl = sqrt(d2);
    let s2 = r * r / d2;
    let c = sqrt(1.0 - s2);
    return Cone(vec3<f32>(a.x / dl, a.y / dl, a.z / dl), c, s2 / (1.0 + c));
}

// (row, column, sin theta) of the environment map's pixel in direction d (path_tracing._env_pixel)
fn env_pixel(d: vec3<f32>) -> vec3<f32> {
    let w = u32(light_word(2));
    let h = u32(light_word(3));
    let z = pmin(pmax(d.z, -1.0), 1.0);
    let theta = acos(z);
    let phi = atan2(d.y, d.x);
    let row = min(u32(pmax(theta * PATH_INV_PI * f32(h), 0.0)), h - 1u);
    let col = min(u32(pmax((phi + PATH_PI) / PATH_TWO_PI * f32(w), 0.0)), w - 1u);
    return vec3<f32>(f32(row), f32(col), sqrt(pmax(1.0 - z * z, 0.0)));
}

// the environment's radiance in direction d: the constant U.rect.xyz, times the map's pixel
fn env_radiance(d: vec3<f32>) -> vec3<f32> {
    let env = U.rect.xyz;
    if (light_word(2) == 0.0) {
        return env;
    }
    let px = env_pixel(d);
    let b = u32(light_word(4)) + 3u * (u32(px.x) * u32(light_word(2)) + u32(px.y));
    return vec3<f32>(env.x * light_word(b), env.y * light_word(b + 1u), env.z * light_word(b + 2u));
}

// the environment light sample's pdf of direction d (path_tracing._env_pdf)
fn env_pdf(d: vec3<f32>) -> f32 {
    if (light_word(7) == 0.0) {
        return PATH_INV_4PI;
    }
    let w = u32(light_word(2));
    let h = u32(light_word(3));
    let px = env_pixel(d);
    if (!(px.z > 0.0)) {
        return 0.0;
    }
    let row = u32(px.x);
    let col = u32(px.y);
    let m = u32(light_word(5));
    let c = u32(light_word(6)) + row * (w + 1u);
    let p = (light_word(m + row + 1u) - light_word(m + row)) * (light_word(c + col + 1u) - light_word(c + col));
    return p * f32(w * h) / (2.0 * PATH_PI * PATH_PI * px.z);
}

// the i in [0, n) with cdf[i] <= u < cdf[i + 1] of the CDF at light words base .. base + n
fn cdf_find(base: u32, n: u32, u: f32) -> u32 {
    var lo = 0u;
    var hi = n;
    while (hi - lo > 1u) {
        let mid = (lo + hi) / 2u;
        if (light_word(base + mid) <= u) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// the environment light sample's direction (path_tracing._sample_env)
fn sample_env(u1: f32, u2: f32) -> vec3<f32> {
    if (light_word(7) == 0.0) {
        return uniform_dir(u1, u2);
    }
    let w = u32(light_word(2));
    let h = u32(light_word(3));
    let m = u32(light_word(5));
    let row = cdf_find(m, h, u1);
    let dv = (u1 - light_word(m + row)) / (light_word(m + row + 1u) - light_word(m + row));
    let c = u32(light_word(6)) + row * (w + 1u);
    let col = cdf_find(c, w, u2);
    let du = (u2 - light_word(c + col)) / (light_word(c + col + 1u) - light_word(c + col));
    let theta = (f32(row) + dv) / f32(h) * PATH_PI;
    let phi = (f32(col) + du) / f32(w) * PATH_TWO_PI - PATH_PI;
    let st = sin(theta);
    return vec3<f32>(st * cos(phi), st * sin(phi), cos(theta));
}

// the light sample's pdf of direction d from x (path_tracing._light_pdf)
fn light_pdf(x: vec3<f32>, d: vec3<f32>) -> f32 {
    let n = u32(light_word(0));
    let pe = light_word(1);
    let pdf = pe * env_pdf(d);
    if (n == 0u) {
        return pdf;
    }
    var cones = 0.0;
    for (var k = 0u; k < n; k++) {
        let cn = cone(k, x);
        let pk = light_word(PATH_LIGHTS_HEADER + PATH_EMITTER_WORDS * k + 4u);
        if (cn.c < -1.0) {
            cones += pk * PATH_INV_4PI;
        } else if (d.x * cn.axis.x + d.y * cn.axis.y + d.z * cn.axis.z >= cn.c) {
            cones += pk / (PATH_TWO_PI * cn.omc);
        }
    }
    return pdf + (1.0 - pe) * cones;
}

// a light sample's direction from x (path_tracing._sample_light)
fn sample_light(x: vec3<f32>, u0: f32, u1: f32, u2: f32) -> vec3<f32> {
    let n = u32(light_word(0));
    let pe = light_word(1);
    if (n == 0u || u0 < pe) {
        return sample_env(u1, u2);
    }
    let u = (u0 - pe) / (1.0 - pe);
    var k = 0u;
    while (k < n - 1u && !(u < light_word(PATH_LIGHTS_HEADER + PATH_EMITTER_WORDS * k + 5u))) {
        k += 1u;
    }
    let cn = cone(k, x);
    if (cn.c < -1.0) {
        return uniform_dir(u1, u2);
    }
    let ct = 1.0 - u1 * cn.omc;
    let st = sqrt(pmax(1.0 - ct * ct, 0.0));
    let phi = TWO_PI * u2;
    return frame_dir(cn.axis, st * cos(phi), st * sin(phi), ct);
}

// the MIS weight of the radiance a ray sees (the environment or an emission) when it left the
// surface at prev_p with BSDF pdf prev_pdf (0: no MIS) in direction d
fn seen_weight(prev_pdf: f32, prev_p: vec3<f32>, d: vec3<f32>) -> f32 {
    if (prev_pdf > 0.0) {
        return power_weight(prev_pdf, light_pdf(prev_p, d));
    }
    return 1.0;
}

// ---------------------------------------------------------------------------- the kernels
// A wave is U.n_items consecutive pixels from U.extra.y's bits (wave_base): slot s is pixel
// wave_base() + s. Each slot's path state (PathState) lives in out_f (PATH_F_WORDS floats from
// word PATH_F_WORDS s) and out_u (PATH_U_WORDS words from path_u_base() + PATH_U_WORDS s; the
// words before it hold the pruned cells' tapes where path_trace_cells marches on them) between
// the kernels: path_generate (every slot: the camera ray), then rounds of path_trace (the whole
// path: marches, taps, shading, shadow rays, until it ends or U.iter_budget would be passed; the
// next round goes on from the state) and path_accumulate (adds the paths that ended to accum,
// once, and counts the others in counters[COUNT_UNFINISHED]), until none is left; path_tonemap
// makes the picture of accum. One loop evaluates the field once per iteration for every phase
// of a path (its ray's march, the normal's taps, the shadow ray's march), so a SIMD group's
// lanes evaluate together whatever phase each is in.
const PATH_F_WORDS: u32 = 36u;     // runtime/gpu.py PATH_F_WORDS
const PATH_U_WORDS: u32 = 6u;      // runtime/gpu.py PATH_U_WORDS
const PF_O: u32 = 0u;              // out_f: the ray's origin
const PF_D: u32 = 3u;              // its direction
const PF_T: u32 = 6u;              // its trace's t
const PF_TFAR: u32 = 7u;           // ... and box exit
const PF_THR: u32 = 8u;            // the throughput
const PF_RAD: u32 = 11u;           // the radiance so far
const PF_HP: u32 = 14u;            // the hit point
const PF_G: u32 = 17u;             // the gradient's tap sum
const PF_SIDE: u32 = 20u;          // +1 outside the surface, -1 inside a glass
const PF_PREV_PDF: u32 = 21u;      // the BSDF pdf of the ray's direction at the hit it left (0: no MIS)
const PF_PREV_P: u32 = 22u;        // that hit
const PF_SO: u32 = 25u;            // the shadow ray's origin
const PF_SD: u32 = 28u;            // its direction
const PF_ST: u32 = 31u;            // its trace's t
const PF_STFAR: u32 = 32u;         // ... and box exit
const PF_SADD: u32 = 33u;          // the radiance it adds per unit of what it sees
const PU_PHASE: u32 = 0u;          // out_u: PATH_* below
const PU_STEPS: u32 = 1u;          // the trace's steps and material
const PU_MAT: u32 = 2u;
const PU_BOUNCE: u32 = 3u;         // hits so far
const PU_SSTEPS: u32 = 4u;         // the shadow ray's steps
const PU_GOES_ON: u32 = 5u;        // whether the path continues after its shadow ray
const PATH_TRACING: u32 = 0u;      // phases: 0 the ray's march, 1..4 the normal's tap phase-1,
const PATH_SHADOW: u32 = 5u;       // the shadow ray's march,
const PATH_DONE: u32 = 6u;         // ended (path_accumulate adds its radiance)
const PATH_ADDED: u32 = 7u;        // ... and added
const COUNT_PATH_PAUSES: u32 = 6u; // counters: path_trace invocations stopped by U.iter_budget

fn wave_base() -> u32 {
    return bitcast<u32>(U.extra.y);
}

// the first word of the paths' state in out_u (U.camera[2].w's bits)
fn path_u_base() -> u32 {
    return bitcast<u32>(U.camera[2].w);
}

struct PathState {
    o: vec3<f32>,
    d: vec3<f32>,
    thr: vec3<f32>,
    rad: vec3<f32>,
    hp: vec3<f32>,
    g: vec3<f32>,
    side: f32,
    prev_pdf: f32,
    prev_p: vec3<f32>,
    so: vec3<f32>,
    sd: vec3<f32>,
    s_add: vec3<f32>,
    phase: u32,
    bounce: u32,
    goes_on: bool,
}

fn pf3(s: u32, w: u32) -> vec3<f32> {
    let b = PATH_F_WORDS * s + w;
    return vec3<f32>(out_f[b], out_f[b + 1u], out_f[b + 2u]);
}

fn set_pf3(s: u32, w: u32, v: vec3<f32>) {
    let b = PATH_F_WORDS * s + w;
    out_f[b] = v.x;
    out_f[b + 1u] = v.y;
    out_f[b + 2u] = v.z;
}

fn pu(s: u32, w: u32) -> u32 {
    return out_u[path_u_base() + PATH_U_WORDS * s + w];
}

fn set_pu(s: u32, w: u32, v: u32) {
    out_u[path_u_base() + PATH_U_WORDS * s + w] = v;
}

// a fresh trace of a ray through the march box (the box's entry and exit)
fn path_trace_from(se: vec2<f32>) -> Trace {
    return Trace(se.x, se.y, 0u, u32(setting(SET_MAX_STEPS)), false, 0u, 1.0, 0.0, 0.0);
}

// slot s's state: the path, its ray's trace and its shadow ray's
fn load_path(s: u32, st: ptr<function, PathState>, tr: ptr<function, Trace>, ts: ptr<function, Trace>) {
    let b = PATH_F_WORDS * s;
    *st = PathState(pf3(s, PF_O), pf3(s, PF_D), pf3(s, PF_THR), pf3(s, PF_RAD), pf3(s, PF_HP), pf3(s, PF_G),
                    out_f[b + PF_SIDE], out_f[b + PF_PREV_PDF], pf3(s, PF_PREV_P), pf3(s, PF_SO), pf3(s, PF_SD),
                    pf3(s, PF_SADD), pu(s, PU_PHASE), pu(s, PU_BOUNCE), pu(s, PU_GOES_ON) != 0u);
    *tr = path_trace_from(vec2<f32>(out_f[b + PF_T], out_f[b + PF_TFAR]));
    (*tr).steps = pu(s, PU_STEPS);
    (*tr).mat = pu(s, PU_MAT);
    *ts = path_trace_from(vec2<f32>(out_f[b + PF_ST], out_f[b + PF_STFAR]));
    (*ts).steps = pu(s, PU_SSTEPS);
}

fn save_path(s: u32, st: PathState, tr: Trace, ts: Trace) {
    let b = PATH_F_WORDS * s;
    set_pf3(s, PF_O, st.o);
    set_pf3(s, PF_D, st.d);
    set_pf3(s, PF_THR, st.thr);
    set_pf3(s, PF_RAD, st.rad);
    set_pf3(s, PF_HP, st.hp);
    set_pf3(s, PF_G, st.g);
    out_f[b + PF_SIDE] = st.side;
    out_f[b + PF_PREV_PDF] = st.prev_pdf;
    set_pf3(s, PF_PREV_P, st.prev_p);
    set_pf3(s, PF_SO, st.so);
    set_pf3(s, PF_SD, st.sd);
    set_pf3(s, PF_SADD, st.s_add);
    out_f[b + PF_T] = tr.t;
    out_f[b + PF_TFAR] = tr.tfar;
    out_f[b + PF_ST] = ts.t;
    out_f[b + PF_STFAR] = ts.tfar;
    set_pu(s, PU_PHASE, st.phase);
    set_pu(s, PU_STEPS, tr.steps);
    set_pu(s, PU_MAT, tr.mat);
    set_pu(s, PU_BOUNCE, st.bounce);
    set_pu(s, PU_SSTEPS, ts.steps);
    set_pu(s, PU_GOES_ON, u32(st.goes_on));
}

// the camera ray of slot s's pixel through a jittered point of it
@compute @workgroup_size(WG)
fn path_generate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
                 @builtin(num_workgroups) nwg: vec3<u32>) {
    let s = flat_index(wid, lid, nwg);
    if (s >= U.n_items) {
        return;
    }
    let i = wave_base() + s;
    let z = vec3<f32>(0.0);
    let o = eye();
    let d = camera_dir(f32(i % U.width) + path_random(i, 0u, PATH_DIM_JITTER),
                       f32(i / U.width) + path_random(i, 0u, PATH_DIM_JITTER + 1u));
    let se = slab(o, d);
    var st = PathState(o, d, vec3<f32>(1.0), z, z, z, 1.0, 0.0, z, z, z, z, PATH_TRACING, 0u, false);
    if (!(se.x <= se.y)) {
        st.rad = env_radiance(d);
        st.phase = PATH_DONE;
    }
    save_path(s, st, path_trace_from(se), path_trace_from(vec2<f32>(0.0)));
}

// the hit whose normal's taps are summed in st.g: its emission, then (below the bounce limit)
// glass's reflection or refraction, or an opaque material's light sample (the shadow ray, traced
// next) and BSDF sample; roulette; the next ray (tr). A normal of zero length ends the path.
fn shade_hit(st: ptr<function, PathState>, tr: ptr<function, Trace>, ts: ptr<function, Trace>, i: u32) {
    let max_bounces = u32(U.rect.w);
    let rr_from = u32(U.camera[1].w);
    let light_samples = (u32(U.extra.w) & PATH_FLAG_LIGHT) != 0u;
    let eps4 = 4.0 * setting(SET_HIT_EPS);
    let neps = setting(SET_NORMAL_EPS);
    let g = (*st).g / (4.0 * neps);
    let gl = len3(g.x, g.y, g.z);
    (*st).phase = PATH_DONE;
    if (!(gl > 0.0)) {
        return;
    }
    let n = g / gl;
    let mt = materials[min((*tr).mat, arrayLength(&materials) - 1u)];
    let hp = (*st).hp;
    var thr = (*st).thr;
    if (mt.emission.x + mt.emission.y + mt.emission.z > 0.0) {
        (*st).rad += thr * mt.emission * seen_weight((*st).prev_pdf, (*st).prev_p, (*st).d);
    }
    let bounce = (*st).bounce + 1u;
    (*st).bounce = bounce;
    if (bounce >= max_bounces) {
        return;
    }
    let wo = -(*st).d;
    let u0 = path_random(i, bounce, PATH_DIM_LOBE);
    let u1 = path_random(i, bounce, PATH_DIM_BSDF);
    let u2 = path_random(i, bounce, PATH_DIM_BSDF + 1u);
    var has_shadow = false;
    var goes_on = false;
    var d = (*st).d;
    if (mt.transmission == 1.0) {        // smooth glass
        var c = n.x * wo.x + n.y * wo.y + n.z * wo.z;
        let sg = select(-1.0, 1.0, c > 0.0);
        let eta = select(mt.ior, 1.0 / mt.ior, c > 0.0);
        let m = vec3<f32>(sg * n.x, sg * n.y, sg * n.z);
        c = sg * c;
        let fr = fresnel_dielectric(c, eta);
        var off = eps4;
        if (u0 < fr.x) {
            let c2 = 2.0 * c;
            d = vec3<f32>(c2 * m.x - wo.x, c2 * m.y - wo.y, c2 * m.z - wo.z);
            (*st).side = sg;
        } else {
            let kt = eta * c - fr.y;
            d = vec3<f32>(kt * m.x - eta * wo.x, kt * m.y - eta * wo.y, kt * m.z - eta * wo.z);
            off = -eps4;
            (*st).side = -sg;
            thr = thr * mt.color;
        }
        (*st).o = vec3<f32>(hp.x + off * m.x, hp.y + off * m.y, hp.z + off * m.z);
        (*st).prev_pdf = 0.0;
        goes_on = true;
    } else {
        if (light_samples) {
            let l = sample_light(hp, path_random(i, bounce, PATH_DIM_PICK), path_random(i, bounce, PATH_DIM_LIGHT),
                                 path_random(i, bounce, PATH_DIM_LIGHT + 1u));
            let fl = bsdf(mt, n, wo, l);
            let pl = light_pdf(hp, l);
            if (fl.w > 0.0 && pl > 0.0) {
                let w = power_weight(pl, fl.w) / pl;
                (*st).s_add = vec3<f32>(thr.x * fl.x * w, thr.y * fl.y * w, thr.z * fl.z * w);
                (*st).so = vec3<f32>(hp.x + eps4 * n.x, hp.y + eps4 * n.y, hp.z + eps4 * n.z);
                (*st).sd = l;
                *ts = path_trace_from(slab((*st).so, l));
                has_shadow = true;
            }
        }
        d = sample_bsdf(mt, n, wo, u0, u1, u2);
        let fb = bsdf(mt, n, wo, d);
        goes_on = fb.w > 0.0;
        if (goes_on) {
            thr = vec3<f32>(thr.x * (fb.x / fb.w), thr.y * (fb.y / fb.w), thr.z * (fb.z / fb.w));
            (*st).prev_pdf = select(0.0, fb.w, light_samples);
            (*st).prev_p = hp;
            (*st).side = 1.0;
            (*st).o = vec3<f32>(hp.x + eps4 * n.x, hp.y + eps4 * n.y, hp.z + eps4 * n.z);
        }
    }
    if (goes_on) {
        var keep = pmax(thr.x, pmax(thr.y, thr.z));
        goes_on = keep > 0.0;
        if (goes_on && bounce >= rr_from) {
            keep = pmin(keep, 0.95);
            goes_on = path_random(i, bounce, PATH_DIM_ROULETTE) < keep;
            if (goes_on) {
                thr = thr / keep;
            }
        }
    }
    (*st).d = d;
    (*st).thr = thr;
    if (goes_on) {
        let se = slab((*st).o, d);
        *tr = path_trace_from(se);
        if (!(se.x <= se.y)) {         // (leaves the box at once: the environment)
            (*st).rad += thr * env_radiance(d) * seen_weight((*st).prev_pdf, (*st).prev_p, d);
            goes_on = false;
        }
    }
    (*st).goes_on = goes_on;
    if (has_shadow && (*ts).t <= (*ts).tfar) {
        (*st).phase = PATH_SHADOW;     // (then PATH_TRACING if the path goes on)
        return;
    }
    if (has_shadow) {
        (*st).rad += (*st).s_add * env_radiance((*st).sd);   // (the shadow ray misses the box: unoccluded)
    }
    (*st).phase = select(PATH_DONE, PATH_TRACING, goes_on);
}

// slot s's path from its state to its end: one field evaluation per loop iteration, whichever
// phase (the interpreter inlined once); where the next would pass U.iter_budget the state is
// saved and the next round goes on from it. A ray that leaves the box or spends its steps sees
// the environment (and ends the path); a shadow ray adds the environment or the emission it hits.
@compute @workgroup_size(WG)
fn path_trace(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let s = flat_index(wid, lid, nwg);
    if (s >= U.n_items || pu(s, PU_PHASE) >= PATH_DONE) {
        return;
    }
    let i = wave_base() + s;
    let neps = setting(SET_NORMAL_EPS);
    var st: PathState;
    var tr: Trace;
    var ts: Trace;
    load_path(s, &st, &tr, &ts);
    var cost = U.n_instrs;
    while (st.phase < PATH_DONE) {
        if (!budget_allows(cost)) {
            atomicAdd(&counters[COUNT_PATH_PAUSES], 1u);
            break;
        }
        var q = ray_point(st.o, st.d, tr.t);
        if (st.phase == PATH_SHADOW) {
            q = ray_point(st.so, st.sd, ts.t);
        } else if (st.phase > PATH_TRACING) {
            let k = tetra(st.phase - 1u);
            q = vec3<f32>(st.hp.x + neps * k.x, st.hp.y + neps * k.y, st.hp.z + neps * k.z);
        }
        let before = iters;
        var e = field(q);
        cost = max(cost, iters - before);
        if (overflow) {
            note_overflow();
            st.rad = vec3<f32>(nan());
            st.phase = PATH_DONE;
            break;
        }
        if (st.phase == PATH_SHADOW) {
            if (!trace_step(&ts, e)) {
                if (!ts.hit) {
                    st.rad += st.s_add * env_radiance(st.sd);
                } else {
                    st.rad += st.s_add * materials[min(ts.mat, arrayLength(&materials) - 1u)].emission;
                }
                st.phase = select(PATH_DONE, PATH_TRACING, st.goes_on);
            }
            continue;
        }
        if (st.phase == PATH_TRACING) {
            e.d = st.side * e.d;
            if (!trace_step(&tr, e)) {
                if (tr.hit) {
                    st.hp = ray_point(st.o, st.d, tr.t);
                    st.g = vec3<f32>(0.0);
                    st.phase = 1u;
                } else {
                    st.rad += st.thr * env_radiance(st.d) * seen_weight(st.prev_pdf, st.prev_p, st.d);
                    st.phase = PATH_DONE;
                }
            }
            continue;
        }
        let k = tetra(st.phase - 1u);
        st.g = vec3<f32>(st.g.x + k.x * e.d, st.g.y + k.y * e.d, st.g.z + k.z * e.d);
        st.phase += 1u;
        if (st.phase == PATH_SHADOW) {
            shade_hit(&st, &tr, &ts, i);
        }
    }
    save_path(s, st, tr, ts);
}

// the paths that ended since the last accumulation: accum[pixel] += (radiance rgb, the square
// of its mean over rgb), each path once; the paths still going are counted in
// counters[COUNT_UNFINISHED] (the host zeroes it first, and stops when none is)
@compute @workgroup_size(WG)
fn path_accumulate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    let s = flat_index(wid, lid, nwg);
    if (s >= U.n_items) {
        return;
    }
    let phase = pu(s, PU_PHASE);
    if (phase < PATH_DONE) {
        atomicAdd(&counters[COUNT_UNFINISHED], 1u);
    }
    if (phase != PATH_DONE) {
        return;
    }
    let rad = pf3(s, PF_RAD);
    let y = (rad.x + rad.y + rad.z) / 3.0;
    let i = wave_base() + s;
    accum[i] = accum[i] + vec4<f32>(rad, y * y);
    set_pu(s, PU_PHASE, PATH_ADDED);
}

// the picture of accum over U.sample samples (U.n_items pixels): the mean radiance clamped to
// [0, 1], gamma 1/2.2, rounded (rgb8_word); packed RGB bytes four a word into out_u from word 0
@compute @workgroup_size(WG)
fn path_tonemap(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    let n_bytes = 3u * U.n_items;
    if (4u * i >= n_bytes) {
        return;
    }
    out_u[i] = rgb8_word(i, n_bytes, f32(U.sample), 1.0 / 2.2);
}
