// The viewer's present pass: draws an image held as RGB bytes packed into 32-bit words (pixel i's
// channel c is byte 3 i + c, as the resolve kernel writes it) onto the window's texture, scaled
// to fill it (nearest pixel). One fixed pipeline for every scene; the image buffer is the GPU
// walker's output (no read-back) or the viewer's upload of a host image.

struct Present {
    image_size: vec2<u32>,    // the image's width, height in pixels
    target_size: vec2<u32>,   // the window texture's width, height
    first_word: u32,          // where the image starts in `words`
    pad0: u32,
    pad1: u32,
    pad2: u32,
};

@group(0) @binding(0) var<storage, read> words: array<u32>;
@group(0) @binding(1) var<uniform> present: Present;

@vertex
fn vs_main(@builtin(vertex_index) index: u32) -> @builtin(position) vec4<f32> {
    // one triangle covering the viewport
    let x = f32((index << 1u) & 2u) * 2.0 - 1.0;
    let y = f32(index & 2u) * 2.0 - 1.0;
    return vec4<f32>(x, y, 0.0, 1.0);
}

fn image_byte(b: u32) -> f32 {
    let word = words[present.first_word + b / 4u];
    return f32((word >> ((b % 4u) * 8u)) & 0xffu) / 255.0;
}

@fragment
fn fs_main(@builtin(position) frag: vec4<f32>) -> @location(0) vec4<f32> {
    let scale = vec2<f32>(present.image_size) / vec2<f32>(present.target_size);
    let px = min(vec2<u32>(frag.xy * scale), present.image_size - vec2<u32>(1u, 1u));
    let i = px.y * present.image_size.x + px.x;
    return vec4<f32>(image_byte(3u * i), image_byte(3u * i + 1u), image_byte(3u * i + 2u), 1.0);
}
