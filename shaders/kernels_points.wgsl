// Point kernels: distance + material at points, the taps of central-difference gradients, the 2D
// field image. Mirrors CpuWalker.evaluate / gradient / field_image (runtime/cpu.py). One tape
// evaluation per invocation (a software rasteriser's loop limit then bounds only the tape).

@compute @workgroup_size(WG)
fn eval_points(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    let e = eval_checked(vec3<f32>(points[3u * i], points[3u * i + 1u], points[3u * i + 2u]));
    out_f[i] = e.d;
    out_u[i] = e.mat;
}

// tap i % 6 of point i / 6: f(p + e a) for a = x, y, z, then f(p - e a); e = U.extra.y. The host
// forms (f(p + e a) - f(p - e a)) / (2 e), as the twin does.
@compute @workgroup_size(WG)
fn gradient_points(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
                   @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    let j = i / 6u;
    let k = i % 6u;
    var q = vec3<f32>(points[3u * j], points[3u * j + 1u], points[3u * j + 2u]);
    let e = U.extra.y;
    q[k % 3u] = q[k % 3u] + select(e, -e, k >= 3u);
    out_f[i] = eval_checked(q).d;
}

// the field on the plane z = U.extra.x over rect (x0 x1 y0 y1), pixel centres, row 0 at y1
@compute @workgroup_size(WG)
fn field_image(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    out_f[i] = eval_checked(vec3<f32>(pixel_x(i % U.width), pixel_y(i / U.width), U.extra.x)).d;
}
