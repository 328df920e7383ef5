// Packed pruned tapes (shaders/prune.wgsl writes them) and the one loop that runs them, shared by
// every kernel: the pruned image and point passes and, through `field` (interpreter.wgsl) with
// FIELD_CELLS on, the pruned march, surface and light (`cell_eval`).
//
// A packed tape is n records of two words in out_u (prune.wgsl pack_record): op | dst << 8 |
// a << 16 | b << 24, then c (MIX), the bits of the constant (CONST) or of an immediate operand:
// pruning folds a constant operand of a two-operand record into it (op | IMM_A: a is the
// immediate, op | IMM_B: b is), which drops the CONST record where nothing else reads it. A
// tile's (or cell's) header is HEADER_WORDS words: the first word of its packed tape, its length
// in records, its class (TILE_*), the registers it uses (prune.wgsl renumbers them 0 ..
// regs - 1, so that a pipeline holding fewer registers than the full tape's may run it) and the
// bits of the lower bound of its interval over its box (NaN where the tile was not evaluated:
// the march steps over a cell whose bound proves that no point of it is a hit, cell_find).

const TILE_AMBIGUOUS: u32 = 0u;
const TILE_INSIDE: u32 = 1u;
const TILE_OUTSIDE: u32 = 2u;
const TILE_FAILED: u32 = 3u;
const HEADER_WORDS: u32 = 5u;
const OP_MASK: u32 = 0x3fu;         // a packed record's op, without the immediate flags
const IMM_A: u32 = 0x40u;
const IMM_B: u32 = 0x80u;

// run_tape's arithmetic, op for op (unary / binary / nmin / nmax and the exact fmod sub-steps), on
// the packed pruned tape of `n_records` records at word `first` of out_u, at point p: register 0
// (the records count into `iters` at once, and a tape that would pass U.iter_cap is not run but
// sets `overflow`; fmod sub-steps count one by one). The pruned pixel, point and march passes
// share it.
fn run_packed(first: u32, n_records: u32, p: vec3<f32>) -> f32 {
    return run_packed_eval(first, n_records, p, false).d;
}

// run_packed with, when `mats`, register 0's material id by run_tape's rules: VAR / CONST 0, MIN /
// MAX the chosen operand's (b where vb < va, resp. vb > va), a scene field's result (packed as
// COPY | IMM_B: pack_record) the material in its second word, any other record its operand a's
// (0 for an immediate). The surface pass on a scene's cells takes it.
fn run_packed_eval(first: u32, n_records: u32, p: vec3<f32>, mats: bool) -> Eval {
    var k = first;
    let end = k + 2u * n_records;
    var fmod_steps = false;
    var fm_r = 0.0;
    var fm_y = 0.0;
    var fm_ey = 0;
    if (!take_iterations(n_records)) {
        k = end;
    }
    loop {
        if (k >= end) {
            break;
        }
        let w0 = out_u[k];
        let w1 = out_u[k + 1u];
        let op = w0 & OP_MASK;
        let dst = (w0 >> 8u) & 0xffu;
        let va = select(reg[(w0 >> 16u) & 0xffu], bitcast<f32>(w1), (w0 & IMM_A) != 0u);
        let vb = select(reg[w0 >> 24u], bitcast<f32>(w1), (w0 & IMM_B) != 0u);
        var wv = 0.0;
        var wm = 0u;
        if (mats) {
            wm = select(regm[(w0 >> 16u) & 0xffu], 0u, (w0 & IMM_A) != 0u);
            let mb = select(regm[w0 >> 24u], 0u, (w0 & IMM_B) != 0u);
            if (op <= OP_LEAF_LAST) {
                wm = 0u;
            } else if (op == OP_COPY && (w0 & IMM_B) != 0u) {
                wm = w1;
            } else if (op == OP_MIN) {
                wm = select(wm, mb, vb < va);
            } else if (op == OP_MAX) {
                wm = select(wm, mb, vb > va);
            }
        }
        var nxt = k + 2u;
        // The ops of scenes lowered to arithmetic come first, most frequent first, and the fmod
        // sub-steps (op MOD) after them: every test a record passes costs each lane of its warp.
        // This order took a quarter off frames on cells on the H200 (docs/PERFORMANCE.md).
        if (op == OP_ADD) {
            wv = va + vb;
        } else if (op == OP_MUL) {
            wv = va * vb;
        } else if (op == OP_SUB) {
            wv = va - vb;
        } else if (op == OP_MAX) {
            wv = nmax(va, vb);
        } else if (op == OP_SQUARE) {
            wv = va * va;
        } else if (op == OP_MIN) {
            wv = nmin(va, vb);
        } else if (op == OP_SQRT) {
            wv = sqrt(va);
        } else if (op == OP_ABS) {
            wv = abs(va);
        } else if (fmod_steps) {   // run_tape's STEP_FMOD
            if (!take_iteration()) {
                break;
            }
            let st = fmod_step(fm_r, fm_y, fm_ey, va, vb);
            fm_r = st.r;
            if (st.done) {
                wv = st.value;
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
        } else if (op == OP_MOD) {
            let fs = fmod_start(va, vb);
            fm_y = fs.y;
            fm_r = fs.ax;
            if (fs.steps) {
                fm_ey = fs.ey;
                fmod_steps = true;
                nxt = k;
            }
            wv = mod_value(fs.r, vb);
        } else if (op <= OP_UNARY_LAST) {
            wv = unary(op, va);
        } else {
            wv = binary(op, va, vb, reg[select(0u, w1 & 0xffu, op == OP_MIX)]);
        }
        if (nxt != k) {
            reg[dst] = wv;
            if (mats) {
                regm[dst] = wm;
            }
        }
        k = nxt;
    }
    var mat = 0u;
    if (mats) {
        mat = regm[0];
    }
    return Eval(reg[0], mat);
}

// The cells of a pruned march (GpuWalker.march with cells): a grid of g0^3 level-0 cells over the
// march box plus one last level-0 cell for every point outside it (its box NaN: nothing is
// decided, its tape is the whole tape less dead code); each finer level splits a cell 4 x 4 x 4
// (cell c of level m has the sub-cells 64 c .. 64 c + 63 of level m + 1; the outside cell's are
// empty). Flat cells (an image's, in the plane z = lo.z): g0^2 level-0 cells and the outside
// cell, each finer level splitting a cell 4 x 4 (16 sub-cells). prune_tiles (points mode) has
// pruned every cell's tape over its box; boxes are in the points buffer from word 4 (prune.wgsl
// tile_extent), a sub-cell's box inside its parent's. The descriptor, at word bits(U.extra.x) of
// the points buffer: lo.xyz of the grid, the finest cell's size xyz, then the bits of g0, of the
// levels, of the first header word in out_u and of the flat flag.
struct MarchCells {
    lo: vec3<f32>,
    size: vec3<f32>,
    g0: u32,
    levels: u32,
    base: u32,
    flat: bool,
}

fn march_cells() -> MarchCells {
    let q = bitcast<u32>(U.extra.x);
    return MarchCells(vec3<f32>(points[q], points[q + 1u], points[q + 2u]),
                 vec3<f32>(points[q + 3u], points[q + 4u], points[q + 5u]),
                 bitcast<u32>(points[q + 6u]), bitcast<u32>(points[q + 7u]), bitcast<u32>(points[q + 8u]),
                 bitcast<u32>(points[q + 9u]) != 0u);
}

// p's cell: the finest cell whose box holds p, or the outside cell where p lies in no grid cell's
// box (outside the grid, NaN, or moved out of the cell its index names by the rounding of that
// index; an index one past the grid's faces names the boundary cell, whose box is grown by a
// rounding margin, so that a ray's entry on the grid's face finds its cell however the entry's t
// is rounded) (flat cells: p.z is the plane's, so i.z is 0); its header is at g.base + HEADER_WORDS *
// tile, its box (the outside cell's NaN) at word 4 + 6 * tile of points. With `skip` (a tracing
// step of the ray o + t d, p = o + t d; empty-space skipping, the setting SET_CELL_SKIP): a cell
// of any level on p's way down whose header's lower bound is at least the hit threshold and
// whose box holds p proves that no point of its box is a hit, so the ray may move on to where it
// leaves that box, or by the bound times the step scale if that is further (the bound is a
// distance bound wherever the field is), provided the bound is also at least the hit threshold
// there (`cone` > 0, a primary ray's SET_HIT_CONE: max(hit_eps, cone t) at that t); skip_to is
// the furthest of these, -1 where no cell proves it (the field is then evaluated on the tile).
// The twin's rule: runtime/pruning.py _CellTapes.skip_to.
struct CellFind {
    tile: u32,
    skip_to: f32,
}

fn in_box(b: u32, p: vec3<f32>) -> bool {
    return p.x >= points[b] && p.y >= points[b + 1u] && p.z >= points[b + 2u] &&
           p.x <= points[b + 3u] && p.y <= points[b + 4u] && p.z <= points[b + 5u];
}

// the ray's t where it leaves the box at word b of points (t + lower * step scale if further)
fn skip_box(b: u32, o: vec3<f32>, d: vec3<f32>, t: f32, lower: f32) -> f32 {
    var exit = inf();
    for (var r = 0u; r < 3u; r++) {
        if (d[r] > 0.0) {
            exit = pmin(exit, (points[b + 3u + r] - o[r]) / d[r]);
        } else if (d[r] < 0.0) {
            exit = pmin(exit, (points[b + r] - o[r]) / d[r]);
        }
    }
    return pmax(t + lower * setting(SET_STEP_SCALE), exit);
}

fn cell_find(g: MarchCells, p: vec3<f32>, skip: bool, o: vec3<f32>, d: vec3<f32>, t: f32, cone: f32) -> CellFind {
    let gz = select(g.g0, 1u, g.flat);
    let kids = select(64u, 16u, g.flat);
    let n0 = g.g0 * g.g0 * gz + 1u;
    let eps = setting(SET_HIT_EPS);
    var tile = n0 - 1u;                     // the outside cell
    var skip_to = -1.0;
    let shift = 2u * (g.levels - 1u);
    let f = floor((p - g.lo) / g.size);
    let top = f32(g.g0 << shift);
    let far = vec3<f32>(top, top, select(top, 1.0, g.flat));
    if (all(f >= vec3<f32>(-1.0)) && all(f <= far)) {   // (NaN: outside)
        let i = vec3<u32>(clamp(f, vec3<f32>(0.0), far - 1.0));
        var c = ((i.z >> shift) * g.g0 + (i.y >> shift)) * g.g0 + (i.x >> shift);
        var first = 0u;                     // the index of level m's first cell over all levels
        var count = n0;
        for (var m = 0u; m < g.levels; m++) {
            if (m > 0u) {
                let sh = 2u * (g.levels - 1u - m);
                c = c * kids + (((i.z >> sh) & 3u) * 4u + ((i.y >> sh) & 3u)) * 4u + ((i.x >> sh) & 3u);
                first += count;
                count *= kids;
            }
            let b = 4u + 6u * (first + c);
            if (skip) {
                let lower = bitcast<f32>(out_u[g.base + HEADER_WORDS * (first + c) + 4u]);
                if (lower >= eps && in_box(b, p)) {   // (NaN: not evaluated)
                    let to = skip_box(b, o, d, t, lower);
                    if (cone <= 0.0 || lower >= max(eps, cone * to)) {   // (the threshold at `to`)
                        skip_to = pmax(skip_to, to);
                    }
                }
            }
            if (m + 1u == g.levels && in_box(b, p)) {
                tile = first + c;
            }
        }
    }
    return CellFind(tile, skip_to);
}

// the first header word in out_u of p's cell (cell_find)
fn cell_header(g: MarchCells, p: vec3<f32>) -> u32 {
    return g.base + HEADER_WORDS * cell_find(g, p, false, p, p, 0.0, 0.0).tile;
}

// the field at p on the pruned tape of its cell `tile` (cell_find; the whole tape's bits: pruning
// is exact in the cell's box), with its material id in pipelines built WITH_MATERIALS
fn cell_eval(g: MarchCells, tile: u32, p: vec3<f32>) -> Eval {
    let hdr = g.base + HEADER_WORDS * tile;
    if (out_u[hdr + 2u] == TILE_FAILED) {   // (the host reruns the cells before marching)
        return Eval(nan(), 0u);
    }
    return run_packed_eval(out_u[hdr], out_u[hdr + 1u], p, WITH_MATERIALS);
}
