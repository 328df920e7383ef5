// The one bind group every kernel shares (runtime/gpu.py creates its layout once), the per-dispatch
// uniforms, and small helpers that mirror Python's scalar min / max (runtime/cpu.py's choices).
// Needs generated_tape.wgsl and generated_render.wgsl before it.

struct Uniforms {
    n_instrs: u32,     // instructions in the tape
    n_items: u32,      // points (evaluate / gradient) or pixels (images)
    width: u32,        // image width in pixels (images)
    height: u32,       // image height in pixels (images)
    sample: u32,       // accumulate: index of this sample (0 clears the accumulator)
    iter_cap: u32,     // loop iterations one invocation may run (run_tape stops there: overflow)
    iter_budget: u32,  // iterations after which march / light save their state for the next dispatch
    resume: u32,       // march / light: 0 starts every pixel, 1 continues the saved ones
    rect: vec4<f32>,   // field image: x0 x1 y0 y1
    extra: vec4<f32>,  // field image z, gradient eps, sample jitter x, jitter y (pixels)
    camera: array<vec4<f32>, CAMERA_VEC4S>,      // runtime.camera.Camera.pack()
    settings: array<vec4<f32>, SETTINGS_VEC4S>,  // runtime.shading.RenderSettings.pack()
}

@group(0) @binding(0) var<storage, read> instrs: array<Instr>;
@group(0) @binding(1) var<storage, read> params: array<f32>;
@group(0) @binding(2) var<storage, read> materials: array<Material>;
@group(0) @binding(3) var<storage, read> instances: array<Instance>;
@group(0) @binding(4) var<storage, read> bvh: array<Bvh>;
@group(0) @binding(5) var<uniform> U: Uniforms;
@group(0) @binding(6) var<storage, read> points: array<f32>;           // xyz per point
@group(0) @binding(7) var<storage, read_write> out_f: array<f32>;
@group(0) @binding(8) var<storage, read_write> out_u: array<u32>;
@group(0) @binding(9) var<storage, read_write> accum: array<vec4<f32>>;
// [COUNT_OVERFLOW] invocations whose tape evaluation hit U.iter_cap; [COUNT_UNFINISHED] pixels
// that saved their state for another dispatch; words 2 to 5: the pruning passes' arena pointer
// and refusals, the most registers a finest tile's pruned tape uses and the pixels refused for
// a tape needing more registers than their pipeline holds (prune.wgsl COUNT_ARENA ...
// COUNT_REGS_REFUSED); 6: the path tracer's traces stopped by U.iter_budget (path.wgsl
// COUNT_PATH_PAUSES); 7 to 15 unused
@group(0) @binding(10) var<storage, read_write> counters: array<atomic<u32>, 16>;

const COUNT_OVERFLOW: u32 = 0u;
const COUNT_UNFINISHED: u32 = 1u;

fn note_overflow() {
    atomicAdd(&counters[COUNT_OVERFLOW], 1u);
}

const WG: u32 = 64u;               // workgroup size of every kernel

// +inf (WGSL has no literal for it and rejects it in constant expressions)
fn inf() -> f32 {
    return bitcast<f32>(0x7f800000u);
}

// a quiet NaN (no literal either)
fn nan() -> f32 {
    return bitcast<f32>(0x7fc00000u);
}

// NaN test by the bits: `x != x` compiles to an ordered compare (always false) through naga
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// a value of the packed render settings (offsets SET_* from generated_render.wgsl)
fn setting(i: u32) -> f32 {
    return U.settings[i >> 2u][i & 3u];
}

fn setting3(i: u32) -> vec3<f32> {
    return vec3<f32>(setting(i), setting(i + 1u), setting(i + 2u));
}

// Python's builtin max(a, b) / min(a, b) (what the twin's scalar code uses): b only when strictly
// greater / smaller, so a NaN in b yields a and a NaN in a stays.
fn pmax(a: f32, b: f32) -> f32 {
    return select(a, b, b > a);
}

fn pmin(a: f32, b: f32) -> f32 {
    return select(a, b, b < a);
}

// the twin's _fmin / _fmax: numpy's NaN-propagating minimum / maximum
fn nmin(a: f32, b: f32) -> f32 {
    return select(a, b, b < a || is_nan(b));
}

fn nmax(a: f32, b: f32) -> f32 {
    return select(a, b, b > a || is_nan(b));
}

// the flat invocation index of a 2D dispatch of WG-wide workgroups
// pixel centres of the 2D field images over U.rect (x0 x1 y0 y1): column 0 at x0, row 0 at y1
// (y up), as CpuWalker.field_image
fn pixel_x(col: u32) -> f32 {
    let r = U.rect;
    return r.x + (f32(col) + 0.5) / f32(U.width) * (r.y - r.x);
}

fn pixel_y(row: u32) -> f32 {
    let r = U.rect;
    return r.w - (f32(row) + 0.5) / f32(U.height) * (r.w - r.z);
}

fn flat_index(wid: vec3<u32>, lid: u32, nwg: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * WG + lid;
}
