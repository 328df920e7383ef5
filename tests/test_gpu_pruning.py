"""Hierarchical per-tile interval pruning on the GPU walker (shaders/prune.wgsl, GpuWalker.sign_image /
field_image_pruned / prune_levels).

* the pruned field equals the unpruned GPU field_image bit for bit, for the models, prospero with
  one to four tile levels (sizes that divide their parents' and sizes that do not), random
  arithmetic tapes using every op, other planes / rects, and tiles that do not divide the image;
* the sign image equals field_image < 0 on the GPU exactly, the CPU twin's pruned sign image and
  the reference PNG;
* images on flat cells (``cells``) are field_image's bits too, for prospero and random tapes, and
  are kept for later images inside their rectangle (pans, zooms, other sizes), pruned again for
  a wider rectangle, another plane or tape, an edit or another pass in between;
* finer levels prune their parents' tapes further, and the finest level's tapes are renumbered
  into few registers, so that the pixel passes run in a small register variant (a pixel finding
  a tape with more is refused, and the pass run again in the tape's own); the march cells' tapes
  fold constant operands into the records that read them; an arena too small for the pruned
  tapes is grown and the image run again (same bits); past the binding limit it is a
  TaperayError;
* no shader module or pipeline is created by any of it (the kernels are made once per process);
* tapes that need more loop iterations than the adapter allows are refused, non-arithmetic tapes
  fall back to the unpruned kernel, bad tile levels are TaperayErrors.
"""
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from taperay.runtime.gpu import GpuProfiler
from taperay.runtime.gpu_pruning import (PRUNE_HEADER_WORDS, WAVE_MAX_TILES, image_cell_box, image_tiles,
                                          level_tile_counts, march_cells, tile_levels, wave_schedule)
from taperay.runtime.opcodes import Op
from taperay.runtime.pruning import sign_image as cpu_sign_image
from taperay.runtime.shading import RenderSettings
from taperay.runtime.tape import INSTR_DTYPE, Tape, TaperayError, material_array
from taperay.scenegraph.vm import load_vm
from test_pruning import random_tape, tape_of

EXACT = RenderSettings(cell_skip=False)   # marches on cells without empty-space skipping: the whole tape's steps

pytestmark = pytest.mark.gpu

DATA = Path(__file__).parent / "data"


def bits(v):
    return np.asarray(v, np.float32).view(np.uint32)


def grid_rect(n):
    """Pixel centres at linspace(-1, 1, n), as the reference PNG's."""
    h = 1.0 / (n - 1)
    return (-1 - h, 1 + h, -1 - h, 1 + h)


@pytest.fixture
def no_new_kernels(walker_gpu):
    """Asserts, after the test, that no shader module or pipeline was created and no cache miss
    (every pipeline made: conftest)."""
    walker_gpu.kernels.settle()
    before = walker_gpu.stats()
    yield
    after = walker_gpu.stats()
    for k in ("shader_modules_created", "pipelines_created", "cache_misses", "pipelines"):
        assert after[k] == before[k], k


@pytest.mark.slow
@pytest.mark.parametrize("model,size,tiles,z", [("quarter", 48, 16, 0.0), ("hi", 64, (16, 4), 0.0),
                                                ("sphere", 40, (12, 5), 0.3), ("tanglecube", 40, (16, 3), -0.7),
                                                ("prospero", 48, 16, 0.0)])
def test_models_pruned_field_is_bit_identical_to_field_image(walker_gpu, no_new_kernels, model, size, tiles, z):
    tape = load_vm(DATA / f"{model}.vm")
    rect = (-1.3, 1.1, -1.2, 1.25)
    full = walker_gpu.field_image(tape, size, size - 5, rect, z)
    pruned = walker_gpu.field_image_pruned(tape, size, size - 5, rect, z, tiles=tiles)
    np.testing.assert_array_equal(bits(pruned), bits(full))
    inside = walker_gpu.sign_image(tape, size, size - 5, rect, z, tiles=tiles)
    np.testing.assert_array_equal(inside, full < 0)


@pytest.mark.parametrize("seed", range(24))
def test_random_tapes_pruned_field_is_bit_identical(walker_gpu, no_new_kernels, seed):
    """Random arithmetic tapes over every op (test_pruning.random_tape); NaN where both are NaN."""
    tape = random_tape(seed)
    rng = np.random.default_rng(seed)
    c = rng.uniform(-1.5, 1.5, 2)
    half = rng.choice([0.01, 0.3, 2.0])
    rect = (c[0] - half, c[0] + half, c[1] - half, c[1] + half)
    z = float(rng.uniform(-1, 1))
    full = walker_gpu.field_image(tape, 24, 20, rect, z)
    tiles = [3, 8, 64, (8, 3), (64, 5, 2), (7, 3, 2, 1)][seed % 6]
    pruned = walker_gpu.field_image_pruned(tape, 24, 20, rect, z, tiles=tiles)
    same = (bits(pruned) == bits(full)) | (np.isnan(pruned) & np.isnan(full))
    assert same.all(), (seed, tiles, int((~same).sum()))
    np.testing.assert_array_equal(walker_gpu.sign_image(tape, 24, 20, rect, z, tiles=(5, 2)), full < 0)


@pytest.fixture(scope="module")
def prospero_96(walker_gpu):
    """prospero's unpruned GPU field image at 96^2 on the reference grid (~10 s on lavapipe)."""
    tape = load_vm(DATA / "prospero.vm")
    return tape, walker_gpu.field_image(tape, 96, 96, grid_rect(96))


def test_image_tiles_keep_level_0_in_dependency_steps():
    """image_tiles: level 0 as fine as WAVE_MAX_TILES tiles allow (from 32 px), quarters to 8 px."""
    assert image_tiles(1024, 1024) == (32, 8) and image_tiles(4096, 4096) == (128, 32, 8)
    assert image_tiles(1920, 1080) == (64, 16) and image_tiles(64, 48) == (32, 8)
    for w, h in [(1, 1), (1024, 1025), (333, 7000), (8192, 8192)]:
        tiles = image_tiles(w, h)
        assert tile_levels(tiles) == tiles and level_tile_counts(tiles, w, h)[0] <= WAVE_MAX_TILES
        assert tiles[0] == 32 or level_tile_counts((tiles[0] // 2,), w, h)[0] > WAVE_MAX_TILES


@pytest.mark.slow
@pytest.mark.parametrize("tiles", [48, (48, 12), (32, 8, 2), (40, 9, 4, 1)])
def test_prospero_tile_levels_are_bit_identical(walker_gpu, no_new_kernels, prospero_96, tiles):
    """Every level prunes its parent's tape; the pixels of the finest give field_image's bits."""
    tape, full = prospero_96
    n = full.shape[0]
    pruned = walker_gpu.field_image_pruned(tape, n, n, grid_rect(n), tiles=tiles)
    np.testing.assert_array_equal(bits(pruned), bits(full))
    np.testing.assert_array_equal(walker_gpu.sign_image(tape, n, n, grid_rect(n), tiles=tiles), full < 0)


@pytest.mark.slow
def test_finer_levels_have_shorter_tapes(walker_gpu, no_new_kernels, prospero_96):
    tape, full = prospero_96
    n = full.shape[0]
    field = walker_gpu.prune_levels(tape, n, n, grid_rect(n), tiles=(32, 8, 2))
    assert [lv["tiles"] for lv in field] == [9, 144, 2304]
    assert all(lv["with_tape"] == lv["tiles"] for lv in field)   # the field image: every tile
    lengths = [lv["mean_length"] for lv in field]
    assert len(tape) > lengths[0] > lengths[1] > lengths[2] > 0, lengths
    sign = walker_gpu.prune_levels(tape, n, n, grid_rect(n), tiles=(32, 8, 2), sign=True)
    for lv in sign:   # decided tiles (and their sub-tiles) need no tape
        assert lv["inside"] + lv["outside"] + lv["with_tape"] == lv["tiles"]
    assert sign[-1]["with_tape"] < 0.5 * sign[-1]["tiles"]


FOLDING_VM = """# constants used as an operand only: pruning writes them as immediates
_c const 0.5
_x var-x
_y var-y
_m mul _x _c
_s sub _c _y
_d sub _m _s
_r mul _d _c
"""


@pytest.mark.parametrize("cells", [(2, 1), (2, 2), (1, 3)])
def test_march_cells_fold_constant_operands_into_their_records(walker_gpu, no_new_kernels, cells):
    """x, y, x * c (c as b), c - y (c as a), their difference times c (a plane): the march cells'
    tapes have 6 records, the CONST folded into the three records that read it, at every level (a
    finer level reads its parent's immediates), and march on them bit for bit as on the whole
    tape. Images and points are pruned without folding (their pruning runs every call): 7."""
    from taperay.runtime.camera import Camera
    tape = load_vm(FOLDING_VM)
    assert len(tape) == 7
    levels = walker_gpu.march_cell_levels(tape, cells=cells)
    assert [lv["mean_length"] for lv in levels] == [6] * cells[1]
    assert [lv["mean_length"] for lv in walker_gpu.prune_levels(tape, 40, 36, tiles=(16, 4))] == [7, 7]
    cam = Camera(eye=(0.3, -2.5, 1.5), target=(0, 0, 0), fov_deg=50)
    full = walker_gpu.march(tape, cam, 32, 24, settings=EXACT, cells=None)
    assert full["hit"].mean() > 0.1
    assert _same_bits(walker_gpu.march(tape, cam, 32, 24, settings=EXACT, cells=cells), full)


UNION_VM = """# a union whose inner operand b never decides it: over [-1, 1]^3, a = 10 sin x (on the GPU its
# interval is [-10, 10] on every box), b = y + 5, c = y + 1; min(a, b) keeps both by their
# intervals, the outer min both too, yet b >= 4 > 2 >= the union
_x var-x
_y var-y
_s sin _x
_ten const 10
_a mul _s _ten
_five const 5
_b add _y _five
_i min _a _b
_one const 1
_c add _y _one
_r min _i _c
"""


def test_march_cells_take_the_union_rule_on_sub_cells(walker_gpu, no_new_kernels):
    """One march cell over the whole box, in 4^3 sub-cells. Level 0 prunes by the sibling rule
    alone: both of its cells (the box, the outside cell) keep 8 records (x, y, sin, 10 sin, y + 5,
    the inner MIN, y + 1, the outer MIN; the CONSTs folded). Every sub-cell also takes the union
    rule and drops b (y + 5 and the inner MIN, which becomes r <- a in a's register): 6 records.
    The march on the cells is bit for bit the whole tape's. Images prune without the rule: per
    call (prune_tiles) all 11 records on both levels, on image cells (prune_image_cells) 8 on
    both."""
    from taperay.runtime.camera import Camera
    tape = load_vm(UNION_VM)
    assert np.array_equal(tape.bounds, [[-1, -1, -1], [1, 1, 1]])
    levels = walker_gpu.march_cell_levels(tape, cells=(1, 2))
    assert [(lv["mean_length"], lv["with_tape"]) for lv in levels] == [(8, 2), (6, 64)]
    assert [lv["mean_length"] for lv in walker_gpu.prune_levels(tape, 16, 16, tiles=(16, 8))] == [len(tape)] * 2
    walker_gpu.drop_kept_cells()
    assert [lv["mean_length"] for lv in walker_gpu.image_cell_levels(tape, 16, 16, cells=(1, 2), sign=True)] == [8, 8]
    cam = Camera(eye=(0.3, -2.5, 1.5), target=(0, 0, 0), fov_deg=50)
    full = walker_gpu.march(tape, cam, 32, 24, settings=EXACT, cells=None)
    assert full["hit"].mean() > 0.1
    assert _same_bits(walker_gpu.march(tape, cam, 32, 24, settings=EXACT, cells=(1, 2)), full)


@pytest.mark.slow
def test_a_small_arena_is_grown_and_the_image_run_again(walker_gpu, no_new_kernels, prospero_96, monkeypatch):
    tape, full = prospero_96
    n = full.shape[0]
    monkeypatch.setattr(walker_gpu, "arena_words", 1000)
    pruned = walker_gpu.field_image_pruned(tape, n, n, grid_rect(n), tiles=(32, 8))
    np.testing.assert_array_equal(bits(pruned), bits(full))
    assert walker_gpu.arena_words > 1000


def test_an_arena_beyond_the_binding_limit_is_a_taperay_error(walker_gpu, no_new_kernels, monkeypatch):
    """A tape of 7,591 records pruned per 4 px of a 64^2 image does not fit in 256 KiB."""
    tape = load_vm(DATA / "prospero.vm")
    monkeypatch.setattr(walker_gpu, "arena_words", 1000)
    monkeypatch.setitem(walker_gpu.context.limits, "max_storage_buffer_binding_size", 1 << 18)
    with pytest.raises(TaperayError, match="binding limit"):
        walker_gpu.field_image_pruned(tape, 64, 64, tiles=(16, 4))


@pytest.mark.slow
def test_prospero_sign_image_equals_the_cpu_twin(walker_gpu, no_new_kernels):
    """128^2 on the reference grid: decided tiles are filled, the rest evaluate pruned tapes."""
    tape = load_vm(DATA / "prospero.vm")
    n = 128
    inside = walker_gpu.sign_image(tape, n, n, grid_rect(n), tiles=(32, 8))
    assert inside.dtype == bool and inside.shape == (n, n)
    twin = cpu_sign_image(tape, n, n, grid_rect(n))
    assert (inside != twin).mean() <= 1e-4


@pytest.mark.slow
def test_prospero_1024_sign_image_matches_the_reference_png(walker_gpu, no_new_kernels):
    """The acceptance image (<= 0.01 % of pixels may differ); ~5 s on lavapipe."""
    n = 1024
    ref = np.asarray(Image.open(DATA / "prospero_1024.png")) == 255
    inside = walker_gpu.sign_image(load_vm(DATA / "prospero.vm"), n, n, grid_rect(n))
    assert (inside != ref).mean() <= 1e-4, int((inside != ref).sum())


def _chain_tape(n):
    """x + 1 + 1 + ... (n records): needs over 2n loop iterations in the tile pass (interval and
    liveness passes, then writing the n records out and renumbering their registers)."""
    ins = np.zeros(n, INSTR_DTYPE)
    ins[0]["op"] = 0            # VAR_X into r0
    ins[1]["op"], ins[1]["dst"] = 3, 1      # CONST 1 into r1
    ins[2:]["op"], ins[2:]["a"], ins[2:]["b"] = 22, 0, 1   # r0 = r0 + r1
    mats = material_array([(0.5, 0.5, 0.5)], 0.5)
    return Tape(ins, np.array([1.0], np.float32), mats, 2, np.array([[-1, -1, -1], [1, 1, 1]], np.float32))


def test_tapes_beyond_the_iteration_cap_are_refused(walker_gpu, no_new_kernels):
    cap = walker_gpu.iteration_limits[0]
    if cap >= 1 << 31:
        pytest.skip("a hardware adapter has no loop-iteration cap")
    ok = _chain_tape(cap // 6)      # (the field image always runs every walk: interval, liveness,
                                    # writing (two loops), register renumbering)
    np.testing.assert_array_equal(bits(walker_gpu.field_image_pruned(ok, 4, 4, tiles=(4, 2))),
                                  bits(walker_gpu.field_image(ok, 4, 4)))
    with pytest.raises(TaperayError, match="interpreter steps"):
        walker_gpu.field_image_pruned(_chain_tape(cap // 2 + 10), 4, 4, tiles=(4, 2))


def test_non_arithmetic_tapes_use_the_unpruned_kernel(walker_gpu, no_new_kernels):
    ins = np.zeros(1, INSTR_DTYPE)
    ins[0]["op"] = Op.SPHERE
    tape = Tape(ins, np.array([0.7], np.float32), material_array([(0.5, 0.5, 0.5)], 0.5), 1,
                np.array([[-1, -1, -1], [1, 1, 1]], np.float32))
    full = walker_gpu.field_image(tape, 16, 16)
    np.testing.assert_array_equal(walker_gpu.sign_image(tape, 16, 16), full < 0)
    np.testing.assert_array_equal(bits(walker_gpu.field_image_pruned(tape, 16, 16)), bits(full))


def test_bad_arguments_raise_taperay_errors(walker_gpu):
    tape = load_vm(DATA / "quarter.vm")
    for tiles in (0, 1 << 17, (16, 32), (16, 16), (64, 32, 16, 8, 4), (), (8, 2.5), "8"):
        with pytest.raises(TaperayError, match="tile"):
            walker_gpu.sign_image(tape, 8, 8, tiles=tiles)
    with pytest.raises(TaperayError):
        walker_gpu.field_image_pruned(tape, 0, 8)


# ---- image cells: flat cells over the image's rectangle, pruned once and kept for later images
@pytest.mark.slow
@pytest.mark.parametrize("cells,decided", [((1, 1), 0.0), ((3, 2), 0.05), ((4, 3), 0.4), ((2, 4), 0.5)])
def test_prospero_image_cells_are_bit_identical(walker_gpu, no_new_kernels, prospero_96, cells, decided):
    """Every pixel runs its cell's tape: field_image's bits. The sign image fills the pixels of
    decided cells with -1 / 1 unevaluated: over ``decided`` of the pixels are such (7 %, 51 %
    and 67 % when written), so they found their own cell (a pixel that misses its cell runs the
    outside cell's whole tape, also exact)."""
    tape, full = prospero_96
    n = full.shape[0]
    walker_gpu.drop_kept_cells()
    pruned = walker_gpu.field_image_pruned(tape, n, n, grid_rect(n), cells=cells)
    np.testing.assert_array_equal(bits(pruned), bits(full))
    np.testing.assert_array_equal(walker_gpu.sign_image(tape, n, n, grid_rect(n), cells=cells), full < 0)
    walker_gpu.sign_image(tape, n, n, grid_rect(n), cells=cells)
    raw = walker_gpu.read_output("f", n * n).reshape(n, n)     # (the pixel pass's values)
    np.testing.assert_array_equal(raw < 0, full < 0)
    filled = (np.abs(raw) == 1.0) & (raw != full)
    assert filled.mean() >= decided, filled.mean()


@pytest.mark.parametrize("seed", range(8))
def test_random_tapes_on_image_cells_are_bit_identical(walker_gpu, no_new_kernels, seed):
    """Random arithmetic tapes over every op, other planes and rectangles (some inverted, some
    tiny); NaN where both are NaN."""
    tape = random_tape(seed + 100)
    rng = np.random.default_rng(seed)
    c = rng.uniform(-1.5, 1.5, 2)
    half = rng.choice([0.01, 0.3, 2.0])
    rect = (c[0] - half, c[0] + half, c[1] - half, c[1] + half)
    if seed % 3 == 0:
        rect = (rect[1], rect[0], rect[3], rect[2])
    z = float(rng.uniform(-1, 1))
    full = walker_gpu.field_image(tape, 24, 20, rect, z)
    cells = [(2, 1), (3, 2), (1, 3), (5, 2)][seed % 4]
    pruned = walker_gpu.field_image_pruned(tape, 24, 20, rect, z, cells=cells)
    same = (bits(pruned) == bits(full)) | (np.isnan(pruned) & np.isnan(full))
    assert same.all(), (seed, cells, int((~same).sum()))
    np.testing.assert_array_equal(walker_gpu.sign_image(tape, 24, 20, rect, z, cells=cells), full < 0)


@pytest.mark.slow
def test_image_cells_are_kept_for_pans_zooms_and_sizes(walker_gpu, no_new_kernels, prospero_96):
    """Images inside the kept cells' rectangle, at any size, prune nothing; a rectangle beyond
    it, another plane, another tape, an edit or another pass in between prune again. Every
    image is field_image's (computed first: field_image is another pass)."""
    tape, full = prospero_96
    n, whole = full.shape[0], grid_rect(full.shape[0])
    other = load_vm(DATA / "quarter.vm")
    views = [(tape, 24, 20, whole, 0.0), (tape, 15, 32, (-0.6, 0.2, -0.9, 0.7), 0.0),
             (tape, n, n, whole, 0.0), (tape, 16, 16, (-1.2, 0.0, -1.0, 1.0), 0.0),
             (tape, 16, 16, (-1.0, -0.5, -0.2, 0.3), 0.25), (other, 20, 20, (-1.0, 0.0, -1.0, 0.0), 0.25)]
    refs = [full < 0 if t is tape and (w, h, r, z) == (n, n, whole, 0.0) else walker_gpu.field_image(t, w, h, r, z) < 0
            for t, w, h, r, z in views]
    walker_gpu.drop_kept_cells()
    builds = []
    for (t, w, h, r, z), ref in zip(views, refs):
        np.testing.assert_array_equal(walker_gpu.sign_image(t, w, h, r, z, cells=(3, 2)), ref)
        builds.append(walker_gpu.image_cell_builds)
    b0 = builds[0]
    # kept: pan / zoom inside, another size; pruned again: wider, another plane, another tape
    assert [b - b0 for b in builds] == [0, 0, 0, 1, 2, 3]
    walker_gpu.upload(tape)                         # tape buffers written (as an edit does)
    walker_gpu.sign_image(tape, 8, 8, cells=(3, 2))
    assert walker_gpu.image_cell_builds == b0 + 4
    walker_gpu.sign_image(tape, 8, 8, rect=(-0.5, 0.5, -0.5, 0.5), cells=(3, 2))
    assert walker_gpu.image_cell_builds == b0 + 4
    walker_gpu.evaluate(tape, np.zeros((4, 3), np.float32))   # another pass
    walker_gpu.sign_image(tape, 8, 8, rect=(-0.5, 0.5, -0.5, 0.5), cells=(3, 2))
    assert walker_gpu.image_cell_builds == b0 + 5


@pytest.mark.slow
def test_pruned_tapes_need_few_registers_and_the_pixel_pass_a_small_variant(walker_gpu, no_new_kernels,
                                                                           prospero_96, monkeypatch):
    """Pruning renumbers the finest level's tapes' registers (values die where last read):
    prospero's 189 became 138 at 32 px tiles, 24 at 2 px, when written (coarser levels keep the
    full tape's numbering: their header says REG_CAP). Its image cells' finest tapes (16^2 x 3)
    hold 16, so their pixel pass runs in the 16 variant, bit for bit; forced into a variant too
    small for its cells' tapes (one level-0 cell: the whole tape), every pixel is refused and the
    pass runs again in the tape's own."""
    tape, full = prospero_96
    n = full.shape[0]
    assert tape.n_regs == 189
    regs = [lv["registers"] for lv in walker_gpu.prune_levels(tape, n, n, grid_rect(n), tiles=(32, 8, 2))]
    assert regs[:2] == [256, 256] and regs[2] <= 32, regs
    one = walker_gpu.prune_levels(tape, n, n, grid_rect(n), tiles=32)[0]["registers"]
    assert regs[2] < one < 189, one
    walker_gpu.drop_kept_cells()
    np.testing.assert_array_equal(bits(walker_gpu.field_image_pruned(tape, n, n, grid_rect(n), cells=(16, 3))),
                                  bits(full))
    assert walker_gpu.stats()["kept_cells"] == {"kind": "image", "variant": 16} and 16 < walker_gpu.upload(tape)
    refused = walker_gpu.register_refusals
    walker_gpu.drop_kept_cells()
    walker_gpu.sign_image(tape, 8, 8, grid_rect(n), cells=(1, 1))
    assert walker_gpu.stats()["kept_cells"]["variant"] == walker_gpu.upload(tape)
    walker_gpu.drop_kept_cells()
    monkeypatch.setattr(walker_gpu, "pixel_variant_cap", 16)   # (the cells' pixel pass in the 16 variant)
    np.testing.assert_array_equal(bits(walker_gpu.field_image_pruned(tape, n, n, grid_rect(n), cells=(1, 1))),
                                  bits(full))
    assert walker_gpu.stats()["kept_cells"]["variant"] == 16 and walker_gpu.register_refusals == refused + 1


@pytest.mark.slow
def test_the_pruned_images_pixel_pass_runs_in_the_variant_its_finest_tapes_need(walker_gpu, no_new_kernels,
                                                                                prospero_96, monkeypatch):
    """Per-call tiles: the pixel pass's variant holds the finest tiles' registers (24 of 189 at 2
    px: the 64 variant); forced into the 16, the pixels of tapes needing more are refused and
    the pass runs again in the tape's own variant, bit for bit."""
    tape, full = prospero_96
    n = full.shape[0]
    def pixel_passes():
        return {k: v for k, v in walker_gpu.stats()["dispatches"].items() if k.startswith("pruned_image@")}
    before = pixel_passes()
    np.testing.assert_array_equal(bits(walker_gpu.field_image_pruned(tape, n, n, grid_rect(n), tiles=(32, 8, 2))),
                                  bits(full))
    after = pixel_passes()
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {"pruned_image@64": 1}
    assert 64 < walker_gpu.upload(tape)
    refused = walker_gpu.register_refusals
    monkeypatch.setattr(walker_gpu, "pixel_variant_cap", 16)
    np.testing.assert_array_equal(bits(walker_gpu.field_image_pruned(tape, n, n, grid_rect(n), tiles=(32, 8, 2))),
                                  bits(full))
    np.testing.assert_array_equal(walker_gpu.sign_image(tape, n, n, grid_rect(n), tiles=(32, 8, 2)), full < 0)
    assert walker_gpu.register_refusals == refused + 2


@pytest.mark.slow
def test_image_cells_grow_a_small_arena_and_check_their_arguments(walker_gpu, no_new_kernels, prospero_96,
                                                                  monkeypatch):
    tape, full = prospero_96
    n = full.shape[0]
    walker_gpu.drop_kept_cells()
    monkeypatch.setattr(walker_gpu, "cell_arena_words", 1000)
    pruned = walker_gpu.field_image_pruned(tape, n, n, grid_rect(n), cells=(4, 2))
    np.testing.assert_array_equal(bits(pruned), bits(full))
    assert walker_gpu.cell_arena_words > 1000
    grown = walker_gpu.cell_arena_words          # timing the cells prunes them as the image did
    assert GpuProfiler(walker_gpu).image_seconds(tape, n, n, grid_rect(n), cells=(4, 2), tile_passes_only=True,
                                                repeat=2) >= 0
    assert GpuProfiler(walker_gpu).image_seconds(tape, n, n, grid_rect(n), cells=(4, 2), repeat=2) >= 0
    assert walker_gpu.cell_arena_words == grown
    np.testing.assert_array_equal(bits(walker_gpu.field_image_pruned(tape, n, n, grid_rect(n), cells=(4, 2))),
                                  bits(full))
    for cells in ((0, 2), (4, 0), (4, 5), (2000, 1), (4,), "auto", (4.0, 2)):
        with pytest.raises(TaperayError, match="image cells"):
            walker_gpu.sign_image(tape, 8, 8, cells=cells)


# ---- GpuWalker.evaluate_pruned: points bucketed into cells, each cell's tape pruned on the GPU
def _points(rng, n, lo=-1.2, hi=1.2, plane=False):
    """Random points plus the awkward ones: duplicates, cell-boundary coordinates (multiples of
    the grid step over [lo, hi]), the bounding box's corners, a NaN, infinities and -0.0."""
    p = rng.uniform(lo, hi, (n, 3)).astype(np.float32)
    k = n // 8
    p[:k] = np.round(p[:k] * 4) / 4                            # on cell faces for many grids
    p[k:2 * k] = p[:k][::-1]                                   # duplicates
    p[-6] = (np.inf, 0.2, -0.3)
    p[-7] = (-np.inf, np.inf, 0.1)
    p[-1] = (lo, lo, lo)
    p[-2] = (hi, hi, hi)
    p[-3] = (np.nan, 0.1, 0.2)
    p[-4] = (0.3, np.nan, np.nan)
    p[-5] = (-0.0, 0.0, -0.0)
    if plane:
        p[:, 2] = 0.0
    return p


def _same(a, b):
    """Bit for bit; a NaN value may differ from the other NaN in its payload only."""
    return (bits(a) == bits(b)) | (np.isnan(a) & np.isnan(b))


@pytest.mark.slow
@pytest.mark.parametrize("model,cells,levels", [("quarter", 64, 1), ("hi", 16, 2), ("sphere", 8, 3),
                                                ("tanglecube", 27, 2), ("prospero", 64, 2)])
def test_models_evaluate_pruned_is_bit_identical_to_evaluate(walker_gpu, no_new_kernels, model, cells, levels):
    tape = load_vm(DATA / f"{model}.vm")
    rng = np.random.default_rng(len(model))
    for plane in (True, False):
        pts = _points(rng, 600 if model == "prospero" else 1500, plane=plane)
        d, m = walker_gpu.evaluate(tape, pts)
        dp, mp = walker_gpu.evaluate_pruned(tape, pts, cells=cells, levels=levels)
        assert dp.dtype == np.float32 and mp.dtype == np.uint32 and dp.shape == (len(pts),)
        assert _same(dp, d).all(), (model, plane, int((~_same(dp, d)).sum()))
        np.testing.assert_array_equal(mp, m)
        finite = np.isfinite(pts).all(axis=1)
        np.testing.assert_array_equal(bits(dp[finite]), bits(d[finite]))


@pytest.mark.parametrize("seed", range(12))
def test_random_tapes_evaluate_pruned_is_bit_identical(walker_gpu, no_new_kernels, seed):
    tape = random_tape(seed)
    rng = np.random.default_rng(100 + seed)
    c = rng.uniform(-1.5, 1.5)
    half = float(rng.choice([0.01, 0.3, 2.0]))
    pts = _points(rng, 700, c - half, c + half, plane=seed % 3 == 0)
    d, m = walker_gpu.evaluate(tape, pts)
    cells, levels = [(1, 1), (8, 1), (64, 2), (8, 3), (1, 4), (200, 2)][seed % 6]
    dp, mp = walker_gpu.evaluate_pruned(tape, pts, cells=cells, levels=levels)
    assert _same(dp, d).all(), (seed, cells, levels, int((~_same(dp, d)).sum()))
    np.testing.assert_array_equal(mp, m)


@pytest.mark.slow
def test_evaluate_pruned_prunes_and_finer_levels_prune_further(walker_gpu, no_new_kernels):
    """1M-point bench geometry, small: points in [-1, 1]^2 x {0} on prospero."""
    tape = load_vm(DATA / "prospero.vm")
    rng = np.random.default_rng(7)
    pts = np.zeros((2000, 3), np.float32)
    pts[:, :2] = rng.uniform(-1, 1, (2000, 2))
    lv = walker_gpu.prune_levels_points(tape, pts, cells=16, levels=3)
    assert [x["cells"] for x in lv] == [16, 256, 4096]   # z is flat: 4 x 4 sub-cells a cell
    assert lv[0]["with_points"] == 16 and lv[2]["with_points"] <= 2000
    lengths = [x["mean_length"] for x in lv]
    assert len(tape) > 2 * lengths[0] and lengths[0] > lengths[1] > lengths[2] > 0, lengths
    d, _ = walker_gpu.evaluate(tape, pts)
    np.testing.assert_array_equal(bits(walker_gpu.evaluate_pruned(tape, pts, cells=16, levels=3)[0]), bits(d))
    np.testing.assert_array_equal(bits(walker_gpu.evaluate_pruned(tape, pts)[0]), bits(d))   # defaults


@pytest.mark.slow
def test_evaluate_pruned_grows_a_small_arena(walker_gpu, no_new_kernels, monkeypatch):
    tape = load_vm(DATA / "prospero.vm")
    pts = _points(np.random.default_rng(3), 500, plane=True)
    monkeypatch.setattr(walker_gpu, "point_arena_words", 1000)
    dp, _ = walker_gpu.evaluate_pruned(tape, pts, cells=64, levels=2)
    assert walker_gpu.point_arena_words > 1000
    assert _same(dp, walker_gpu.evaluate(tape, pts)[0]).all()


def test_evaluate_pruned_falls_back_and_checks_its_arguments(walker_gpu, no_new_kernels):
    ins = np.zeros(1, INSTR_DTYPE)
    ins[0]["op"] = Op.SPHERE    # not arithmetic
    tape = Tape(ins, np.array([0.7], np.float32), material_array([(0.5, 0.5, 0.5)], 0.5), 1,
                np.array([[-1, -1, -1], [1, 1, 1]], np.float32))
    pts = _points(np.random.default_rng(1), 100)
    for a, b in zip(walker_gpu.evaluate_pruned(tape, pts), walker_gpu.evaluate(tape, pts)):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    quarter = load_vm(DATA / "quarter.vm")
    d, m = walker_gpu.evaluate_pruned(quarter, np.zeros((0, 3), np.float32))
    assert d.shape == m.shape == (0,) and d.dtype == np.float32 and m.dtype == np.uint32
    one = np.array([[0.25, -0.5, 0.0]], np.float32)
    np.testing.assert_array_equal(bits(walker_gpu.evaluate_pruned(quarter, one)[0]),
                                  bits(walker_gpu.evaluate(quarter, one)[0]))
    for kw in (dict(cells=0), dict(cells=2.5), dict(levels=0), dict(levels=5)):
        with pytest.raises(TaperayError):
            walker_gpu.evaluate_pruned(quarter, pts, **kw)
    with pytest.raises(TaperayError):
        walker_gpu.evaluate_pruned(quarter, np.zeros((4, 2), np.float32))


# ------------------------------------------------------------------ the pruned march and light
def _march_bits(r):
    return {k: np.asarray(r[k]).view(np.uint8) for k in ("t", "hit", "steps", "mat", "grad", "shadow", "ao")
            if k in r}


def _same_bits(a, b):
    a, b = _march_bits(a), _march_bits(b)
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def spheres_60():
    from taperay.tools.bench_prune import spheres_program
    return load_vm(spheres_program(60, seed=2))


@pytest.fixture(scope="module")
def spheres_60_unpruned(walker_gpu, spheres_60):
    """spheres_60's unpruned light per view (40 x 30, auto camera), made on first need: each
    cells case compares with the same image."""
    from taperay.runtime.camera import auto_camera
    cam, made = auto_camera(spheres_60.bounds), {}

    def light(view):
        if view not in made:
            made[view] = walker_gpu.light(spheres_60, cam, 40, 30, view=view, settings=EXACT, cells=None)
        return cam, made[view]
    return light


@pytest.mark.slow
@pytest.mark.parametrize("cells", [(1, 1), (4, 1), (3, 2), (2, 3)])
@pytest.mark.parametrize("view", ["shade", "section"])
def test_march_and_light_on_cells_are_bit_identical(walker_gpu, no_new_kernels, spheres_60, spheres_60_unpruned,
                                                     cells, view):
    cam, full = spheres_60_unpruned(view)
    assert full["hit"].mean() > 0.03
    assert _same_bits(walker_gpu.light(spheres_60, cam, 40, 30, view=view, settings=EXACT, cells=cells), full)


@pytest.mark.parametrize("model", ["sphere", "tanglecube", "hi"])
def test_models_march_on_cells_is_bit_identical_inside_and_outside_the_box(walker_gpu, no_new_kernels, model):
    """Models (3D and 2D programs), the camera outside the march box and inside it."""
    from taperay.runtime.camera import Camera, auto_camera
    tape = load_vm(DATA / f"{model}.vm")
    for cam in (auto_camera(tape.bounds), Camera(eye=(0.1, 0.05, 0.2), target=(1, 0.3, -0.2), fov_deg=70)):
        full = walker_gpu.march(tape, cam, 36, 28, settings=EXACT, cells=None)
        assert _same_bits(walker_gpu.march(tape, cam, 36, 28, settings=EXACT, cells=(4, 2)), full)


@pytest.mark.parametrize("seed", range(6))
def test_random_tapes_march_on_cells_is_bit_identical(walker_gpu, no_new_kernels, seed):
    from taperay.runtime.camera import auto_camera
    tape = random_tape(seed)
    cam = auto_camera(tape.bounds)
    full = walker_gpu.march(tape, cam, 32, 24, settings=EXACT, cells=None)
    assert _same_bits(walker_gpu.march(tape, cam, 32, 24, settings=EXACT, cells=(3, 2)), full)


@pytest.mark.slow
def test_render_on_cells_is_the_unpruned_image_and_cells_prune(walker_gpu, no_new_kernels, spheres_60):
    for view in ("shade", "normals", "steps"):
        kw = dict(view=view, samples=2, settings=EXACT)
        np.testing.assert_array_equal(walker_gpu.render(spheres_60, None, 32, 24, **kw),
                                      walker_gpu.render(spheres_60, None, 32, 24, cells=None, **kw))
    levels = walker_gpu.march_cell_levels(spheres_60, cells=(4, 2))
    assert [lv["cells"] for lv in levels] == [65, 65 * 64]
    assert levels[0]["with_tape"] == 65 and levels[1]["with_tape"] == 64 * 64   # (not the outside cell's)
    n = len(spheres_60.instrs)
    assert levels[0]["mean_length"] < 0.7 * n and levels[1]["mean_length"] < 0.2 * n


@pytest.mark.slow
def test_march_cells_grow_a_small_arena(walker_gpu, no_new_kernels, spheres_60, monkeypatch):
    from taperay.runtime.camera import auto_camera
    cam = auto_camera(spheres_60.bounds)
    full = walker_gpu.march(spheres_60, cam, 24, 20, settings=EXACT, cells=None)
    monkeypatch.setattr(walker_gpu, "cell_arena_words", 500)
    assert _same_bits(walker_gpu.march(spheres_60, cam, 24, 20, settings=EXACT, cells=(4, 2)), full)
    assert walker_gpu.cell_arena_words > 500


def test_march_cells_choice_and_bad_cells(walker_gpu, spheres_60):
    from taperay.runtime.gpu import GpuWalker
    from taperay.runtime.gpu_pruning import MARCH_CELLS
    assert GpuWalker.march_cells_for(spheres_60, "auto") == MARCH_CELLS
    assert GpuWalker.march_cells_for(load_vm(DATA / "sphere.vm"), "auto") is None      # short: not worth it
    assert GpuWalker.march_cells_for(load_vm(DATA / "sphere.vm"), (2, 1)) == (2, 1)
    assert GpuWalker.march_cells_for(spheres_60, None) is None
    for bad in ((0, 1), (4, 5), (4,), "yes", (2.5, 1)):
        with pytest.raises(TaperayError):
            walker_gpu.march(spheres_60, None, 8, 8, cells=bad)
    with pytest.raises(TaperayError):
        walker_gpu.march_cell_levels(load_vm(DATA / "sphere.vm"), cells=None)


@pytest.mark.slow
@pytest.mark.parametrize("view", ["shade", "section"])
def test_fields_with_materials_march_on_cells_bit_identical(walker_gpu, no_new_kernels, view):
    """Scene fields (arithmetic records closed by FIELD_RESULT with a material: a level-3 Menger
    sponge in union with a second material's field) march on cells, FIELD_RESULT pruned as a
    COPY and UNION as MIN, and the surface pass gives the materials: every output equals the
    unpruned march's."""
    from taperay.runtime.gpu import GpuWalker
    from taperay.runtime.pruning import is_arithmetic
    from taperay.scenegraph import Material, field
    from taperay.scenegraph.fields import x, y, z
    from taperay.scenegraph.flatten import flatten
    from taperay.scenes.menger_sponge import build
    ball = field((x - 0.8) ** 2 + y * y + (z - 0.8) ** 2 - 0.25, bounds=((0.2, -0.6, 0.2), (1.4, 0.6, 1.4)),
                 name="ball").material(Material("glass", (0.3, 0.5, 0.9), 0.2))
    tape = flatten(build(level=3) | ball)
    assert not is_arithmetic(tape) and is_arithmetic(tape, fields=True)
    assert GpuWalker.march_cells_for(tape, "auto") is not None
    full = walker_gpu.light(tape, None, 40, 30, view=view, settings=EXACT, cells=None)
    assert len(np.unique(full["mat"][full["hit"]])) == 2
    assert _same_bits(walker_gpu.light(tape, None, 40, 30, view=view, settings=EXACT, cells=(3, 2)), full)
    np.testing.assert_array_equal(walker_gpu.render(tape, None, 40, 30, view=view, settings=EXACT),
                                  walker_gpu.render(tape, None, 40, 30, view=view, settings=EXACT, cells=None))
    fine = walker_gpu.march_cell_levels(tape, view=view, cells=(3, 2))[1]
    assert fine["mean_length"] < 0.8 * len(tape.instrs)   # the union decided in most cells


@pytest.mark.slow
def test_frames_keep_their_cells_until_something_else_runs(walker_gpu, no_new_kernels, spheres_60, monkeypatch):
    """A second frame of the same tape and settings (another camera) re-uses the pruned cells;
    another size, another pass in between, another tape or an edit makes the next frame prune
    again; every frame equals its unpruned render."""
    from taperay.runtime.camera import Camera
    from taperay.tools.bench_prune import spheres_program
    frames = []
    walker_gpu.drop_kept_cells()
    builds = walker_gpu.march_cell_builds
    cams = [Camera(eye=(3, -2.5, 2), target=(0, 0, 0)), Camera(eye=(-2, -3, 1.5), target=(0.1, 0, 0))]
    other = load_vm(spheres_program(50, seed=5))

    def frame(cam, size=(24, 18), tape=spheres_60):
        frames.append((walker_gpu.render(tape, cam, *size, settings=EXACT), tape, cam, size))
        return walker_gpu.march_cell_builds - builds

    assert frame(cams[0]) == 1 and frame(cams[1]) == 1          # kept: another camera, no pruning
    assert frame(cams[0], (16, 12)) == 2                        # another size
    walker_gpu.evaluate(spheres_60, np.zeros((10, 3), np.float32))
    assert frame(cams[0], (16, 12)) == 3                        # another pass ran in between
    assert frame(cams[1], tape=other) == 4                      # another tape
    assert frame(cams[0], tape=other) == 4
    walker_gpu.upload(spheres_60)                               # tape buffers written (as an edit does)
    assert frame(cams[0], tape=other) == 5
    for image, tape, cam, size in frames:
        np.testing.assert_array_equal(image, walker_gpu.render(tape, cam, *size, settings=EXACT, cells=None))


# ---- level 0 in dependency steps (prune_wave): the serial walks' tapes, bit for bit
def _pruned_tapes(walker, counts):
    """Every tile's (class, length, registers, the bits of its interval's lower bound, pruned
    tape words) from out_u word 0 (headers,
    then the arena, as a pruned image or image cells leave them)."""
    n_hdr = PRUNE_HEADER_WORDS * sum(counts)
    hdr = walker.read_output("u", n_hdr).reshape(-1, PRUNE_HEADER_WORDS).astype(np.int64)
    taped = (hdr[:, 2] <= 2) & (hdr[:, 1] > 0)
    words = walker.read_output("u", int((hdr[taped, 0] + 2 * hdr[taped, 1]).max(initial=n_hdr)))
    return [(int(c), int(n), int(r), int(lower), words[at:at + 2 * n].tobytes() if ok else b"")
            for (at, n, c, r, lower), ok in zip(hdr, taped)]


def _steps_and_serial(walker, run):
    """``run()``'s pruned tapes with level 0 in dependency steps, then by the serial walks."""
    out, default = [], walker.wave_max_tiles
    for most in (1 << 30, 0):
        walker.wave_max_tiles = most
        walker.drop_kept_cells()
        out.append(run())
    walker.wave_max_tiles = default
    return out


def _varying_random_tape(walker_cpu, seed: int, rect) -> Tape:
    """random_tape(seed), or the first of seed + 1000, seed + 2000 ... whose value is not one
    constant over the image (level 0 would decide every tile, leaving no tape to compare)."""
    xs, ys = np.linspace(rect[0], rect[1], 40), np.linspace(rect[2], rect[3], 36)
    pts = np.stack(np.broadcast_arrays(xs[None, :], ys[:, None], np.float64(0.25)), -1).reshape(-1, 3)
    while True:
        tape = random_tape(seed)
        d, _ = walker_cpu.evaluate(tape, pts.astype(np.float32))
        if not np.isnan(d).all() and np.nanmin(d) != np.nanmax(d):
            return tape
        seed += 1000


@pytest.mark.slow
@pytest.mark.parametrize("case", range(12))
def test_level0_in_dependency_steps_gives_the_serial_walks_tapes(walker_gpu, walker_cpu, no_new_kernels, case):
    """prune_wave's level 0 (and so every level after it) equals prune_tiles' serial walks': the
    same classes, lengths, registers and records, for prospero (its chains as written, and
    balanced: full steps of WAVE_WIDTH records) and random tapes over every op,
    sign and field images, one to three levels, and image cells (folding constants)."""
    rect = (-1.1, 0.9, -1.0, 1.05) if case < 4 else (-1.5, 1.4, -0.3, 1.6)
    tape = load_vm(DATA / "prospero.vm", balance_chains=case % 2 == 0) if case < 4 else \
        _varying_random_tape(walker_cpu, case + 300, rect)
    assert wave_schedule(tape, wait=True) is not None
    tiles = [(24,), (24, 6), (32, 8, 2), 12][case % 4]
    sign = case % 2 == 1
    image = walker_gpu.sign_image if sign else walker_gpu.field_image_pruned
    if case % 3 == 2:   # image cells: prune_image_cells' level 0 folds constants (prune_wave_cells)
        cells = ((2, 2), (3, 1), (4, 2))[case % 3 - 2 + case // 6]
        lo, hi = image_cell_box(rect, 0.25)
        counts = march_cells(lo, hi, *cells, flat=True)[0]
        run = lambda: (image(tape, 40, 36, rect, 0.25, cells=cells), _pruned_tapes(walker_gpu, counts))[1]
    else:
        counts = level_tile_counts(tile_levels(tiles), 40, 36)
        run = lambda: (image(tape, 40, 36, rect, 0.25, tiles=tiles), _pruned_tapes(walker_gpu, counts))[1]
    steps, serial = _steps_and_serial(walker_gpu, run)
    assert len(steps) == sum(counts)
    assert steps == serial
    assert sum(len(words) for *_, words in steps) > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", range(4))
def test_march_cells_level0_in_dependency_steps_gives_the_serial_walks_tapes(walker_gpu, no_new_kernels, case):
    """prune_cells takes the union rule on the levels after the first only, so its march cells'
    tapes (every level) are the same whether level 0 ran in dependency steps (prune_wave_cells)
    or by the serial walks: prospero (as written, balanced) and the union program, whose
    sub-cells the rule shortens."""
    tape = [lambda: load_vm(DATA / "prospero.vm"), lambda: load_vm(DATA / "prospero.vm", balance_chains=True),
            lambda: load_vm(UNION_VM), lambda: load_vm(DATA / "prospero.vm", balance_chains=True)][case]()
    assert wave_schedule(tape, wait=True) is not None
    cells = ((4, 2), (4, 2), (1, 2), (2, 3))[case]
    run = lambda: (lambda lv: _pruned_tapes(walker_gpu, [v["cells"] for v in lv]))(
        walker_gpu.march_cell_levels(tape, cells=cells))
    steps, serial = _steps_and_serial(walker_gpu, run)
    assert steps == serial
    assert sum(len(words) for *_, words in steps) > 0


def test_the_outside_cell_does_not_count_against_the_steps_tile_limit(walker_gpu, no_new_kernels, monkeypatch):
    """32^2 image cells are 1,025 with the outside cell: level 0 takes the steps as 1,024 tiles
    would (the image's own passes, as sign_image makes them), not as 1,025; 1,024 tiles of an
    image (2 px on 64^2) take them, not past a limit of 1,023."""
    tape = load_vm(DATA / "sphere.vm")
    assert wave_schedule(tape, wait=True) is not None

    def level0_in_steps(limit, image):       # (prune_wave*: level 0 in dependency steps)
        monkeypatch.setattr(walker_gpu, "wave_max_tiles", limit)
        walker_gpu.drop_kept_cells()
        before = walker_gpu.stats()["dispatches"]
        image()
        after = walker_gpu.stats()["dispatches"]
        return sorted({k.split("@")[0] for k in after if after[k] != before.get(k, 0) and k.startswith("prune_")})

    cells = lambda: walker_gpu.sign_image(tape, 64, 64, cells=(32, 2))
    tiles = lambda: walker_gpu.sign_image(tape, 64, 64, tiles=(2,))
    assert level0_in_steps(1024, cells) == ["prune_image_cells", "prune_wave_cells"]
    assert level0_in_steps(1023, cells) == ["prune_image_cells"]
    assert level0_in_steps(1024, tiles) == ["prune_wave"]
    assert level0_in_steps(1023, tiles) == ["prune_tiles"]


@pytest.mark.slow
def test_tapes_the_steps_cannot_hold_are_pruned_by_the_serial_walks(walker_gpu, no_new_kernels):
    """A tape keeping more than WAVE_SLOTS values alive at once has no schedule: level 0 is the
    serial walks', the image exact. Here: 1,024 values of a chain v <- v + c, one step after
    another, all read by a balanced tree of MINs that can only start after the chain's end."""
    rows, consts = [(Op.VAR_X, 1, 0, 0, 0, 0)], []

    def tree(n, reg):    # the MIN of the next n chain values into register reg (those above free)
        if n == 1:
            rows.append((Op.CONST, reg + 1, 0, 0, 0, len(consts)))
            rows.append((Op.ADD, 1, 1, reg + 1, 0, 0))
            rows.append((Op.COPY, reg, 1, 0, 0, 0))
            consts.append(float(np.sin(len(consts))))
            return
        tree(n // 2, reg)
        tree(n // 2, reg + 1)
        rows.append((Op.MIN, reg, reg, reg + 1, 0, 0))

    tree(1024, 2)
    rows.append((Op.COPY, 0, 2, 0, 0, 0))
    tape = tape_of(rows, consts, 16)
    assert wave_schedule(tape, wait=True) is None
    full = walker_gpu.field_image(tape, 24, 24)
    np.testing.assert_array_equal(bits(walker_gpu.field_image_pruned(tape, 24, 24, tiles=(8,))), bits(full))


def test_level0_takes_the_serial_walks_while_the_planner_is_not_ready(walker_gpu, no_new_kernels, monkeypatch):
    """wave_schedule never waits for the planner unless asked: until it is ready there is no
    schedule (and none is kept), and pruned images take the serial walks, bit for bit."""
    import threading

    from taperay.runtime import gpu_pruning
    tape = random_tape(777)
    assert wave_schedule(tape, wait=True) is not None
    monkeypatch.setattr(walker_gpu, "wave_max_tiles", 1 << 30)
    gate = threading.Event()
    planner = gpu_pruning.WavePlanner()                 # (not compiled yet, its compile never ending)
    planner.loader = threading.Thread(target=gate.wait)
    monkeypatch.setattr(gpu_pruning, "WAVE_PLANNER", planner)
    assert wave_schedule(tape) is None and planner.schedules == {}
    full = walker_gpu.field_image(tape, 24, 20)
    pruned = walker_gpu.field_image_pruned(tape, 24, 20, tiles=(8, 3))
    assert ((bits(pruned) == bits(full)) | (np.isnan(pruned) & np.isnan(full))).all()
    assert planner.schedules == {}
    gate.set()


def test_image_cells_pruned_again_compare_no_buffer(walker_gpu, no_new_kernels, monkeypatch):
    """Pruning a tape's image cells again (after an edit elsewhere, or as the benchmark's first
    images) syncs the instrs buffer to the tape and to its schedule in turn, and the points buffer
    to the cells' layout: read-only arrays a buffer holds already (gpu_device.Buffer.held), so none is
    compared again, and the image is the same."""
    from taperay.runtime import gpu_device
    tape = load_vm(DATA / "prospero.vm")
    assert wave_schedule(tape, wait=True) is not None
    monkeypatch.setattr(walker_gpu, "wave_max_tiles", 1 << 30)
    walker_gpu.drop_kept_cells()
    first = walker_gpu.sign_image(tape, 48, 40, cells=(2, 2))
    compared = walker_gpu.stats()["bytes_compared"]
    walker_gpu.drop_kept_cells()
    again = walker_gpu.sign_image(tape, 48, 40, cells=(2, 2))
    assert walker_gpu.image_cell_builds >= 2 and walker_gpu.stats()["bytes_compared"] == compared
    np.testing.assert_array_equal(again, first)


# ---- empty-space skipping (RenderSettings.cell_skip): the twin's rule on the GPU
@pytest.mark.slow
def test_cell_skipping_takes_the_twins_steps(walker_gpu, no_new_kernels, spheres_60):
    """With cell_skip on, the GPU's march and light on cells of the twin's grid (4, 2) take the
    twin's steps (march_pruned / light_pruned: the same cells, intervals and rule) pixel for
    pixel, hits and depths within rounding; the header's lower bound is what the twin's
    intervals give; and skipping takes steps without field values (more steps than without)."""
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.pruning import light_pruned, march_pruned
    cam = auto_camera(spheres_60.bounds)
    settings = RenderSettings()
    eps = float(settings.pack(spheres_60)[1])
    twin = march_pruned(spheres_60, cam, 48, 36, settings)
    gpu = walker_gpu.light(spheres_60, cam, 48, 36, settings, cells=(4, 2))
    exact = walker_gpu.march(spheres_60, cam, 48, 36, EXACT, cells=(4, 2))
    assert twin["hit"].mean() > 0.05 and gpu["steps"].sum() > exact["steps"].sum()
    assert (gpu["steps"] == twin["steps"]).mean() >= 0.999
    np.testing.assert_array_equal(gpu["hit"], twin["hit"])
    both = gpu["hit"]
    assert np.abs(gpu["t"][both] - twin["t"][both]).max() <= 1e-2 * eps
    light = light_pruned(spheres_60, settings.pack(spheres_60), twin)
    assert (light["shadow"] < 1).sum() >= 10
    assert (gpu["shadow"] != light["shadow"]).mean() <= 0.002


@pytest.mark.slow
def test_a_hit_cone_takes_the_twins_steps(walker_gpu, walker_cpu, no_new_kernels, spheres_60):
    """RenderSettings.hit_cone (a uniform: no new pipeline): the GPU's march on the tape's own
    records and on cells of the twin's grid (4, 2), with and without cell skipping, takes the
    twin's steps (CpuWalker.march / march_pruned) pixel for pixel, hits equal; the cone adds hits."""
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.pruning import march_pruned
    cam = auto_camera(spheres_60.bounds)
    for skip in (False, True):
        cone = RenderSettings(hit_cone=0.004, cell_skip=skip)
        twin = march_pruned(spheres_60, cam, 48, 36, cone)
        gpu = walker_gpu.march(spheres_60, cam, 48, 36, cone, cells=(4, 2))
        assert (gpu["steps"] == twin["steps"]).mean() >= 0.999, skip
        np.testing.assert_array_equal(gpu["hit"], twin["hit"])
    own = walker_gpu.march(spheres_60, cam, 48, 36, cone, cells=None)
    ref = walker_cpu.march(spheres_60, cam, 48, 36, cone)
    assert (own["steps"] == ref["steps"]).mean() >= 0.999
    np.testing.assert_array_equal(own["hit"], ref["hit"])
    assert own["hit"].sum() > walker_gpu.march(spheres_60, cam, 48, 36, EXACT, cells=None)["hit"].sum()


def test_march_cells_headers_hold_their_intervals_lower_bounds(walker_gpu, no_new_kernels, spheres_60):
    """The fifth header word (packed.wgsl HEADER_WORDS) of every march cell is the lower bound
    of its interval, as the twin's cells compute it (level 0 on the whole tape, level 1 on the
    parent's pruned tape)."""
    from taperay.runtime.camera import auto_camera
    from taperay.runtime.pruning import march_cell_tapes
    text = (Path(__file__).resolve().parents[1] / "shaders" / "packed.wgsl").read_text()
    assert f"const HEADER_WORDS: u32 = {PRUNE_HEADER_WORDS}u;" in text
    walker_gpu.march(spheres_60, auto_camera(spheres_60.bounds), 16, 12, cells=(4, 2))
    hdr = walker_gpu.read_output("u", PRUNE_HEADER_WORDS * 65 * 65,   # (from word 9n)
                                 9 * 16 * 12).reshape(-1, PRUNE_HEADER_WORDS)
    lower = hdr[:, 4].view(np.float32)
    cells = march_cell_tapes(spheres_60, RenderSettings().pack(spheres_60), 4, 2)
    twin = cells.skip_lower                         # (level 0, then the sub-cells)
    gpu = np.concatenate([lower[:64], lower[65:65 + 64 * 64]])
    assert np.isnan(lower[64])                     # the outside cell: nothing decided
    np.testing.assert_allclose(gpu, twin, rtol=1e-5, atol=1e-6)
