// Point kernels: distance + material at points, central-difference gradients, the 2D field image.
// Mirrors CpuWalker.evaluate / gradient / field_image (runtime/cpu.py).

@compute @workgroup_size(WG)
fn eval_points(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    let e = run_tape(vec3<f32>(points[3u * i], points[3u * i + 1u], points[3u * i + 2u]));
    out_f[i] = e.d;
    out_u[i] = e.mat;
}

// (f(p + e a) - f(p - e a)) / (2 e) per axis a, e = U.extra.y
@compute @workgroup_size(WG)
fn gradient_points(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    let p = vec3<f32>(points[3u * i], points[3u * i + 1u], points[3u * i + 2u]);
    let e = U.extra.y;
    var taps: array<f32, 6>;
    for (var k = 0u; k < 6u; k++) {
        var q = p;
        q[k % 3u] = q[k % 3u] + select(e, -e, k >= 3u);
        taps[k] = run_tape(q).d;
    }
    let two_e = 2.0 * e;
    for (var a = 0u; a < 3u; a++) {
        out_f[3u * i + a] = (taps[a] - taps[a + 3u]) / two_e;
    }
}

// the field on the plane z = U.extra.x over rect (x0 x1 y0 y1), pixel centres, row 0 at y1
@compute @workgroup_size(WG)
fn field_image(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    let row = f32(i / U.width);
    let col = f32(i % U.width);
    let r = U.rect;
    let x = r.x + (col + 0.5) / f32(U.width) * (r.y - r.x);
    let y = r.w - (row + 0.5) / f32(U.height) * (r.w - r.z);
    out_f[i] = run_tape(vec3<f32>(x, y, U.extra.x)).d;
}
