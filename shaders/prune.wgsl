// Hierarchical per-tile interval pruning of arithmetic tapes for the 2D field / sign image (the
// design of runtime/pruning.py on the GPU). Owns the interval arithmetic, `prune_tiles` (one
// invocation per tile of one level; dispatched once per level, coarse to fine) and
// `pruned_image` (one invocation per pixel, on its finest tile's pruned tape); the same tiles over
// cells of points for GpuWalker.evaluate_pruned (points mode, `pruned_points`: one invocation per
// point, on its finest cell's pruned tape); `cells_image` (one invocation per pixel, on the pruned
// tape of its cell of an image's flat cells, which prune_tiles has pruned in points mode and the
// host keeps for the images of the same tape after it); `prune_wave` (level 0 of any of these,
// a workgroup per tile running the records of a host-made schedule side by side, step by step:
// the same tapes as prune_tiles').
//
// Uniforms (one set for every pass): width, height, rect as field_image; extra = (z, levels,
// mode, level): mode 1 = sign image (decided tiles are filled without evaluating below them),
// 0 = field (every pixel evaluated with its finest tile's tape), 2 = points (camera[0] = the
// tiles of each level instead of their sizes, a level-l tile having level_tiles(l + 1) /
// level_tiles(l) >= 4 sub-tiles; the boxes from the points buffer, see tile_extent;
// camera[1].y = the bits of the points' first word there); `level` is the level a
// prune_tiles pass works on (copied into the uniform buffer by a command the host encodes
// before each pass).
// camera[0] = the tile size in pixels of levels 0..levels-1 (coarse to fine); camera[1].x = the
// bits of the arena's size in words; camera[1].w = the bits of the sign image's first bit word
// in out_u (sign_bits). Level 0 tiles the image from pixel (0, 0); a tile of level
// l + 1 is one of the fanout(l)^2 sub-tiles of its parent (runtime/pruning.py's nesting, so a
// size need not divide its parent's), numbered parent * fanout(l)^2 + row * fanout(l) + col;
// sub-tiles beyond the parent's (clipped) extent are empty (class TILE_EMPTY) and never read.
//
// out_u layout, from word bits(camera[1].z) (0 but for the cells of a pruned march, whose pixel
// outputs come first): the headers of every level in order, 3 words per tile (word offset of its pruned
// tape in out_u, its length in records, its class), then the arena. Arena words are handed out by
// an atomic bump pointer (counters[COUNT_ARENA], zeroed per submission); a tile that finds no
// room is TILE_FAILED (counted in counters[COUNT_ARENA_FULL]), so are its sub-tiles and its pixels
// (NaN): the host sees the count, grows the arena and runs the image again. A level-l tile takes
// a scratch of one nibble per record of its parent's tape (level 0: the full tape): bits 0-1 the
// MIN / MAX / AND / OR choice, bit 2 "emitted", where the union rule runs three words per MIN /
// MAX record of that tape (its sides, union_sides: the interval pass writes them, the liveness
// pass's union rule reads them), then a tape of exactly its pruned length, packed two words a
// record (pack_record), in execution order.
//
// Intervals (float32 pairs; "may be NaN" is lo = hi = NaN, as runtime/intervals.py) contain every
// value run_tape computes at the tile's pixel centres: add / sub / mul / square bounds move at
// least one ulp outward (and by TINY absolutely, which also covers flushed subnormals); div /
// recip / sqrt, whose WGSL accuracy is 2.5 ulp, move by REL_LOOSE; the transcendental ops, whose
// WGSL accuracy is looser still, by REL_WIDE + ABS_WIDE; sin / cos / tan / atan2 give their whole
// range and MOD [0, |b|]. (WGSL has no float64: bounds are looser than runtime/pruning.py's, so
// fewer ops may be decided than on the CPU twin; every decision is still exact.)
// MIN / MAX / AND / OR choices follow intervals.choice, so a decided op returns the chosen operand
// bit for bit at every pixel (nmin / nmax return a on ties): a pruned tape is exact on its tile,
// and a sub-tile's interval pass over its parent's pruned tape bounds the same values.
// The liveness pass of the UNION_BOUND pipeline, on levels after the first, adds
// runtime/pruning.py's union rule (union_rule, read_reg): a MIN read once by a MIN also drops an
// operand that lies above the whole union's bound (MAX mirrored), with the twin's decisions
// wherever the intervals are the twin's.
// Every loop over records counts into run_tape's `iters` and stops at U.iter_cap (overflow,
// reported by the host); so do prune_tiles' chunk loops and the loads of each chunk into workgroup
// memory. prune_tiles' interval and liveness passes count a chunk's records at once, before
// walking them (a chunk that would pass the cap is not walked); the interval pass tests the
// two-operand ops first. Both took 2-7 % off its walks on the H200 (docs/PERFORMANCE.md).

const CH_BOTH: u32 = 0u;
const CH_A: u32 = 1u;
const CH_B: u32 = 2u;

const EPS: f32 = 1.1920928955078125e-07;        // 2^-23
const TINY: f32 = 8.077935669463161e-28;        // 2^-90: a normal float far above subnormals
const REL_LOOSE: f32 = 9.5367431640625e-07;     // 2^-20 (8 ulp)
const REL_WIDE: f32 = 0.001953125;              // 2^-9
const ABS_WIDE: f32 = 9.5367431640625e-07;      // 2^-20
const FMAX: f32 = 3.4028234663852886e+38;
const HALF_PI_UP: f32 = 1.5723;                 // > pi/2 (1 + 2^-9)
const PI_UP: f32 = 3.1447;                      // > pi (1 + 2^-9)
const TRIG_UP: f32 = 1.0009765625;              // |sin|, |cos| on the GPU: <= 1 + 2^-11

var<private> ireg: array<vec2<f32>, REG_CAP>;   // the intervals of the registers (lo, hi)
var<private> live: array<bool, REG_CAP>;   // the pruner's live registers (private: zeroed)
var<private> rkind: array<u32, REG_CAP>;   // liveness, UNION_BOUND: the bound's kind a live register got
var<private> rbound: array<f32, REG_CAP>;  // liveness, UNION_BOUND: that bound
var<private> konst: array<bool, REG_CAP>;  // interval pass: the register's last write was a CONST
var<private> capt: array<bool, REG_CAP>;   // liveness: a later record folds the register's CONST
var<private> kval: array<u32, REG_CAP>;    // writing pass: the bits of the register's last CONST

// a float below / above x by `rel` of |x| and `abs_` (infinite bounds stay infinite, except that
// a lower bound of +inf becomes FMAX and an upper bound of -inf -FMAX, as runtime/pruning.py)
fn below(x: f32, rel: f32, abs_: f32) -> f32 {
    let r = x * (1.0 - select(rel, -rel, x < 0.0)) - abs_;
    return select(r, FMAX, r == inf());
}

fn above(x: f32, rel: f32, abs_: f32) -> f32 {
    let r = x * (1.0 + select(rel, -rel, x < 0.0)) + abs_;
    return select(r, -FMAX, r == -inf());
}

fn dn(x: f32) -> f32 {
    return below(x, EPS, TINY);
}

fn up(x: f32) -> f32 {
    return above(x, EPS, TINY);
}

struct Iv {
    lo: f32,
    hi: f32,
    ch: u32,
}

fn iv(lo: f32, hi: f32) -> Iv {
    if (is_nan(lo) || is_nan(hi)) {
        return Iv(nan(), nan(), CH_BOTH);
    }
    return Iv(lo, hi, CH_BOTH);
}

fn iv_nan() -> Iv {
    return Iv(nan(), nan(), CH_BOTH);
}

fn has0(lo: f32, hi: f32) -> bool {
    return lo <= 0.0 && hi >= 0.0;
}

// NOT: 1 where a may be 0, 0 where it may be non-zero; a may be NaN (anything): 0 or 1
fn iv_not(lo: f32, hi: f32) -> Iv {
    if (is_nan(lo) || is_nan(hi)) {
        return iv(0.0, 1.0);
    }
    return iv(select(0.0, 1.0, lo == 0.0 && hi == 0.0), select(0.0, 1.0, has0(lo, hi)));
}

fn iv_add(alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    if ((ahi == inf() && blo == -inf()) || (alo == -inf() && bhi == inf())) {
        return iv_nan();   // inf - inf inside
    }
    var lo = dn(alo + blo);
    if (alo >= 0.0 && blo >= 0.0) {
        lo = max(lo, 0.0);   // a sum of non-negatives is not below 0 (sqrt(x^2 + y^2) stays defined)
    }
    var hi = up(ahi + bhi);
    if (ahi <= 0.0 && bhi <= 0.0) {
        hi = min(hi, 0.0);
    }
    return iv(lo, hi);
}

fn iv_mul(alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    let a_inf = alo == -inf() || ahi == inf();
    let b_inf = blo == -inf() || bhi == inf();
    if ((has0(alo, ahi) && b_inf) || (has0(blo, bhi) && a_inf)) {
        return iv_nan();   // 0 * inf inside
    }
    let p0 = alo * blo;
    let p1 = alo * bhi;
    let p2 = ahi * blo;
    let p3 = ahi * bhi;
    return iv(dn(min(min(p0, p1), min(p2, p3))), up(max(max(p0, p1), max(p2, p3))));
}

fn iv_square(lo: f32, hi: f32) -> Iv {
    let l = max(max(lo, -hi), 0.0);
    let h = max(-lo, hi);
    return iv(max(dn(l * l), 0.0), up(h * h));
}

fn iv_div(alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    if (has0(blo, bhi)) {
        if (has0(alo, ahi)) {
            return iv_nan();   // 0 / 0
        }
        return iv(-inf(), inf());
    }
    if ((alo == -inf() || ahi == inf()) && (blo == -inf() || bhi == inf())) {
        return iv_nan();       // inf / inf
    }
    let q0 = alo / blo;
    let q1 = alo / bhi;
    let q2 = ahi / blo;
    let q3 = ahi / bhi;
    return iv(below(min(min(q0, q1), min(q2, q3)), REL_LOOSE, TINY),
              above(max(max(q0, q1), max(q2, q3)), REL_LOOSE, TINY));
}

// a monotone transcendental's bounds f(lo), f(hi) (increasing) moved outward by the wide margin
fn wide(lo: f32, hi: f32) -> Iv {
    return iv(below(lo, REL_WIDE, ABS_WIDE), above(hi, REL_WIDE, ABS_WIDE));
}

// the named interval rules of the arithmetic ops that are not monotone (OpSpec.interval.wgsl)
fn iv_recip(lo: f32, hi: f32) -> Iv {
    if (lo == 0.0 && hi == 0.0) {
        return iv_nan();
    }
    return iv_div(1.0, 1.0, lo, hi);
}

fn iv_sqrt(lo: f32, hi: f32) -> Iv {
    if (lo < 0.0) {
        return iv_nan();
    }
    return iv(max(below(sqrt(lo), REL_LOOSE, TINY), 0.0), above(sqrt(hi), REL_LOOSE, TINY));
}

fn iv_sincos(lo: f32, hi: f32) -> Iv {
    if (lo == -inf() || hi == inf()) { return iv_nan(); }
    return iv(-TRIG_UP, TRIG_UP);
}

fn iv_tan(lo: f32, hi: f32) -> Iv {
    if (lo == -inf() || hi == inf()) { return iv_nan(); }
    return iv(-inf(), inf());
}

// AND (is_and) / OR with the choice; a NaN b matters only where b may be chosen
fn iv_logic(is_and: bool, alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    if (is_nan(alo)) { return iv_nan(); }
    let bnan = is_nan(blo);
    let nonzero = alo > 0.0 || ahi < 0.0;
    let zero_only = alo == 0.0 && ahi == 0.0;
    if (is_and) {
        let ch = select(select(CH_BOTH, CH_A, zero_only), CH_B, nonzero);
        if (zero_only) { return Iv(0.0, 0.0, ch); }
        if (bnan) { return Iv(nan(), nan(), ch); }
        if (nonzero) { return Iv(blo, bhi, ch); }
        return Iv(min(0.0, blo), max(0.0, bhi), ch);
    }
    let ch = select(select(CH_BOTH, CH_B, zero_only), CH_A, nonzero);
    if (nonzero) { return Iv(alo, ahi, ch); }
    if (bnan) { return Iv(nan(), nan(), ch); }
    if (zero_only) { return Iv(blo, bhi, ch); }
    return Iv(min(alo, blo), max(ahi, bhi), ch);
}

// MIN (is_min) / MAX with the choice (operands not NaN)
fn iv_minmax(is_min: bool, alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    var pick_a = alo >= bhi;
    var pick_b = blo > ahi;
    var r = iv(max(alo, blo), max(ahi, bhi));
    if (is_min) {
        pick_a = ahi <= blo;
        pick_b = bhi < alo;
        r = iv(min(alo, blo), min(ahi, bhi));
    }
    r.ch = select(select(CH_BOTH, CH_B, pick_b), CH_A, pick_a);
    return r;
}

fn iv_compare(alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    let lt = ahi < blo;
    let gt = alo > bhi;
    let eq = alo == ahi && blo == bhi && alo == blo;
    var lo = select(select(-1.0, 0.0, eq), 1.0, gt);
    var hi = select(select(1.0, 0.0, eq), -1.0, lt);
    if (!lt && !gt && !eq) {
        if (alo >= bhi) { lo = 0.0; }
        if (ahi <= blo) { hi = 0.0; }
    }
    return iv(lo, hi);
}

// the Euclidean remainder lies in [0, |b|]
fn iv_mod(alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    if (has0(blo, bhi) || alo == -inf() || ahi == inf()) { return iv_nan(); }
    return iv(0.0, up(max(abs(blo), abs(bhi))));
}

fn iv_atan2(alo: f32, ahi: f32, blo: f32, bhi: f32) -> Iv {
    if ((has0(alo, ahi) && has0(blo, bhi)) || alo == -inf() || ahi == inf() || blo == -inf() || bhi == inf()) {
        return iv_nan();
    }
    return iv(-PI_UP, PI_UP);
}

fn iv_mix(alo: f32, ahi: f32, blo: f32, bhi: f32, clo: f32, chi: f32) -> Iv {
    if (is_nan(clo)) { return iv_nan(); }
    let d = iv_add(blo, bhi, -ahi, -alo);
    if (is_nan(d.lo)) { return iv_nan(); }
    let m = iv_mul(d.lo, d.hi, clo, chi);
    if (is_nan(m.lo)) { return iv_nan(); }
    return iv_add(alo, ahi, m.lo, m.hi);
}

// ---- BEGIN GENERATED intervals by taperay.runtime.op_codegen from runtime/opcodes.py: do not edit ----
// the arithmetic ops' intervals (OpSpec.interval), hottest first
fn iv_unary(op: u32, lo: f32, hi: f32) -> Iv {
    if (op == OP_NOT) { return iv_not(lo, hi); }
    if (is_nan(lo)) {
        return iv_nan();   // (WGSL's min / max of a NaN are unspecified: never reached with one)
    }
    if (op == OP_COPY) { return iv(lo, hi); }
    if (op == OP_NEG) { return iv(-hi, -lo); }
    if (op == OP_SQUARE) { return iv_square(lo, hi); }
    if (op == OP_SQRT) { return iv_sqrt(lo, hi); }
    if (op == OP_ABS) { return iv(max(max(lo, -hi), 0.0), max(-lo, hi)); }
    if (op == OP_RECIP) { return iv_recip(lo, hi); }
    if (op == OP_FLOOR) { return iv(floor(lo), floor(hi)); }
    if (op == OP_CEIL) { return iv(ceil(lo), ceil(hi)); }
    if (op == OP_ROUND) { return iv(round_away(lo), round_away(hi)); }
    if (op == OP_SIN) { return iv_sincos(lo, hi); }
    if (op == OP_COS) { return iv_sincos(lo, hi); }
    if (op == OP_TAN) { return iv_tan(lo, hi); }
    if (op == OP_ASIN) {
        if (lo < -1.0 || hi > 1.0) { return iv_nan(); }
        return wide(asin(lo), asin(hi));
    }
    if (op == OP_ACOS) {
        if (lo < -1.0 || hi > 1.0) { return iv_nan(); }
        return wide(acos(hi), acos(lo));
    }
    if (op == OP_ATAN) {
        let w = wide(atan(lo), atan(hi));
        return iv(max(w.lo, -HALF_PI_UP), min(w.hi, HALF_PI_UP));
    }
    if (op == OP_EXP) {
        let w = wide(exp(lo), exp(hi));
        return iv(max(w.lo, 0.0), w.hi);
    }
    if (op == OP_LN) {
        if (lo < 0.0) { return iv_nan(); }
        return wide(log(lo), log(hi));
    }
    return iv_nan();
}

fn iv_binary(op: u32, alo: f32, ahi: f32, blo: f32, bhi: f32, clo: f32, chi: f32) -> Iv {
    if (op == OP_AND) { return iv_logic(true, alo, ahi, blo, bhi); }
    if (op == OP_OR) { return iv_logic(false, alo, ahi, blo, bhi); }
    if (is_nan(alo) || is_nan(blo)) {
        return iv_nan();
    }
    if (op == OP_MAX) { return iv_minmax(false, alo, ahi, blo, bhi); }
    if (op == OP_SUB) { return iv_add(alo, ahi, -bhi, -blo); }
    if (op == OP_ADD) { return iv_add(alo, ahi, blo, bhi); }
    if (op == OP_MIN) { return iv_minmax(true, alo, ahi, blo, bhi); }
    if (op == OP_MUL) { return iv_mul(alo, ahi, blo, bhi); }
    if (op == OP_DIV) { return iv_div(alo, ahi, blo, bhi); }
    if (op == OP_ATAN2) { return iv_atan2(alo, ahi, blo, bhi); }
    if (op == OP_COMPARE) { return iv_compare(alo, ahi, blo, bhi); }
    if (op == OP_MOD) { return iv_mod(alo, ahi, blo, bhi); }
    if (op == OP_MIX) { return iv_mix(alo, ahi, blo, bhi, clo, chi); }
    if (op == OP_RAND) { return iv(0.0, 1.0); }
    return iv_nan();
}
// ---- END GENERATED intervals ----


const COUNT_ARENA: u32 = 2u;        // counters' words 2 and 3 (bindings.wgsl): arena words handed out
const COUNT_ARENA_FULL: u32 = 3u;   // tiles refused for want of arena room
const COUNT_REGS: u32 = 4u;         // the most registers a pruned tape of the finest level uses
const COUNT_REGS_REFUSED: u32 = 5u; // cells_image: pixels whose cell's tape needs more than REG_CAP
const NO_ROOM: u32 = 0xffffffffu;
const EMITTED: u32 = 4u;            // scratch nibble bit: the record is in the pruned tape
// scratch nibble bit 3: on a foldable record (`foldable`), one operand is a register whose last
// write was a CONST and is written as the immediate (bit 0 set: operand a, else b); on a CONST,
// its value is such an immediate, so the writing pass reads it even where it is not emitted
const FOLDED: u32 = 8u;
const FOLD_A: u32 = 1u;
// whether this pipeline folds constants (prune_cells, for the march cells: their tapes run every
// step of every frame; prune_tiles, for images and points, whose pruning is part of each call,
// does not: the bookkeeping slows the serial walks over the full tape by about 20 % on the H200)
override FOLD_CONSTANTS: bool = false;
// whether this pipeline takes the union rule (union_rule) on the levels after the first:
// prune_cells, whose tapes are kept and run every step of every frame (H200: 200 spheres on 8^3 x
// 2 cells, 6.8 -> 4.8 ms a frame); not prune_tiles, whose pruning is part of each image (prospero
// 1024^2, tiles 32/8: 0.97 -> 1.16 ms with the rule), nor level 0 (prune_wave has no rule: the
// rule's code, even compiled out, cost its steps 0.45 -> 0.60 ms; docs/PERFORMANCE.md)
override UNION_BOUND: bool = false;
const MAX_LEVELS: u32 = 4u;         // level sizes live in one vec4
const TILE_EMPTY: u32 = 4u;         // a sub-tile beyond its parent's extent (header only)
const BLOCK: u32 = 8u;              // pixel passes: one workgroup (WG = 64 invocations) an 8 x 8 block

fn n_levels() -> u32 {
    return u32(U.extra.y);
}

fn sign_mode() -> bool {
    return U.extra.z == 1.0;
}

// mode 2: the tiles are cells of points (pruned_points), their boxes given by the host
fn points_mode() -> bool {
    return U.extra.z == 2.0;
}

fn level_size(l: u32) -> u32 {
    return u32(U.camera[0][l]);
}

// sub-tiles per side of a level-l tile
fn fanout(l: u32) -> u32 {
    let s = level_size(l + 1u);
    return (level_size(l) + s - 1u) / s;
}

fn top_x() -> u32 {
    return (U.width + level_size(0u) - 1u) / level_size(0u);
}

fn level_tiles(l: u32) -> u32 {
    if (points_mode()) {
        return u32(U.camera[0][l]);
    }
    var n = top_x() * ((U.height + level_size(0u) - 1u) / level_size(0u));
    for (var m = 0u; m < l; m++) {
        n *= fanout(m) * fanout(m);
    }
    return n;
}

// the sub-tiles of a level-l tile (points mode: at least 4, so 64 consecutive tiles have at most
// MAX_SLOTS parents)
fn children(l: u32) -> u32 {
    if (points_mode()) {
        return level_tiles(l + 1u) / level_tiles(l);
    }
    return fanout(l) * fanout(l);
}

// the index over all levels of level l's first tile
fn level_first(l: u32) -> u32 {
    var t = 0u;
    for (var m = 0u; m < l; m++) {
        t += level_tiles(m);
    }
    return t;
}

// the first header word of level l in out_u (of level n_levels(): the arena's first word); the
// headers start at word bits(U.camera[1].z) (0 but for a pruned march, whose pixels come first)
fn level_header(l: u32) -> u32 {
    return bitcast<u32>(U.camera[1].z) + HEADER_WORDS * level_first(l);
}

// `words` arena words: the index of the first in out_u, or NO_ROOM (counted; the host then
// discards the whole image, so a bump pointer run past the arena does no harm)
fn alloc(words: u32) -> u32 {
    let at = atomicAdd(&counters[COUNT_ARENA], words);
    let cap = bitcast<u32>(U.camera[1].x);
    if (at > cap || words > cap - at) {
        atomicAdd(&counters[COUNT_ARENA_FULL], 1u);
        return NO_ROOM;
    }
    return level_header(n_levels()) + at;
}

// the pixels of a tile: rows r0..r1-1, columns c0..c1-1 (empty when r0 >= r1 or c0 >= c1)
struct TileBox {
    r0: u32,
    c0: u32,
    r1: u32,
    c1: u32,
}

fn tile_box(l: u32, t: u32) -> TileBox {
    var digit: array<u32, MAX_LEVELS>;
    var top = t;
    for (var m = l; m > 0u; m--) {
        let qq = fanout(m - 1u) * fanout(m - 1u);
        digit[m] = top % qq;
        top /= qq;
    }
    let s0 = level_size(0u);
    var b = TileBox((top / top_x()) * s0, (top % top_x()) * s0, 0u, 0u);
    b.r1 = min(b.r0 + s0, U.height);
    b.c1 = min(b.c0 + s0, U.width);
    for (var m = 1u; m <= l; m++) {
        let q = fanout(m - 1u);
        let s = level_size(m);
        b.r0 += (digit[m] / q) * s;
        b.c0 += (digit[m] % q) * s;
        b.r1 = min(b.r0 + s, b.r1);
        b.c1 = min(b.c0 + s, b.c1);
    }
    return b;
}

// the finest tile holding pixel (row, col)
fn pixel_tile(row: u32, col: u32) -> u32 {
    let s0 = level_size(0u);
    var t = (row / s0) * top_x() + col / s0;
    var rr = row % s0;
    var cc = col % s0;
    for (var m = 1u; m < n_levels(); m++) {
        let s = level_size(m);
        let q = fanout(m - 1u);
        t = t * q * q + (rr / s) * q + cc / s;
        rr %= s;
        cc %= s;
    }
    return t;
}

// the box a level-l tile's interval pass runs over; `ok` false for an empty tile. Pixel tiles: the
// range of the tile's pixel centres, widened for the rounding of their formula. Points mode: the
// range of the cell's points as the host found it (lo > hi when empty; NaN along an axis where a
// point's coordinate is NaN), read from the points buffer after the level table:
// points[4 + 6 * (index of the tile over all levels) ..] = lo.xyz, hi.xyz.
struct TileExtent {
    ok: bool,
    lo: vec3<f32>,
    hi: vec3<f32>,
}

fn tile_extent(l: u32, t: u32) -> TileExtent {
    if (points_mode()) {
        let q = 4u + 6u * (level_first(l) + t);
        let lo = vec3<f32>(points[q], points[q + 1u], points[q + 2u]);
        let hi = vec3<f32>(points[q + 3u], points[q + 4u], points[q + 5u]);
        return TileExtent(!(lo.x > hi.x), lo, hi);
    }
    let b = tile_box(l, t);
    if (b.r0 >= b.r1 || b.c0 >= b.c1) {
        return TileExtent(false, vec3<f32>(0.0), vec3<f32>(0.0));
    }
    let r = U.rect;
    let mx = (abs(r.x) + abs(r.y - r.x)) * 3.814697265625e-06;   // 2^-18
    let my = (abs(r.w) + abs(r.w - r.z)) * 3.814697265625e-06;
    let xa = pixel_x(b.c0);
    let xb = pixel_x(b.c1 - 1u);
    let ya = pixel_y(b.r0);
    let yb = pixel_y(b.r1 - 1u);
    return TileExtent(true, vec3<f32>(min(xa, xb) - mx, min(ya, yb) - my, U.extra.x),
                      vec3<f32>(max(xa, xb) + mx, max(ya, yb) + my, U.extra.x));
}

// a pruned record in two words: op | dst << 8 | a << 16 | b << 24 (registers < 256, ops < 64;
// packed.wgsl IMM_A / IMM_B are set by pruning), then c (MIX) or the bits of the constant
// (CONST). A scene field's records (only in the tapes of a pruned march, which have no
// transforms; runtime/pruning.py FIELD_OPS) become the arithmetic ops with their values:
// FIELD_RESULT a COPY (reg[a] * 1) flagged IMM_B (meaningless on a one-operand record) with its
// material in the second word (packed.wgsl run_packed_eval), UNION MIN, INTERSECT MAX.
fn pack_record(ins: Instr) -> vec2<u32> {
    var w1 = ins.c;
    if (ins.op == OP_CONST) {
        w1 = bitcast<u32>(params[ins.param]);
    }
    var op = ins.op;
    if (op == OP_FIELD_RESULT) {            // (IMM_B on a one-operand record: the material in w1)
        op = OP_COPY | IMM_B;
        w1 = ins.aux;
    } else if (op == OP_UNION) {
        op = OP_MIN;
    } else if (op == OP_INTERSECT) {
        op = OP_MAX;
    }
    return vec2<u32>(op | (ins.dst << 8u) | (ins.a << 16u) | (ins.b << 24u), w1);
}

// record k of the tape a level-l tile prunes: the full tape (level 0) or its parent's pruned
// tape, whose first word is `src`
fn source_record(l: u32, src: u32, k: u32) -> vec2<u32> {
    if (l == 0u) {
        return pack_record(instrs[k]);
    }
    return vec2<u32>(out_u[src + 2u * k], out_u[src + 2u * k + 1u]);
}

// a record whose constant operand pruning may write as an immediate: two operands, no choice
// (MIN / MAX / AND / OR keep registers: a decided one becomes a COPY of its chosen operand)
fn foldable(op: u32) -> bool {
    return n_reads(op) == 2u && op != OP_MIN && op != OP_MAX && op != OP_AND && op != OP_OR;
}

fn n_reads(op: u32) -> u32 {
    if (op <= OP_LEAF_LAST) { return 0u; }
    if (op >= OP_TERNARY_FIRST && op <= OP_TERNARY_LAST) { return 3u; }
    return select(1u, 2u, op >= OP_BINARY_FIRST);
}

// the operand a decided MIN / MAX / AND / OR (choice ch) returns
fn chosen(w0: u32, ch: u32) -> u32 {
    return select(w0 >> 24u, (w0 >> 16u) & 0xffu, ch == CH_A);
}

fn is_minmax(op: u32) -> bool {
    return op == OP_MIN || op == OP_MAX;
}

// the union bound (runtime/pruning.py _union_bound, the same rule): a live MIN / MAX record's
// bound h (the one its reader passed, of kind `dkind`, tightened by its result's near bound) and
// its choice, an operand whose far bound lies beyond h dropped; kind 0 where its interval may be
// NaN (then it passes no bound)
struct UnionRule {
    kind: u32,
    h: f32,
    ch: u32,
}

fn union_rule(is_min: bool, ch: u32, sides: vec3<f32>, dkind: u32, dbound: f32) -> UnionRule {
    let kind = select(2u, 1u, is_min);
    if (is_nan(sides.z)) {
        return UnionRule(0u, 0.0, ch);
    }
    var h = sides.z;
    if (dkind == kind) {
        h = select(max(dbound, h), min(dbound, h), is_min);
    }
    var c = ch;
    if (ch == CH_BOTH) {
        if (select((sides.x < h), (sides.x > h), is_min)) {
            c = CH_B;
        } else if (select((sides.y < h), (sides.y > h), is_min)) {
            c = CH_A;
        }
    }
    return UnionRule(kind, h, c);
}

// a MIN / MAX record's sides for the union rule: a's and b's far bounds (MIN: lower, MAX: upper),
// its result's near bound (MIN: upper, MAX: lower)
fn union_sides(op: u32, a: vec2<f32>, b: vec2<f32>, v: Iv) -> vec3<f32> {
    if (op == OP_MIN) {
        return vec3<f32>(a.x, b.x, v.hi);
    }
    return vec3<f32>(a.y, b.y, v.lo);
}

// backward liveness: register r is read, by a record passing a union bound of `kind` (0: none);
// a second reader clears the bound (pruning.py _read)
fn read_reg(r: u32, kind: u32, h: f32) {
    if (!UNION_BOUND) {
        live[r] = true;
        return;
    }
    if (live[r]) {
        rkind[r] = 0u;
    } else {
        live[r] = true;
        rkind[r] = kind;
        rbound[r] = h;
    }
}

fn store_sides(at: u32, v: vec3<f32>) {
    out_u[at] = bitcast<u32>(v.x);
    out_u[at + 1u] = bitcast<u32>(v.y);
    out_u[at + 2u] = bitcast<u32>(v.z);
}

fn load_sides(at: u32) -> vec3<f32> {
    return vec3<f32>(bitcast<f32>(out_u[at]), bitcast<f32>(out_u[at + 1u]), bitcast<f32>(out_u[at + 2u]));
}

// an emitted record as a pruned tape holds it (scratch nibble `nib`): a folded operand (on a
// record that may fold: not a CONST) as the immediate `imm`, its CONST's value; a decided choice
// as a COPY of its chosen operand; else the record itself
fn written_record(rec: vec2<u32>, nib: u32, may_fold: bool, imm: u32) -> vec2<u32> {
    let folded = FOLD_CONSTANTS && (nib & FOLDED) != 0u && may_fold;
    if (folded && (nib & FOLD_A) != 0u) {
        return vec2<u32>((rec.x & 0xff00ffffu) | IMM_A, imm);
    }
    if (folded) {
        return vec2<u32>((rec.x & 0x00ffffffu) | IMM_B, imm);
    }
    let ch = nib & 3u;
    if (ch != CH_BOTH) {
        return vec2<u32>(OP_COPY | (rec.x & 0xff00u) | (chosen(rec.x, ch) << 16u), 0u);
    }
    return rec;
}

// ---- prune_tiles: the walks over records held in workgroup memory ------------------------------
// A tile's walks are serial (each record needs the intervals the previous ones wrote), so one
// invocation's record fetches would be on its critical path. The 64 tiles of a workgroup walk at
// most MAX_SLOTS source tapes (level 0: the one full tape; level l > 0: the pruned tapes of the
// parents of 64 consecutive tiles, fanout >= 2, so at most 17), all in lockstep: the workgroup
// loads the next CHUNK records of them together (coalesced, packed as pack_record), one segment
// of `seg` records per source tape, then each invocation walks its segment from workgroup memory.
// Barriers are in uniform control flow: every invocation of the workgroup runs the chunk loops
// (those with no tile to work on, or done, with `working` false), and a chunk loop stops, for all
// at once, when no invocation is working (wg_busy).
const CHUNK: u32 = 1536u;      // records in workgroup memory (12 KiB of the default 16 KiB)
const MAX_SLOTS: u32 = 17u;
var<workgroup> wg_rec: array<vec2<u32>, CHUNK>;
var<workgroup> wg_src: array<u32, MAX_SLOTS>;   // per source tape: its first word in out_u, its length
var<workgroup> wg_len: array<u32, MAX_SLOTS>;
var<workgroup> wg_chunks: u32;                  // chunks of the longest source tape
var<workgroup> wg_minmax: array<atomic<u32>, MAX_SLOTS>;   // per source tape: its MIN / MAX records
// whether any invocation is still working, one word per chunk in turn (three, so that the word an
// invocation sets before a chunk's barrier was cleared by invocation 0 two chunks before)
var<workgroup> wg_busy: array<u32, 3>;

// the start of a pass's chunk c, in uniform control flow: the workgroup votes (word phase % 3 of
// wg_busy; the word two votes ahead is cleared for its turn) whether any of its tiles is still
// working; if none is, false (the pass stops), else chunk c is loaded into wg_rec and true
fn next_chunk(working: bool, phase: ptr<function, u32>, l: u32, c: u32, seg: u32, n_slots: u32,
              lid: u32) -> bool {
    if (working) {
        wg_busy[*phase % 3u] = 1u;
    }
    let busy = workgroupUniformLoad(&wg_busy[*phase % 3u]);
    if (lid == 0u) {
        wg_busy[(*phase + 2u) % 3u] = 0u;
    }
    *phase += 1u;
    if (busy == 0u) {
        return false;
    }
    load_chunk(l, c, seg, n_slots, lid);
    workgroupBarrier();
    return true;
}

// the records of chunk `c` (records c * seg .. c * seg + seg - 1 of every source tape) into wg_rec
fn load_chunk(l: u32, c: u32, seg: u32, n_slots: u32, lid: u32) {
    var i = lid;
    loop {
        if (i >= n_slots * seg) {
            break;
        }
        iters += 1u;
        let s = i / seg;
        let k = c * seg + i % seg;
        if (k < wg_len[s]) {
            wg_rec[i] = source_record(l, wg_src[s], k);
        }
        i += WG;
    }
}

// one invocation per tile of level U.extra.w: its source tape is the full tape (level 0) or its
// parent's pruned tape; in the sign image a sub-tile of a decided (or failed) parent takes the
// parent's class and does nothing else. Otherwise the tile's walks over its source tape (`len`
// records): the interval pass over the range of the tile's pixel centres (choices into a scratch
// from the arena: one nibble per record), the class, and unless the sign image does not need it
// (a decided tile), the backward liveness pass (runtime/pruning.py _prune: marks the emitted
// records and counts them) and the pruned tape written forward into an arena block of exactly
// its length. The tile's header: first word of the tape, its length in records, class.
@compute @workgroup_size(WG)
fn prune_tiles(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = flat_index(wid, lid, nwg);
    let t0 = flat_index(wid, 0u, nwg);
    let l = u32(U.extra.w);
    let rule_on = UNION_BOUND && l > 0u;   // (the rule on sub-tiles / sub-cells: see UNION_BOUND)
    let n = level_tiles(l);
    // the workgroup's source tapes (slots): level 0 one, level l > 0 its tiles' parents in order
    var qq = 1u;
    var p_first = 0u;
    var n_slots = select(0u, 1u, t0 < n);
    if (l > 0u) {
        qq = children(l - 1u);
        if (t0 < n) {
            p_first = t0 / qq;
            n_slots = min(t0 + WG - 1u, n - 1u) / qq - p_first + 1u;
        }
    }
    let seg = (CHUNK / max(n_slots, 1u)) & ~7u;   // whole scratch words per segment
    if (lid < n_slots) {
        var s_src = 0u;
        var s_len = U.n_instrs;
        if (l > 0u) {
            let p = level_header(l - 1u) + HEADER_WORDS * (p_first + lid);
            s_src = out_u[p];
            s_len = out_u[p + 1u];
        }
        wg_src[lid] = s_src;
        wg_len[lid] = s_len;
    }
    if (lid < 3u) {
        wg_busy[lid] = 0u;
    }
    if (rule_on && lid < MAX_SLOTS) {
        atomicStore(&wg_minmax[lid], 0u);
    }
    workgroupBarrier();
    // each source tape's MIN / MAX records, counted by the whole workgroup (their sides' scratch;
    // rule_on is uniform: the barrier stays in uniform control flow)
    if (rule_on) {
        for (var s = 0u; s < n_slots; s++) {
            var count = 0u;
            for (var k = lid; k < wg_len[s]; k += WG) {
                iters += 1u;
                count += select(0u, 1u, is_minmax(source_record(l, wg_src[s], k).x & OP_MASK));
            }
            atomicAdd(&wg_minmax[s], count);
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        var longest = 0u;
        for (var s = 0u; s < n_slots; s++) {
            longest = max(longest, wg_len[s]);
        }
        wg_chunks = (longest + seg - 1u) / seg;
    }

    var h = vec3<u32>(0u, 0u, TILE_EMPTY);
    var working = false;
    var base = 0u;      // the tile's segment in wg_rec
    var len = 0u;
    var scratch = 0u;
    var sides = 0u;     // the MIN / MAX records' sides, 3 words each, in order
    var box_lo = vec3<f32>(0.0);
    var box_hi = vec3<f32>(0.0);
    if (t < n) {
        let ext = tile_extent(l, t);
        if (ext.ok) {
            var slot = 0u;
            var pcls = TILE_AMBIGUOUS;
            if (l > 0u) {
                slot = t / qq - p_first;
                pcls = out_u[level_header(l - 1u) + HEADER_WORDS * (t / qq) + 2u];
            }
            base = slot * seg;
            len = wg_len[slot];
            h = vec3<u32>(0u, 0u, pcls);
            if (pcls != TILE_FAILED && (pcls == TILE_AMBIGUOUS || !sign_mode())) {
                var side_words = 0u;
                if (rule_on) {
                    side_words = 3u * atomicLoad(&wg_minmax[slot]);
                }
                scratch = alloc((len + 7u) / 8u + side_words);
                sides = scratch + (len + 7u) / 8u;
                if (scratch == NO_ROOM) {
                    h.z = TILE_FAILED;
                } else {
                    working = true;
                }
            }
            box_lo = ext.lo;
            box_hi = ext.hi;
        }
    }
    let n_chunks = workgroupUniformLoad(&wg_chunks);
    var phase = 0u;     // chunks run so far (the wg_busy word of the next is phase % 3)

    // the interval pass
    var bits = 0u;
    var mm = 0u;        // MIN / MAX records walked
    for (var c = 0u; c < n_chunks; c++) {
        iters += 1u;
        if (!next_chunk(working, &phase, l, c, seg, n_slots, lid)) {
            break;
        }
        if (working) {
            let k0 = c * seg;
            let k1 = min(len, k0 + seg);
            var k = k0;
            var next = wg_rec[base];   // (the next record is read before working on this one)
            if (k1 > k && !take_iterations(k1 - k)) {
                k = k1;
            }
            loop {
                if (k >= k1) {
                    break;
                }
                let w = next;
                next = wg_rec[min(base + k + 1u - k0, CHUNK - 1u)];
                let op = w.x & OP_MASK;
                let a = (w.x >> 16u) & 0xffu;
                let bb = w.x >> 24u;
                var v = Iv(0.0, 0.0, CH_BOTH);
                var fold = 0u;
                if (op >= OP_BINARY_FIRST && op <= OP_TERNARY_LAST) {
                    let imm = bitcast<f32>(w.y);
                    let ia = select(ireg[a], vec2<f32>(imm), FOLD_CONSTANTS && (w.x & IMM_A) != 0u);
                    let ib = select(ireg[bb], vec2<f32>(imm), FOLD_CONSTANTS && (w.x & IMM_B) != 0u);
                    let ic = ireg[select(0u, w.y & 0xffu, op == OP_MIX)];
                    v = iv_binary(op, ia.x, ia.y, ib.x, ib.y, ic.x, ic.y);
                    if (rule_on && is_minmax(op)) {
                        store_sides(sides + 3u * mm, union_sides(op, ia, ib, v));
                        mm += 1u;
                    }
                    if (FOLD_CONSTANTS && foldable(op) && (w.x & (IMM_A | IMM_B)) == 0u) {
                        if (konst[bb]) {
                            fold = FOLDED;
                        } else if (konst[a]) {
                            fold = FOLDED | FOLD_A;
                        }
                    }
                } else if (op == OP_CONST) {
                    let cv = bitcast<f32>(w.y);
                    v = Iv(cv, cv, CH_BOTH);
                } else if (op <= OP_VAR_Z) {
                    v = Iv(box_lo[op], box_hi[op], CH_BOTH);
                } else if (op == OP_INSTANCE_INDEX) {
                    v = Iv(0.0, 0.0, CH_BOTH);
                } else {
                    let ia = ireg[a];
                    v = iv_unary(op, ia.x, ia.y);
                }
                let dst = (w.x >> 8u) & 0xffu;
                ireg[dst] = vec2<f32>(v.lo, v.hi);
                if (FOLD_CONSTANTS) {
                    konst[dst] = op == OP_CONST;
                }
                bits |= (v.ch | fold) << (4u * (k & 7u));
                if ((k & 7u) == 7u || k + 1u == len) {
                    out_u[scratch + k / 8u] = bits;
                    bits = 0u;
                }
                k += 1u;
            }
            if (overflow) {
                working = false;
            }
        }
    }
    var cls = TILE_AMBIGUOUS;
    if (ireg[0].y < 0.0) {
        cls = TILE_INSIDE;
    } else if (ireg[0].x >= 0.0) {
        cls = TILE_OUTSIDE;
    }
    var lower = nan();     // the header's lower bound (packed.wgsl HEADER_WORDS): where evaluated
    if (working && !overflow) {
        lower = ireg[0].x;
    }
    if (working || overflow) {
        h = vec3<u32>(0u, 0u, cls);
        if (cls != TILE_AMBIGUOUS && sign_mode()) {
            working = false;
        }
    }

    // backward liveness: a decided choice op becomes COPY dst <- chosen operand (nothing when
    // that is dst itself); records whose result is never read are dropped; an operand folded as
    // an immediate is not read, and the CONST that wrote it is marked FOLDED (capt); a live MIN /
    // MAX takes the union rule (union_rule) from its sides and the bound its reader passed. The
    // scratch word before the one in use is fetched ahead.
    live[0] = true;
    var sd_ahead = vec3<f32>(0.0);     // the sides of MIN / MAX record mm - 1 (the next one backward)
    if (rule_on && working && mm > 0u) {
        sd_ahead = load_sides(sides + 3u * mm - 3u);
    }
    var n_out = 0u;
    var word = 0u;
    var ahead = 0u;
    var wi = NO_ROOM;   // the scratch word `word` holds
    for (var cb = 0u; cb < n_chunks; cb++) {
        iters += 1u;
        let c = n_chunks - 1u - cb;
        if (!next_chunk(working, &phase, l, c, seg, n_slots, lid)) {
            break;
        }
        if (working) {
            let k0 = c * seg;
            var j = min(len, k0 + seg);
            var next = wg_rec[base + select(0u, j - k0 - 1u, j > k0)];
            if (j > k0 && !take_iterations(j - k0)) {
                j = k0;
            }
            loop {
                if (j <= k0) {
                    break;
                }
                j -= 1u;
                let w = next;
                next = wg_rec[base + select(0u, j - k0 - 1u, j > k0)];
                if (j / 8u != wi) {
                    if (wi != NO_ROOM) {
                        out_u[scratch + wi] = word;
                        word = ahead;
                    } else {
                        word = out_u[scratch + j / 8u];
                    }
                    wi = j / 8u;
                    if (wi > 0u) {
                        ahead = out_u[scratch + wi - 1u];
                    }
                }
                let dst = (w.x >> 8u) & 0xffu;
                let sh = 4u * (j & 7u);
                if (FOLD_CONSTANTS && capt[dst]) {    // (a CONST: the interval pass folds only those)
                    capt[dst] = false;
                    word |= FOLDED << sh;
                }
                let op = w.x & OP_MASK;
                var sd = vec3<f32>(0.0);
                if (rule_on && is_minmax(op)) {      // (the next MIN / MAX record's sides fetched ahead)
                    mm -= 1u;
                    sd = sd_ahead;
                    sd_ahead = load_sides(sides + 3u * max(mm, 1u) - 3u);
                }
                if (!live[dst]) {
                    continue;
                }
                live[dst] = false;
                let nib = (word >> sh) & 0xfu;
                var ch = nib & 3u;
                let folded = FOLD_CONSTANTS && (nib & FOLDED) != 0u && op != OP_CONST;
                var rule = UnionRule(0u, 0.0, ch);
                if (rule_on && is_minmax(op)) {
                    rule = union_rule(op == OP_MIN, ch, sd, rkind[dst], rbound[dst]);
                    word |= (rule.ch ^ ch) << sh;       // (a choice the rule made: from CH_BOTH)
                    ch = rule.ch;
                }
                if (ch != CH_BOTH && !folded) {
                    let kept = chosen(w.x, ch);
                    read_reg(kept, rule.kind, rule.h);
                    if (kept != dst) {
                        word |= EMITTED << sh;
                        n_out += 1u;
                    }
                    continue;
                }
                word |= EMITTED << sh;
                n_out += 1u;
                let nr = n_reads(op);
                let ra = (w.x >> 16u) & 0xffu;
                let rb = w.x >> 24u;
                let fold_a = folded && (nib & FOLD_A) != 0u;
                let fold_b = folded && (nib & FOLD_A) == 0u;
                if (fold_a) {
                    capt[ra] = true;
                } else if (fold_b) {
                    capt[rb] = true;
                }
                // an operand folded here, or by the parent's pruning, reads no register
                let imm_a = fold_a || (FOLD_CONSTANTS && (w.x & IMM_A) != 0u);
                let imm_b = fold_b || (FOLD_CONSTANTS && (w.x & IMM_B) != 0u);
                if (nr >= 1u && !imm_a) {
                    read_reg(ra, rule.kind, rule.h);
                }
                if (nr >= 2u && !imm_b) {
                    read_reg(rb, rule.kind, rule.h);
                }
                if (nr == 3u) {
                    read_reg(w.y & 0xffu, 0u, 0.0);
                }
            }
            if (overflow) {
                working = false;
            }
        }
    }
    if (working) {
        if (wi != NO_ROOM) {
            out_u[scratch + wi] = word;
        }
        let tape = alloc(2u * n_out);
        if (tape == NO_ROOM) {
            h = vec3<u32>(0u, 0u, TILE_FAILED);
            working = false;
        } else {
            h = vec3<u32>(tape, n_out, cls);
        }
    }

    // the emitted records in order, eight scratch nibbles a word; a FOLDED CONST gives its value
    // to the folded records after it, emitted or not
    var at = h.x;
    for (var c = 0u; c < n_chunks; c++) {
        iters += 1u;
        if (!next_chunk(working, &phase, l, c, seg, n_slots, lid)) {
            break;
        }
        if (working) {
            let k0 = c * seg;
            let w_end = (min(len, k0 + seg) + 7u) / 8u;
            var wj = k0 / 8u;
            var next = out_u[scratch + min(wj, max(w_end, 1u) - 1u)];   // (read a word ahead)
            loop {
                if (wj >= w_end || overflow) {
                    break;
                }
                if (!take_iteration()) {
                    break;
                }
                let full = next;
                next = out_u[scratch + min(wj + 1u, max(w_end, 1u) - 1u)];
                var m = full & select(0x44444444u, 0xccccccccu, FOLD_CONSTANTS);   // EMITTED (or FOLDED) nibbles
                loop {
                    if (m == 0u) {
                        break;
                    }
                    if (!take_iteration()) {
                        break;
                    }
                    let sh = firstTrailingBit(m) & ~3u;
                    m &= ~(0xfu << sh);
                    let nib = (full >> sh) & 0xfu;
                    let rec = wg_rec[base + wj * 8u + sh / 4u - k0];
                    let constant = (rec.x & OP_MASK) == OP_CONST;
                    if (FOLD_CONSTANTS && (nib & FOLDED) != 0u && constant) {
                        kval[(rec.x >> 8u) & 0xffu] = rec.y;
                    }
                    if ((nib & EMITTED) == 0u) {
                        continue;
                    }
                    let imm = select(kval[rec.x >> 24u], kval[(rec.x >> 16u) & 0xffu], (nib & FOLD_A) != 0u);
                    let out = written_record(rec, nib, !constant, imm);
                    out_u[at] = out.x;
                    out_u[at + 1u] = out.y;
                    at += 2u;
                }
                wj += 1u;
            }
            if (overflow) {
                working = false;
            }
        }
    }
    // the finest level's tapes, which the pixel and point passes run, renumbered into few
    // registers (renumber_registers; a coarser level's tapes are only pruned further, and the
    // walk over them would cost more than it saves: on the H200, renumbering every level slowed
    // prospero's 1024^2 image cells' pruning by 1.5-2.5 ms); their header's count: REG_CAP
    var regs = REG_CAP;
    if (working && !overflow && l + 1u == n_levels()) {
        regs = renumber_registers(h.x, h.y);
        atomicMax(&counters[COUNT_REGS], regs);
    }
    if (overflow) {
        note_overflow();
        h = vec3<u32>(0u, 0u, cls);
        regs = 0u;
        lower = nan();
    }
    if (t < n) {
        let hdr = level_header(l) + HEADER_WORDS * t;
        out_u[hdr] = h.x;
        out_u[hdr + 1u] = h.y;
        out_u[hdr + 2u] = h.z;
        out_u[hdr + 3u] = regs;
        out_u[hdr + 4u] = bitcast<u32>(lower);
    }
}

// ---- prune_wave: level 0 in dependency steps --------------------------------------------------
// prune_tiles' walks at level 0 are one invocation's serial walks over the whole tape: about 4 ms
// for prospero's 7,591 records on the H200, on the latency of one record after another. Level 0's
// source tape is the same for every tile, so the host (gpu_pruning.wave_schedule) orders its live
// records into dependency steps of at most WAVE_WIDTH records (each as late as its readers allow:
// prospero's 676 steps as written hold at most 23 records each and keep at most 166 values alive;
// with its MIN chain balanced, runtime/program.py, 132 steps of up to 64) and gives every value a
// slot of workgroup memory. One workgroup prunes one tile: invocation j runs record j
// of each step, step after step, with the next step's entry fetched while it works on this one's
// (nothing in an entry depends on the values). The results are prune_tiles' (the same intervals,
// choices, folds, liveness and records, in the full tape's order), bit for bit.
// The schedule follows the tape's records in `instrs` (from row U.n_instrs): a row (steps S, the
// result's operand (descriptor, kind, value), slots); WAVE_WIDTH entries a step, a row each
// (wave_entry; unused: zero); then a row per record: its operands' values (op, dst, a: of a, b, c).
// An operand is (descriptor, kind, value): (a slot, 0, -), (WAVE_LEAF | its CONST record, 1, the
// bits of the value), (WAVE_LEAF | its VAR record, 2, the axis) or (WAVE_LEAF | an INSTANCE_INDEX
// record or WAVE_NONE (no record wrote the register), 3, -: the value 0).
var<workgroup> wv_val: array<vec2<f32>, WAVE_SLOTS>;           // each slot's interval
var<workgroup> wv_demand: array<atomic<u32>, WAVE_SLOTS>;      // backward: the slot's value is read
var<workgroup> wv_nib: array<atomic<u32>, WAVE_RECORDS / 8u>;  // prune_tiles' scratch nibbles
var<workgroup> wv_part: array<u32, WG>;                        // the scan of emitted records
var<workgroup> wv_cls: u32;
var<workgroup> wv_lower: f32;   // level 0's result interval's lower bound (invocation 0's)
var<workgroup> wv_total: u32;
var<workgroup> wv_tape: u32;

// a step's record: w = op | dst << 8 | a << 16 | b << 24 (scene fields' ops as their arithmetic
// ones), its index k, its value's slot, its operands' descriptors, kinds (2 bits each) and values.
// Its row: w; k | slot << 13 | kinds << 22 | 1 << 28; the three values (a slot's: the slot); the
// 16-bit marks of a | b << 16 and of c (aux, jump: a slot or a leaf record as its kind says;
// 0xffff: none).
struct WaveEntry {
    w: u32,
    k: u32,
    slot: u32,
    d: vec3<u32>,
    kinds: u32,
    used: bool,
    v: vec3<u32>,
}

fn wave_descriptor(mark: u32, kind: u32) -> u32 {
    if (mark == 0xffffu) {
        return WAVE_NONE;
    }
    return select(WAVE_LEAF | mark, mark, kind == 0u);
}

fn wave_entry(s: u32, lane: u32, n_steps: u32) -> WaveEntry {
    if (s >= n_steps || lane >= WAVE_WIDTH) {
        return WaveEntry(0u, 0u, 0u, vec3<u32>(WAVE_NONE), 0xffu, false, vec3<u32>(0u));
    }
    let r = instrs[U.n_instrs + 1u + s * WAVE_WIDTH + lane];
    let kinds = (r.dst >> 22u) & 0x3fu;
    let d = vec3<u32>(wave_descriptor(r.aux & 0xffffu, kinds & 3u), wave_descriptor(r.aux >> 16u, (kinds >> 2u) & 3u),
                      wave_descriptor(r.jump & 0xffffu, kinds >> 4u));
    return WaveEntry(r.op, r.dst & 0x1fffu, (r.dst >> 13u) & 0x1ffu, d, kinds, (r.dst >> 28u) != 0u,
                     vec3<u32>(r.a, r.b, r.c));
}

// the interval of an operand over the tile's box, without branches (a step's records read
// operands of every kind side by side)
fn wave_value(kind: u32, v: u32, lo: vec3<f32>, hi: vec3<f32>) -> vec2<f32> {
    let slot = wv_val[min(v, WAVE_SLOTS - 1u)];
    let axis = vec2<f32>(select(select(lo.x, lo.y, v == 1u), lo.z, v == 2u),
                         select(select(hi.x, hi.y, v == 1u), hi.z, v == 2u));
    var r = select(vec2<f32>(0.0), axis, kind == 2u);
    r = select(r, vec2<f32>(bitcast<f32>(v)), kind == 1u);
    return select(r, slot, kind == 0u);
}

fn wave_set(k: u32, bits: u32) {
    atomicOr(&wv_nib[k / 8u], bits << (4u * (k & 7u)));
}

// backward: the value a descriptor names is read by an emitted record
fn wave_read(d: u32) {
    if (d == WAVE_NONE) {
        return;
    }
    if (d < WAVE_LEAF) {
        atomicOr(&wv_demand[d], 1u);
    } else {
        wave_set(d & ~WAVE_LEAF, EMITTED);
    }
}

fn wave_header(hdr: u32, h: vec4<u32>, lower: f32) {
    out_u[hdr] = h.x;
    out_u[hdr + 1u] = h.y;
    out_u[hdr + 2u] = h.z;
    out_u[hdr + 3u] = h.w;
    out_u[hdr + 4u] = bitcast<u32>(lower);
}

@compute @workgroup_size(WG)
fn prune_wave(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
              @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = wid.y * nwg.x + wid.x;
    let l = u32(U.extra.w);
    if (t >= level_tiles(l)) {
        return;
    }
    let hdr = level_header(l) + HEADER_WORDS * t;
    let ext = tile_extent(l, t);
    if (!ext.ok) {
        if (lid == 0u) {
            wave_header(hdr, vec4<u32>(0u, 0u, TILE_EMPTY, REG_CAP), nan());
        }
        return;
    }
    let head = instrs[U.n_instrs];
    let n_steps = head.op;
    let n_words = (U.n_instrs + 7u) / 8u;
    for (var i = lid; i < WAVE_SLOTS; i += WG) {
        atomicStore(&wv_demand[i], 0u);
    }
    for (var i = lid; i < n_words; i += WG) {
        atomicStore(&wv_nib[i], 0u);
    }
    workgroupBarrier();

    // the interval pass, a step at a time
    var e = wave_entry(0u, lid, n_steps);
    for (var s = 0u; s < n_steps; s++) {
        let next = wave_entry(s + 1u, lid, n_steps);
        if (e.used) {
            let op = e.w & OP_MASK;
            var v = Iv(0.0, 0.0, CH_BOTH);
            var fold = 0u;
            let a = wave_value(e.kinds & 3u, e.v.x, ext.lo, ext.hi);
            if (op <= OP_UNARY_LAST) {
                v = iv_unary(op, a.x, a.y);
            } else {
                let b = wave_value((e.kinds >> 2u) & 3u, e.v.y, ext.lo, ext.hi);
                let c = wave_value((e.kinds >> 4u) & 3u, e.v.z, ext.lo, ext.hi);
                v = iv_binary(op, a.x, a.y, b.x, b.y, c.x, c.y);
                if (FOLD_CONSTANTS && foldable(op)) {     // (a CONST operand: kind 1)
                    if (((e.kinds >> 2u) & 3u) == 1u) {
                        fold = FOLDED;
                    } else if ((e.kinds & 3u) == 1u) {
                        fold = FOLDED | FOLD_A;
                    }
                }
            }
            wv_val[e.slot] = vec2<f32>(v.lo, v.hi);
            wave_set(e.k, v.ch | fold);
        }
        workgroupBarrier();
        e = next;
    }
    if (lid == 0u) {
        let r = wave_value(head.a, head.b, ext.lo, ext.hi);
        var cls = TILE_AMBIGUOUS;
        if (r.y < 0.0) {
            cls = TILE_INSIDE;
        } else if (r.x >= 0.0) {
            cls = TILE_OUTSIDE;
        }
        wv_cls = cls;
        wv_lower = r.x;
        wave_read(head.dst);
    }
    let cls = workgroupUniformLoad(&wv_cls);
    if (cls != TILE_AMBIGUOUS && sign_mode()) {
        if (lid == 0u) {
            wave_header(hdr, vec4<u32>(0u, 0u, cls, REG_CAP), wv_lower);
        }
        return;
    }

    // backward liveness (prune_tiles' rules), a step at a time from the last: a slot's reads are
    // taken (and cleared for the value it held before) by the record that wrote it
    e = wave_entry(n_steps - 1u, lid, n_steps);
    for (var sb = 0u; sb < n_steps; sb++) {
        let next = wave_entry(n_steps - 2u - sb, lid, n_steps);   // (past the first: wraps, unused)
        if (e.used && atomicExchange(&wv_demand[e.slot], 0u) != 0u) {
            let nib = (atomicLoad(&wv_nib[e.k / 8u]) >> (4u * (e.k & 7u))) & 0xfu;
            let ch = nib & 3u;
            let folded = FOLD_CONSTANTS && (nib & FOLDED) != 0u;
            if (ch != CH_BOTH && !folded) {
                wave_read(select(e.d.y, e.d.x, ch == CH_A));
                if (chosen(e.w, ch) != ((e.w >> 8u) & 0xffu)) {
                    wave_set(e.k, EMITTED);
                }
            } else {
                wave_set(e.k, EMITTED);
                let nr = n_reads(e.w & OP_MASK);
                let fold_a = folded && (nib & FOLD_A) != 0u;
                let fold_b = folded && (nib & FOLD_A) == 0u;
                if (fold_a) {
                    wave_set(e.d.x & ~WAVE_LEAF, FOLDED);
                } else if (fold_b) {
                    wave_set(e.d.y & ~WAVE_LEAF, FOLDED);
                }
                if (nr >= 1u && !fold_a) {
                    wave_read(e.d.x);
                }
                if (nr >= 2u && !fold_b) {
                    wave_read(e.d.y);
                }
                if (nr == 3u) {
                    wave_read(e.d.z);
                }
            }
        }
        workgroupBarrier();
        e = next;
    }

    // the emitted records (prune_tiles' writing pass), in order: each invocation writes those of
    // its run of nibble words after the ones of the runs before (a scan); a decided choice as a
    // COPY of its chosen operand, a folded operand as its CONST's value
    let per = (n_words + WG - 1u) / WG;
    let w0 = min(lid * per, n_words);
    let w1 = min(w0 + per, n_words);
    var run = 0u;
    for (var j = w0; j < w1; j++) {
        run += countOneBits(atomicLoad(&wv_nib[j]) & 0x44444444u);
    }
    wv_part[lid] = run;
    workgroupBarrier();
    if (lid == 0u) {
        var total = 0u;
        for (var j = 0u; j < WG; j++) {
            let c = wv_part[j];
            wv_part[j] = total;
            total += c;
        }
        wv_total = total;
        wv_tape = alloc(2u * total);
    }
    let tape = workgroupUniformLoad(&wv_tape);
    let n_out = workgroupUniformLoad(&wv_total);
    if (tape == NO_ROOM) {
        if (lid == 0u) {
            wave_header(hdr, vec4<u32>(0u, 0u, TILE_FAILED, REG_CAP), nan());
        }
        return;
    }
    let consts = U.n_instrs + 1u + WAVE_WIDTH * n_steps;
    var at = tape + 2u * wv_part[lid];
    for (var j = w0; j < w1; j++) {
        let word = atomicLoad(&wv_nib[j]);
        var m = word & 0x44444444u;
        loop {
            if (m == 0u) {
                break;
            }
            let sh = firstTrailingBit(m) & ~3u;
            m &= ~(0xfu << sh);
            let k = 8u * j + sh / 4u;
            let nib = (word >> sh) & 0xfu;
            let rec = pack_record(instrs[k]);
            let values = instrs[consts + k];
            let out = written_record(rec, nib, (rec.x & OP_MASK) != OP_CONST,
                                     select(values.dst, values.op, (nib & FOLD_A) != 0u));
            out_u[at] = out.x;
            out_u[at + 1u] = out.y;
            at += 2u;
        }
    }
    storageBarrier();

    // the finest level's tape renumbered (as prune_tiles) by invocation 0, and the header
    if (lid == 0u) {
        var h = vec4<u32>(tape, n_out, cls, REG_CAP);
        if (l + 1u == n_levels()) {
            h.w = renumber_registers(tape, n_out);
            atomicMax(&counters[COUNT_REGS], h.w);
        }
        var lower = wv_lower;
        if (overflow) {
            note_overflow();
            h = vec4<u32>(0u, 0u, cls, 0u);
            lower = nan();
        }
        wave_header(hdr, h, lower);
    }
}

// ---- register renumbering: a pruned tape keeps few of its full tape's values alive at once, and a
// pixel pass whose pipeline holds fewer registers (a smaller REG_CAP variant) is faster: its
// register array is zero-initialised at the start of every invocation (WGSL's private variables)
var<private> renamed: array<u32, REG_CAP>;   // renumber_registers: old register -> new one + 1 (0: none)
var<private> taken: array<u32, 8>;           // the new registers in use, a bit each (REG_CAP <= 256)
var<private> taken_full: u32;                // bit i: word i of `taken` is full

fn take_register() -> u32 {
    let i = firstTrailingBit(~taken_full);
    let b = firstTrailingBit(~taken[i]);
    taken[i] |= 1u << b;
    if (taken[i] == 0xffffffffu) {
        taken_full |= 1u << i;
    }
    return 32u * i + b;
}

fn free_register(r: u32) {
    taken[r / 32u] &= ~(1u << (r % 32u));
    taken_full &= ~(1u << (r / 32u));
}

// the new register of old register r, read here: taken (the lowest free) when this is, going
// backward, r's first read (forward: its last)
fn read_register(r: u32, regs: ptr<function, u32>) -> u32 {
    if (renamed[r] == 0u) {
        let k = take_register();
        renamed[r] = k + 1u;
        *regs = max(*regs, k + 1u);
    }
    return renamed[r] - 1u;
}

// renumbers the registers of the packed tape of `len` records at word `first` of out_u in place,
// walking it backward: a record's result frees its register (the value is not live before it),
// then each operand's value takes one where its last read is; register 0 holds the result at the
// end. The values are the same, bit for bit; returns how many registers the tape now uses.
fn renumber_registers(first: u32, len: u32) -> u32 {
    var regs = 1u;
    renamed[0] = 1u;
    taken[0] = 1u;
    var j = len;
    loop {
        if (j == 0u) {
            break;
        }
        if (!take_iteration()) {
            break;
        }
        j -= 1u;
        let at = first + 2u * j;
        let w0 = out_u[at];
        var w1 = out_u[at + 1u];
        let op = w0 & OP_MASK;
        let dst = (w0 >> 8u) & 0xffu;
        var nd = 0u;
        if (renamed[dst] == 0u) {     // (a result nothing reads: pruning emits none)
            nd = take_register();
            regs = max(regs, nd + 1u);
        } else {
            nd = renamed[dst] - 1u;
            renamed[dst] = 0u;
        }
        free_register(nd);
        let nr = n_reads(op);
        var na = 0u;
        var nb = 0u;
        if (nr >= 1u && (w0 & IMM_A) == 0u) {
            na = read_register((w0 >> 16u) & 0xffu, &regs);
        }
        if (nr >= 2u && (w0 & IMM_B) == 0u) {
            nb = read_register(w0 >> 24u, &regs);
        }
        if (nr == 3u) {
            w1 = (w1 & ~0xffu) | read_register(w1 & 0xffu, &regs);
        }
        out_u[at] = (w0 & 0xffu) | (nd << 8u) | (na << 16u) | (nb << 24u);
        out_u[at + 1u] = w1;
    }
    return regs;
}

// (row, column) of invocation i of a pixel pass: workgroup after workgroup, an 8 x 8 block of
// pixels each (so a warp's pixels share a tile's or a cell's tape), blocks in rows
fn block_pixel(i: u32) -> vec2<u32> {
    let blocks_x = (U.width + BLOCK - 1u) / BLOCK;
    let blk = i / (BLOCK * BLOCK);
    return vec2<u32>((blk / blocks_x) * BLOCK + (i % (BLOCK * BLOCK)) / BLOCK, (blk % blocks_x) * BLOCK + i % BLOCK);
}

// the value of a pixel pass at p on the packed tape whose header is at word `hdr` of out_u: its
// tape at p (run_packed: run_tape's arithmetic op for op, so field_image's bits), or, in the sign
// image, the sign of a decided tile or cell (-1 inside, 1 outside); NaN where the tile or cell
// found no arena room (the host runs the image again) or where its tape needs more registers
// than this pipeline's REG_CAP (counted: the host runs the pass again in the tape's own variant)
fn packed_pixel(hdr: u32, p: vec3<f32>) -> f32 {
    let cls = out_u[hdr + 2u];
    if (cls == TILE_FAILED) {
        return nan();
    }
    if (cls != TILE_AMBIGUOUS && sign_mode()) {
        return select(1.0, -1.0, cls == TILE_INSIDE);
    }
    if (out_u[hdr + 3u] > REG_CAP) {
        atomicAdd(&counters[COUNT_REGS_REFUSED], 1u);
        return nan();
    }
    let v = run_packed(out_u[hdr], out_u[hdr + 1u], p);
    if (overflow) {
        note_overflow();
    }
    return v;
}

// the sign image's bits, besides its values: the 64 invocations of a pixel pass's workgroup OR
// their pixel's "inside" bit into the two words of its 8 x 8 block (bit k of word j: the block's
// pixel 32 j + k, rows of 8), written to out_u from word bits(U.camera[1].w), block after block,
// so that the host reads 1 bit a pixel instead of a float. Called in uniform control flow.
var<workgroup> wg_sign: array<atomic<u32>, 2>;

fn sign_bits(blk: u32, lid: u32, inside: bool) {
    if (lid < 2u) {     // (cleared here: on lavapipe a workgroup found an earlier one's bits there)
        atomicStore(&wg_sign[lid], 0u);
    }
    workgroupBarrier();
    if (inside) {
        atomicOr(&wg_sign[lid / 32u], 1u << (lid % 32u));
    }
    workgroupBarrier();
    if (lid < 2u) {
        out_u[bitcast<u32>(U.camera[1].w) + 2u * blk + lid] = atomicLoad(&wg_sign[lid]);
    }
}

// a pixel pass's invocation i (local index lid): packed_pixel at its pixel centre on its finest
// tile's tape (pruned_image) or, `on_cells`, on its cell's (cells_image). out_f[row * width +
// col] = the value; in the sign image (U.extra.z = 1) also its bit (sign_bits). Every invocation
// of the workgroup calls it (sign_bits has barriers).
fn pixel_pass(i: u32, lid: u32, on_cells: bool) {
    let rc = block_pixel(i);
    var v = 1.0;
    if (rc.x < U.height && rc.y < U.width) {
        if (on_cells) {
            let g = march_cells();
            let p = vec3<f32>(pixel_x(rc.y), pixel_y(rc.x), g.lo.z);
            v = packed_pixel(cell_header(g, p), p);
        } else {
            let hdr = level_header(n_levels() - 1u) + HEADER_WORDS * pixel_tile(rc.x, rc.y);
            v = packed_pixel(hdr, vec3<f32>(pixel_x(rc.y), pixel_y(rc.x), U.extra.x));
        }
        out_f[rc.x * U.width + rc.y] = v;
    }
    if (sign_mode()) {
        sign_bits(i / (BLOCK * BLOCK), lid, v < 0.0);
    }
}

// one invocation per pixel, 8 x 8 pixels a workgroup (so a warp's pixels share a tile's tape), on
// the tiles the prune_tiles passes before it pruned (pixel_pass)
@compute @workgroup_size(WG)
fn pruned_image(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
                @builtin(num_workgroups) nwg: vec3<u32>) {
    pixel_pass(flat_index(wid, lid, nwg), lid, false);
}

// one invocation per pixel, 8 x 8 pixels a workgroup, on flat cells (packed.wgsl MarchCells, kept
// by the host from an earlier image of the tape; the descriptor at word bits(U.extra.x) of the
// points buffer, the plane's z its lo.z; the host picks the smallest register variant holding
// every finest cell's registers): pixel_pass on the pixel centre's cell
@compute @workgroup_size(WG)
fn cells_image(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    pixel_pass(flat_index(wid, lid, nwg), lid, true);
}

// one invocation per point of GpuWalker.evaluate_pruned (points mode): the host uploads the points
// sorted by their finest cell (so a warp shares a cell's tape), five floats each from word
// bits(U.camera[1].y) of the points buffer: x, y, z, the finest cell's index, the point's index in
// the caller's order (floats, exact below 2^24). out_f[index] = the value of the cell's pruned
// tape at the point (the full tape's bits: the cell's box holds the point), NaN where the cell
// found no arena room (the host runs the points again).
@compute @workgroup_size(WG)
fn pruned_points(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
                 @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = flat_index(wid, lid, nwg);
    if (i >= U.n_items) {
        return;
    }
    let q = bitcast<u32>(U.camera[1].y) + 5u * i;
    let o = u32(points[q + 4u]);
    let hdr = level_header(n_levels() - 1u) + HEADER_WORDS * u32(points[q + 3u]);
    if (out_u[hdr + 2u] == TILE_FAILED) {
        out_f[o] = nan();
        return;
    }
    out_f[o] = run_packed(out_u[hdr], out_u[hdr + 1u], vec3<f32>(points[q], points[q + 1u], points[q + 2u]));
    if (overflow) {
        note_overflow();
    }
}
