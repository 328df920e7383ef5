"""The path tracer (runtime/path_tracing.py, shaders/path.wgsl): the white furnace on both
walkers and a glass furnace, light sampling against BSDF sampling alone, GPU against twin within
Monte-Carlo error on a scene of metal, glass and an emitter, the shared sample sequence,
progressive accumulation (the GPU's sums kept there), paths resumed past the GPU's iteration cap,
material edits, and no pipeline made by a second render or an edit."""
from pathlib import Path

import numpy as np
import pytest

from taperay.runtime.camera import Camera
from taperay.runtime.environment import EnvironmentMap, read_environment, read_hdr, read_pfm, write_hdr, write_pfm
from taperay.runtime.path_tracing import (PathImage, PathSettings, env_pdf, env_pixel, laine_karras, sample_env,
                                          emitter_spheres, hash_random, light_data, path_random, reverse_bits,
                                          sobol_owen)
from taperay.runtime.tape import TaperayError
from taperay.scenegraph import Material, Param, box, difference, flatten, sphere, union
from taperay.tools.bench_path import lamp_scene

W, H = 48, 32
DATA = Path(__file__).parent / "data"
ROUNDING = 1e-5       # a tile of zero sample variance: its mean is env up to float32 sums' rounding


def _furnace_scene():
    """An albedo-1 Lambertian box (specular 0) with a spherical dent in its top face (concave:
    paths bounce several times)."""
    white = Material("white", color=(1.0, 1.0, 1.0), specular=0.0)
    return flatten(difference(box(1.0), sphere(1.25).translate(0, 0, 1.0)).material(white))


def _coloured_scene(emission=(0.0, 0.0, 0.0)):
    """Two spheres on a slab, three colours; the blue one emits ``emission``."""
    red = Material("red", color=(0.8, 0.2, 0.15))
    blue = Material("blue", color=(0.2, 0.3, 0.85), emission=emission)
    grey = Material("grey", color=(0.6, 0.6, 0.6))
    return flatten(union(box(2.0, 2.0, 0.1).material(grey),
                         sphere(Param("radius", 0.6)).translate(-0.7, 0, 0.7).material(red),
                         sphere(0.5).translate(0.8, 0.3, 0.6).material(blue)))


def _material_scene():
    """A slab under a rough gold metal sphere, a glass sphere and a small emitting sphere, and a
    camera that frames them."""
    metal = Material("metal", color=(0.9, 0.7, 0.4), roughness=0.3, metallic=1.0)
    glass = Material("glass", color=(1.0, 1.0, 1.0), transmission=1.0, ior=1.5)
    lamp = Material("lamp", color=(0.0, 0.0, 0.0), emission=(6.0, 5.0, 4.0), specular=0.0)
    floor = Material("floor", color=(0.6, 0.6, 0.6), roughness=0.6)
    tape = flatten(union(box(1.6, 1.2, 0.1).material(floor), sphere(0.5).translate(-0.55, 0, 0.6).material(metal),
                         sphere(0.5).translate(0.55, 0, 0.6).material(glass),
                         sphere(0.25).translate(0, 0.6, 0.35).material(lamp)))
    return tape, Camera((0.0, -4.5, 2.0), (0.0, 0.0, 0.45), fov_deg=30.0)


def _furnace(walker, spp):
    """Tile means and standard errors of the furnace (environment 0.8, roulette from the first
    bounce, so that every path that hits is noisy), and the environment. At 8 spp an edge tile
    whose few hit samples all survived the roulette (a 5 % event each) shows a standard error
    too small to cover its mean: 32 spp."""
    tape = _furnace_scene()
    env = 0.8
    path = PathSettings(environment=(env,) * 3, max_bounces=1024, roulette_from=1)
    im = PathImage(walker, tape, None, W, H, path=path).add(spp)
    assert walker.march(tape, im.camera, W, H)["hit"].mean() > 0.2     # (the object fills the middle)
    means, se = im.tile_stats(8)
    assert np.mean(se > 0) > 0.5           # (tiles with hits hold noise: the test is statistical)
    return means, se, env


def test_white_furnace_twin(walker_cpu):
    """A non-absorbing object in a uniform environment renders the environment, within noise."""
    means, se, env = _furnace(walker_cpu, 32)
    assert np.all(np.abs(means - env) <= 4 * se + ROUNDING), (means, se)


@pytest.mark.gpu
def test_white_furnace_gpu(walker_gpu):
    means, se, env = _furnace(walker_gpu, 32)
    assert np.all(np.abs(means - env) <= 4 * se + ROUNDING), (means, se)


def _assert_gpu_agrees_with_twin(walker_gpu, walker_cpu, tape, cam, same_seed: bool = True, **settings):
    """Independent sequences (seed 1 on the GPU, seed 2 on the twin) at 16 spp: per-tile (4x4)
    luminance means within 4 combined standard errors on >= 99 % of tiles, most tiles holding
    noise; with ``same_seed``, seed 2 on both draws the same radiance on >= 99 % of pixels."""
    g = PathImage(walker_gpu, tape, cam, W, H, path=PathSettings(seed=1, **settings)).add(16)
    c = PathImage(walker_cpu, tape, cam, W, H, path=PathSettings(seed=2, **settings)).add(16)
    (mg, sg), (mc, sc) = g.tile_stats(4), c.tile_stats(4)
    assert np.mean(sg > 0) > 0.5           # (most tiles hold noise: the test is statistical)
    ok = np.abs(mg - mc) <= 4 * np.hypot(sg, sc) + ROUNDING
    assert ok.mean() >= 0.99, (ok.mean(), mg - mc, np.hypot(sg, sc))
    if same_seed:
        same = PathImage(walker_gpu, tape, cam, W, H, path=PathSettings(seed=2, **settings)).add(2).mean()
        twin = PathImage(walker_cpu, tape, cam, W, H, path=PathSettings(seed=2, **settings)).add(2).mean()
        assert np.mean(np.all(np.abs(same - twin) <= 1e-4 * np.maximum(1, np.abs(twin)), axis=-1)) >= 0.99


@pytest.mark.gpu
def test_gpu_agrees_with_twin_within_noise(walker_gpu, walker_cpu):
    """Independent sequences (seed 1 on the GPU, seed 2 on the twin) at the same spp on metal,
    glass, an emitter and the environment: per-tile luminance means within 4 combined standard
    errors on >= 99 % of 4x4 tiles."""
    tape, cam = _material_scene()
    _assert_gpu_agrees_with_twin(walker_gpu, walker_cpu, tape, cam, same_seed=False, environment=(0.5, 0.45, 0.4))


@pytest.mark.gpu
def test_gpu_and_twin_draw_the_same_samples(walker_gpu, walker_cpu):
    """The same seed on both walkers: the same random numbers, so nearly every pixel's radiance
    agrees (float32 differences in the field, the hash's float conversion or the material
    model would show here), on metal, glass and an emitter."""
    tape, cam = _material_scene()
    g = PathImage(walker_gpu, tape, cam, W, H).add(2).mean()
    c = PathImage(walker_cpu, tape, cam, W, H).add(2).mean()
    same = np.all(np.abs(g - c) <= 1e-4, axis=-1)
    assert same.mean() >= 0.99, same.mean()


def test_light_samples_agree_with_bsdf_samples_alone(walker_cpu):
    """Next-event estimation toward the environment with MIS against paths that find the
    environment by BSDF sampling alone: the same image within noise (per 4x4 tile, 4 combined
    standard errors, >= 99 % of tiles), on diffuse, rough metal and glass. A BSDF whose sampling
    pdf disagreed with its value would part them."""
    tape, cam = _material_scene()
    env = (0.8, 0.8, 0.8)
    a = PathImage(walker_cpu, tape, cam, W, H, path=PathSettings(environment=env, seed=5)).add(64)
    b = PathImage(walker_cpu, tape, cam, W, H, path=PathSettings(environment=env, seed=6,
                                                                 light_samples=False)).add(64)
    (ma, sa), (mb, sb) = a.tile_stats(4), b.tile_stats(4)
    ok = np.abs(ma - mb) <= 4 * np.hypot(sa, sb) + ROUNDING
    assert np.mean(sa > 1e-3) > 0.5       # (most tiles hold noise: the test is statistical)
    assert ok.mean() >= 0.99, (ok.mean(), ma - mb)


def test_emitter_spheres_bound_the_emitters():
    """One sphere per connected emissive surface, holding it and not much more (a grid cell's
    half diagonal): two lamps of one material are two spheres; none without emission; an
    emission edit changes the list; emitters are picked in proportion to emission times radius
    squared."""
    tape, _ = lamp_scene(radius=0.25)
    ((c, r),) = [(s[:3], s[3]) for s in emitter_spheres(tape)]
    assert np.linalg.norm(c - (0.5, 0.3, 0.9)) < 0.05 and 0.25 <= r < 0.4, (c, r)
    assert len(emitter_spheres(_coloured_scene())) == 0
    tape.set_material("red", emission=(1.0, 0.0, 0.0))
    spheres = emitter_spheres(tape)
    assert len(spheres) == 2
    data = light_data(tape, PathSettings(environment=(0.0, 0.0, 0.0)))
    assert data[0] == 2 and data[1] == 0.0        # (a black environment takes no light samples)
    records = data[8:8 + 16].reshape(2, 8)
    brightest = {"lamp": 8.0, "red": 1.0}
    power = np.array([brightest[tape.material_names[int(s[4])]] for s in spheres]) * spheres[:, 3] ** 2
    np.testing.assert_allclose(records[:, 4], power / power.sum(), rtol=1e-5)
    np.testing.assert_allclose(records[:, 5], np.cumsum(power / power.sum()), rtol=1e-5)
    assert light_data(tape, PathSettings(emitter_samples=False))[:2].tolist() == [0.0, 1.0]
    lamp = Material("lamp", color=(0.0, 0.0, 0.0), emission=(3.0, 3.0, 3.0))
    two = flatten(union(box(1.5, 1.5, 0.1), sphere(0.2).translate(-1, 0, 1).material(lamp),
                        sphere(0.2).translate(1, 0, 1).material(lamp)))
    centres = sorted(tuple(np.round(s[:3], 1)) for s in emitter_spheres(two))
    assert centres == [(-1.0, 0.0, 1.0), (1.0, 0.0, 1.0)], centres


def test_emitter_samples_agree_with_bsdf_samples(walker_cpu):
    """Light samples toward the emitters' cones (MIS with the BSDF) against paths that find the
    emitters by their bounces alone: the same image within noise (4x4 tiles, 4 combined standard
    errors, >= 99 %): a lamp and a dimly glowing rough red sphere (two emitters, picked by
    power) over a diffuse slab, a grey environment."""
    tape, cam = lamp_scene()
    tape.set_material("red", emission=(0.6, 0.1, 0.05))
    assert len(emitter_spheres(tape)) == 2
    env = (0.3, 0.3, 0.3)
    a = PathImage(walker_cpu, tape, cam, W, H, path=PathSettings(environment=env, seed=3)).add(64)
    b = PathImage(walker_cpu, tape, cam, W, H, path=PathSettings(environment=env, seed=4, emitter_samples=False)).add(64)
    (ma, sa), (mb, sb) = a.tile_stats(4), b.tile_stats(4)
    assert np.mean(sa > 1e-4) > 0.5
    ok = np.abs(ma - mb) <= 4 * np.hypot(sa, sb) + ROUNDING
    assert ok.mean() >= 0.99, (ok.mean(), ma - mb)


def test_emitter_samples_lower_the_noise(walker_cpu):
    """A small bright emitter in a black environment: at 32 spp the RMSE against a 512 spp image
    (emitter samples, another seed) is well under that of BSDF samples alone."""
    tape, cam = lamp_scene(radius=0.1, emission=40.0)

    def image(emitters, seed, spp):
        path = PathSettings(environment=(0.0, 0.0, 0.0), seed=seed, emitter_samples=emitters)
        return PathImage(walker_cpu, tape, cam, W, H, path=path).add(spp).mean()
    reference = image(True, 9, 512)
    err = {e: np.sqrt(np.mean((image(e, 3, 32) - reference) ** 2)) for e in (True, False)}
    assert err[True] < 0.5 * err[False], err


@pytest.mark.gpu
def test_gpu_agrees_with_twin_on_a_lamp_in_the_dark(walker_gpu, walker_cpu):
    """Emitter samples alone (a black environment): GPU (seed 1) and twin (seed 2) within 4
    combined standard errors on >= 99 % of 4x4 tiles at 16 spp; and the same seed draws the same
    radiance on >= 99 % of pixels."""
    tape, cam = lamp_scene()
    _assert_gpu_agrees_with_twin(walker_gpu, walker_cpu, tape, cam, environment=(0.0, 0.0, 0.0))


def _sky(width=32, height=16):
    """A non-uniform equirectangular map: a blue-to-white gradient over the sphere and a small
    bright sun (50) a quarter of the way down."""
    rows = np.linspace(0.2, 1.0, height, dtype=np.float32)[:, None, None]
    img = np.broadcast_to(rows * np.array([0.6, 0.7, 1.0], np.float32), (height, width, 3)).copy()
    img[height // 4, width // 3:width // 3 + 2] = 50.0
    return img


def test_hdr_and_pfm_files_round_trip(tmp_path):
    """write_hdr / read_hdr keep each pixel within RGBE's precision (1/256 of its largest
    channel), run-length encoded rows (width >= 8) and flat ones; PFM exactly; broken files are
    refused naming the file and the reason."""
    img = _sky()
    for width in (32, 5):
        a = img[:, :width]
        back = read_hdr(write_hdr(tmp_path / f"sky{width}.hdr", a))
        assert back.shape == a.shape
        assert np.all(np.abs(back - a) <= a.max(-1, keepdims=True) / 128)
    np.testing.assert_array_equal(read_pfm(write_pfm(tmp_path / "sky.pfm", img)), img)
    good = (tmp_path / "sky32.hdr").read_bytes()
    bad = {"short.hdr": (good[:-40], "ends early"), "magic.hdr": (b"P6\n" + good, "not a Radiance"),
           "xyze.hdr": (good.replace(b"32-bit_rle_rgbe", b"32-bit_rle_xyze"), "not supported"),
           "sky.png": (good, ".hdr")}
    for name, (data, reason) in bad.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TaperayError, match=reason) as e:
            read_environment(tmp_path / name)
        assert name in str(e.value)
    with pytest.raises(TaperayError, match="no such"):
        read_environment(tmp_path / "none.hdr")


def test_environment_map_sampling_pdf_integrates_to_one():
    """The map's importance sampling: the mean of 1 / pdf over its own samples is the sphere's
    4 pi (a pdf that disagreed with the sampling would miss it), and it puts more samples on the
    sun than its solid angle's share."""
    data = light_data(flatten(sphere(1.0)), PathSettings(environment_map=EnvironmentMap(_sky())))
    rng = np.random.default_rng(0)
    u = rng.random((20000, 2), dtype=np.float32)
    dirs = np.array([sample_env(data, np.float32(a), np.float32(b)) for a, b in u])
    pdf = np.array([env_pdf(data, *d) for d in dirs])
    assert np.all(pdf > 0)
    assert abs(np.mean(1 / pdf) / (4 * np.pi) - 1) < 0.03
    rows = np.array([env_pixel(data, *d)[0] for d in dirs])
    assert np.mean(rows == 4) > 0.3


def test_constant_map_is_the_constant_environment(walker_cpu):
    """A map of one value (0.8) renders the furnace as the constant environment 0.8 does: every
    8x8 tile within 4 standard errors of 0.8, and within noise of the constant's image."""
    tape = _furnace_scene()
    flat = EnvironmentMap(np.full((8, 16, 3), 0.8, np.float32))
    path = PathSettings(environment_map=flat, max_bounces=1024, roulette_from=1, seed=1)
    a = PathImage(walker_cpu, tape, None, W, H, path=path).add(32)
    b = PathImage(walker_cpu, tape, None, W, H, path=PathSettings(environment=(0.8,) * 3, max_bounces=1024,
                                                                  roulette_from=1, seed=2)).add(32)
    (ma, sa), (mb, sb) = a.tile_stats(8), b.tile_stats(8)
    assert np.mean(sa > 0) > 0.5
    assert np.all(np.abs(ma - 0.8) <= 4 * sa + ROUNDING), (ma, sa)
    assert np.mean(np.abs(ma - mb) <= 4 * np.hypot(sa, sb) + ROUNDING) >= 0.99


def test_map_importance_sampling_agrees_with_uniform(walker_cpu):
    """On the sky map, light samples drawn by the map's CDFs against uniform ones: the same image
    within noise (4x4 tiles, >= 99 % within 4 combined standard errors), metal, glass, lamp."""
    tape, cam = _material_scene()
    sky = EnvironmentMap(_sky())
    a = PathImage(walker_cpu, tape, cam, W, H, path=PathSettings(environment_map=sky, seed=3)).add(64)
    b = PathImage(walker_cpu, tape, cam, W, H, path=PathSettings(environment_map=sky, seed=4,
                                                                 environment_sampling="uniform")).add(64)
    (ma, sa), (mb, sb) = a.tile_stats(4), b.tile_stats(4)
    assert np.mean(sa > 1e-3) > 0.5
    ok = np.abs(ma - mb) <= 4 * np.hypot(sa, sb) + ROUNDING
    assert ok.mean() >= 0.99, (ok.mean(), ma - mb)


@pytest.mark.gpu
def test_gpu_agrees_with_twin_under_a_map(walker_gpu, walker_cpu):
    """The sky map: GPU (seed 1) and twin (seed 2) within 4 combined standard errors on >= 99 % of
    4x4 tiles at 16 spp; the same seed draws the same radiance on >= 99 % of pixels."""
    tape, cam = _material_scene()
    _assert_gpu_agrees_with_twin(walker_gpu, walker_cpu, tape, cam, environment_map=EnvironmentMap(_sky()))


def test_glass_furnace_twin(walker_cpu):
    """A smooth glass sphere (white, ior 1.5) in a uniform environment reflects or refracts all
    light: without roulette every path's weight is 1, so every pixel is the environment up to
    float32 rounding (the Lambertian furnace covers the roulette)."""
    glass = Material("glass", color=(1.0, 1.0, 1.0), transmission=1.0, ior=1.5)
    tape = flatten(sphere(1.0).material(glass))
    exact = PathSettings(environment=(0.7,) * 3, max_bounces=1024, roulette_from=1024)
    im = PathImage(walker_cpu, tape, None, W, H, path=exact).add(8)
    assert walker_cpu.march(tape, im.camera, W, H)["hit"].mean() > 0.1
    np.testing.assert_allclose(im.mean(), 0.7, atol=1e-4)


def _emitter(walker):
    """A black sphere emitting (2, 1, 0.5) in a black environment: the centre pixel's every sample
    hits it, so its mean is the emission exactly; a corner pixel sees nothing."""
    glow = Material("glow", color=(0.0, 0.0, 0.0), emission=(2.0, 1.0, 0.5))
    tape = flatten(sphere(1.0).material(glow))
    path = PathSettings(environment=(0.0, 0.0, 0.0))
    m = PathImage(walker, tape, None, 16, 16, path=path).add(4).mean()
    np.testing.assert_allclose(m[8, 8], (2.0, 1.0, 0.5), rtol=1e-6)
    np.testing.assert_array_equal(m[0, 0], 0.0)


def test_emission_twin(walker_cpu):
    _emitter(walker_cpu)


@pytest.mark.gpu
def test_emission_gpu(walker_gpu):
    _emitter(walker_gpu)


def test_sequence_is_fixed():
    """The sampler's numbers are computed in 32-bit integers, not drawn from the platform: all in
    [0, 1), different across pixel, sample, bounce and dimension, uniform over pixels; the hash
    sampler's likewise."""
    for rnd in (path_random, hash_random):
        v = [rnd(0, 0, 0, 0, 0), rnd(0, 1, 0, 0, 0), rnd(0, 0, 1, 0, 0), rnd(0, 0, 0, 1, 0), rnd(0, 0, 0, 0, 1),
             rnd(5, 0, 0, 0, 0)]
        assert all(0 <= x < 1 for x in v) and len(set(v)) == len(v)
        u = np.array([rnd(0, p, 0, 0, 0) for p in range(4096)])
        assert abs(u.mean() - 0.5) < 0.02 and abs(u.var() - 1 / 12) < 0.01


def test_sobol_second_dimension_is_the_direction_numbers():
    """sobol_owen's dimension 1 (its closed form: a superset sum of the index's bits) equals the
    Sobol generator's sum of direction numbers v_0 = 2^31, v_k+1 = v_k ^ (v_k >> 1), under the
    same scrambling."""
    v = [1 << 31]
    for _ in range(31):
        v.append(v[-1] ^ (v[-1] >> 1))
    rng = np.random.default_rng(0)
    for i in [*range(64), *map(int, rng.integers(0, 1 << 32, 200))]:
        direct = 0
        for k in range(32):
            if i >> k & 1:
                direct ^= v[k]
        assert sobol_owen(i, 1, 0) == reverse_bits(laine_karras(reverse_bits(direct), 0))


def test_sobol_pairs_are_stratified_per_pixel():
    """Each pixel's first 16 samples of a dimension pair fill every cell of a 4x4 grid and every
    1/16 interval of each dimension (a (0, 4, 2)-net), at every bounce and pair; the hash sampler's
    do not; different pixels get different points."""
    def cells(rnd, p, b, d):
        pts = np.array([[rnd(3, p, s, b, d), rnd(3, p, s, b, d + 1)] for s in range(16)])
        return len(set(map(tuple, (pts * 4).astype(int)))), len(set((pts[:, 0] * 16).astype(int)))
    for p in (0, 1, 777):
        for b in (0, 1, 5):
            for d in (0, 2, 4):
                assert cells(path_random, p, b, d) == (16, 16)
    assert any(cells(hash_random, p, 1, 0) != (16, 16) for p in range(4))
    assert path_random(3, 0, 0, 1, 0) != path_random(3, 1, 0, 1, 0)


def test_sobol_lowers_the_error_at_equal_spp(walker_cpu):
    """The silhouette of an emitting sphere on black (one bounce: the pixel footprint's
    coverage alone): at 16 spp the Sobol sampler's RMSE against a 1,024 spp image is well under
    the hash sampler's."""
    glow = Material("glow", color=(0.0, 0.0, 0.0), emission=(1.0, 1.0, 1.0))
    tape = flatten(sphere(1.0).material(glow))

    def image(sampler, seed, spp):
        path = PathSettings(environment=(0.0, 0.0, 0.0), max_bounces=1, sampler=sampler, seed=seed)
        return PathImage(walker_cpu, tape, None, 32, 32, path=path).add(spp).mean()
    reference = image("hash", 9, 1024)
    err = {s: np.sqrt(np.mean((image(s, 1, 16) - reference) ** 2)) for s in ("hash", "sobol")}
    assert err["sobol"] < 0.5 * err["hash"], err


def test_progressive_accumulation_adds_the_next_samples(walker_cpu):
    """add(2) then add(3) is add(5): each call traces the sequence's next samples."""
    tape = _coloured_scene()
    a = PathImage(walker_cpu, tape, None, 24, 16).add(2).add(3)
    b = PathImage(walker_cpu, tape, None, 24, 16).add(5)
    assert a.samples == b.samples == 5
    np.testing.assert_allclose(a.sums, b.sums, rtol=1e-5, atol=1e-5)
    assert not np.allclose(PathImage(walker_cpu, tape, None, 24, 16).add(2).sums, b.sums)


@pytest.mark.gpu
def test_gpu_sums_stay_on_the_gpu_between_adds(walker_gpu, monkeypatch):
    """On the GPU add(2) then add(3) is add(5) to the bit (the same samples summed in the same
    order, on the GPU); an add reads back nothing but the counters (and the live paths per round);
    two images on one walker, their adds interleaved with a render, each keep their own sums; rgb8,
    tonemapped on the GPU, is the mean's picture (a channel at most one level off, float32 against
    float64)."""
    tape = _coloured_scene()
    before = walker_gpu.stats()["bytes_read"]
    a = PathImage(walker_gpu, tape, None, 24, 16).add(2).add(3)
    after = walker_gpu.stats()["bytes_read"]
    read = {label for label in after if after[label] != before.get(label, 0)}
    assert read and read <= {"counters", "watched counts"}
    other = PathImage(walker_gpu, _furnace_scene(), None, 24, 16).add(2)
    walker_gpu.render(tape, None, 24, 16)
    b = PathImage(walker_gpu, tape, None, 24, 16).add(1)
    other.add(1)
    b.add(4)
    assert a.samples == b.samples == 5
    np.testing.assert_array_equal(a.sums, b.sums)
    np.testing.assert_array_equal(other.sums, PathImage(walker_gpu, _furnace_scene(), None, 24, 16).add(3).sums)
    assert not np.array_equal(PathImage(walker_gpu, tape, None, 24, 16).add(2).sums, b.sums)
    picture = np.round(np.clip(b.mean().astype(np.float64), 0, 1) ** (1 / 2.2) * 255)
    rgb = b.rgb8()
    assert rgb.dtype == np.uint8 and rgb.shape == (16, 24, 3)
    assert np.abs(rgb - picture).max() <= 1 and np.mean(rgb == picture) > 0.99


@pytest.mark.gpu
def test_gpu_images_made_one_after_another_each_draw_into_their_own_sums(walker_gpu):
    """Path images made and dropped one after another: each one's adds land in its own sums (the
    walker's bind group is kept by the buffers themselves, not their id(), which a new buffer may
    take over from a dropped one: then samples went to the dropped image's buffer)."""
    tape = _coloured_scene()
    first = PathImage(walker_gpu, tape, None, 16, 8).add(1).sums
    assert first[..., 3].sum() > 0
    for _ in range(12):
        np.testing.assert_array_equal(PathImage(walker_gpu, tape, None, 16, 8).add(1).sums, first)


@pytest.mark.gpu
def test_gpu_waves_of_part_of_the_image_give_the_same_sums(walker_gpu, monkeypatch):
    """An image whose paths' state passes the binding limit is traced in waves of the pixels
    that fit (here 4 waves of at most 100): the same sums to the bit as in one wave."""
    from taperay.runtime.gpu_device import PATH_F_WORDS
    tape = _coloured_scene()
    whole = PathImage(walker_gpu, tape, None, 24, 16).add(2).sums
    monkeypatch.setitem(walker_gpu.context.limits, "max_storage_buffer_binding_size", 4 * PATH_F_WORDS * 100)
    generated = walker_gpu.stats()["dispatches"].get("path_generate", 0)
    waves = PathImage(walker_gpu, tape, None, 24, 16).add(2)
    assert walker_gpu.stats()["dispatches"]["path_generate"] - generated == 2 * 4    # (2 samples x 4 waves)
    np.testing.assert_array_equal(waves.sums, whole)


@pytest.mark.gpu
def test_gpu_paths_resume_past_the_iteration_cap(walker_gpu, walker_cpu):
    """Prospero's slab (7,591 records, about as many interpreter steps an evaluation): a path's
    tens of field evaluations pass a software adapter's per-invocation iteration cap (lavapipe:
    60,000; this tape was refused there), so its marches stop at the budget and go on in the
    next round; the same seed gives the twin's radiance on >= 99 % of pixels (a hardware driver
    that fuses multiply-adds, which the twin does not, parts more paths that graze the slab's
    edges: >= 97 % there; the NVIDIA H200 measured 98.6 %, 2 of 144 pixels)."""
    from taperay.scenegraph.loading import load_tape
    tape = load_tape(DATA / "prospero.vm")
    w, h = 16, 9
    g = PathImage(walker_gpu, tape, None, w, h).add(1)
    c = PathImage(walker_cpu, tape, None, w, h).add(1)
    assert 0.1 < walker_cpu.march(tape, c.camera, w, h)["hit"].mean() < 1
    if walker_gpu.info["software"]:
        assert g.stats()["pauses"] > 0
    same = np.all(np.abs(g.mean() - c.mean()) <= 1e-4, axis=-1)
    assert same.mean() >= (0.99 if walker_gpu.info["software"] else 0.97), same.mean()


@pytest.mark.gpu
def test_gpu_paths_march_on_pruned_cells_kept_between_adds(walker_gpu, monkeypatch):
    """An arithmetic tape of at least PRUNE_MIN_RECORDS records (prospero's slab; on (4, 2)
    cells here, whose pruned tapes fit lavapipe's binding limit, where (8, 2)'s do not): its
    paths march on its pruned march cells (path_trace_cells), pruned once and kept for the next
    add; a render in between (which uses out_u) makes the next add prune again; the sums equal
    those traced on the tape's own records (pruning is exact in a cell) on >= 99 % of pixels; a
    scene tape prunes none."""
    from taperay.runtime.gpu_pruning import GpuPrunedPasses
    from taperay.scenegraph.loading import load_tape
    tape = load_tape(DATA / "prospero.vm")
    w, h = 16, 9
    monkeypatch.setattr(GpuPrunedPasses, "march_cells_for", staticmethod(lambda tape, cells: (4, 2)))
    im = PathImage(walker_gpu, tape, None, w, h).add(1)
    im.add(1)
    assert im.stats()["cell_prunes"] == 1
    walker_gpu.render(tape, im.camera, w, h)
    im.add(1)
    assert im.stats()["cell_prunes"] == 2
    monkeypatch.setattr(GpuPrunedPasses, "march_cells_for", staticmethod(lambda tape, cells: None))
    plain = PathImage(walker_gpu, tape, None, w, h).add(3)
    assert plain.stats()["cell_prunes"] == 0
    same = np.all(np.abs(plain.mean() - im.mean()) <= 1e-5, axis=-1)
    assert same.mean() >= 0.99, same.mean()
    monkeypatch.undo()
    assert PathImage(walker_gpu, _coloured_scene(), None, w, h).add(1).stats()["cell_prunes"] == 0


@pytest.mark.gpu
def test_no_pipeline_made_by_a_second_render_or_an_edit(walker_gpu):
    """A second add and picture, a parameter edit, a material edit (a buffer write of the
    record's bytes) and another scene of the same register variant make no pipeline."""
    tape = _coloured_scene()
    im = PathImage(walker_gpu, tape, None, 16, 16).add(1)
    im.rgb8()
    walker_gpu.kernels.settle()           # (the pipelines the background builds after a first request)
    made = walker_gpu.kernels.stats.pipelines_created
    im.add(1)
    im.rgb8()
    walker_gpu.set_param(tape, "radius", 0.4)
    PathImage(walker_gpu, tape, None, 16, 16).add(1)
    written = walker_gpu.stats()["tape_bytes_written"]
    walker_gpu.set_material(tape, "red", emission=(1.0, 0.5, 0.0), metallic=1.0)
    assert 0 < walker_gpu.stats()["tape_bytes_written"] - written <= 48   # (within the one record)
    PathImage(walker_gpu, tape, None, 16, 16).add(1)
    other = _furnace_scene()
    PathImage(walker_gpu, other, None, 16, 16).add(1)
    assert walker_gpu.kernels.stats.pipelines_created == made


@pytest.mark.parametrize("walker_name", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_material_edit_shows_in_the_next_image(walker_name, request):
    """set_material on the walker: the next image draws the edited record (emission here), the
    other materials' pixels as before (same seed, same samples)."""
    walker = request.getfixturevalue(f"walker_{walker_name}")
    tape = _coloured_scene()
    before = PathImage(walker, tape, None, 24, 16, path=PathSettings(max_bounces=1)).add(1).mean()
    walker.set_material(tape, "blue", emission=(5.0, 5.0, 5.0))
    after = PathImage(walker, tape, None, 24, 16, path=PathSettings(max_bounces=1)).add(1).mean()
    brighter = np.all(after >= before + 4.9, axis=-1)
    assert 0 < brighter.mean() < 0.5 and np.array_equal(after[~brighter], before[~brighter])


def test_bad_settings_are_refused(walker_cpu):
    with pytest.raises(TaperayError, match="environment"):
        PathSettings(environment=(1, -1, 0))
    with pytest.raises(TaperayError, match="max_bounces"):
        PathSettings(max_bounces=0)
    with pytest.raises(TaperayError, match="sampler"):
        PathSettings(sampler="halton")
    with pytest.raises(TaperayError, match="environment_sampling"):
        PathSettings(environment_sampling="cosine")
    with pytest.raises(TaperayError, match="not finite or < 0"):
        EnvironmentMap(np.full((2, 4, 3), -1.0))
    with pytest.raises(TaperayError, match="no material named 'lamp'"):
        walker_cpu.set_material(_coloured_scene(), "lamp", emission=(1, 1, 1))
    with pytest.raises(TaperayError, match="emission"):
        Material("red", emission=(1, 1))
    with pytest.raises(TaperayError, match="emission"):
        walker_cpu.set_material(_coloured_scene(), "red", emission=(1, -1, 1))
    with pytest.raises(TaperayError, match="no samples"):
        PathImage(walker_cpu, _coloured_scene(), None, 8, 8).mean()


def test_path_tracer_refuses_other_walkers():
    class Other:
        name = "jax"
    with pytest.raises(TaperayError, match="cpu and gpu walkers"):
        PathImage(Other(), _coloured_scene(), None, 8, 8).add(1)


@pytest.mark.parametrize("walker_name", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_cli_renders_the_path_view(capsys, tmp_path, walker_name, request):
    """`taperay render --view path --spp N` writes PathImage's picture on the walker asked for;
    --spp out of range and --cone with the path view are usage errors."""
    from PIL import Image

    from taperay.tools import cli
    if walker_name == "gpu":
        request.getfixturevalue("walker_gpu")      # (skips, or fails under TAPERAY_REQUIRE_GPU, without one)
    scene = tmp_path / "two.py"
    scene.write_text("from taperay.scenegraph import box, sphere\n"
                     "scene = sphere(0.6) | box(0.3).translate(0.7, 0, 0)\n")
    out = tmp_path / "path.png"
    assert cli.main(["render", str(scene), "-o", str(out), "--size", "24x16", "--view", "path", "--spp", "3",
                     "--walker", walker_name]) == 0
    assert "path" in capsys.readouterr().out
    from taperay.scenegraph.loading import load_tape
    walker = request.getfixturevalue(f"walker_{walker_name}")
    expect = PathImage(walker, load_tape(scene), None, 24, 16).add(3).rgb8()
    np.testing.assert_array_equal(np.asarray(Image.open(out)), expect)
    for bad in (["--spp", "0"], ["--cone", "1"]):
        assert cli.main(["render", str(scene), "-o", str(out), "--view", "path", *bad]) == 2
        assert "error" in capsys.readouterr().err


def test_cli_path_environment_and_bounces(capsys, tmp_path, walker_cpu):
    """`render --view path --environment R,G,B | FILE --max-bounces N` draws PathImage's picture
    with those settings; a bad value or file is one error line naming it and the reason."""
    from PIL import Image

    from taperay.scenegraph.loading import load_tape
    from taperay.tools import cli
    scene = tmp_path / "two.py"
    scene.write_text("from taperay.scenegraph import box, sphere\n"
                     "scene = sphere(0.6) | box(0.3).translate(0.7, 0, 0)\n")
    sky = write_hdr(tmp_path / "sky.hdr", _sky())
    out = tmp_path / "path.png"
    cases = ((["--environment", "0.2,0.3,0.4", "--max-bounces", "2"], PathSettings(environment=(0.2, 0.3, 0.4), max_bounces=2)),
             (["--environment", str(sky)], PathSettings(environment_map=EnvironmentMap.read(sky))))
    for opts, path in cases:
        assert cli.main(["render", str(scene), "-o", str(out), "--size", "24x16", "--view", "path", "--spp", "2",
                         "--walker", "cpu", *opts]) == 0
        capsys.readouterr()
        expect = PathImage(walker_cpu, load_tape(scene), None, 24, 16, path=path).add(2).rgb8()
        np.testing.assert_array_equal(np.asarray(Image.open(out)), expect)
    (tmp_path / "broken.hdr").write_bytes(sky.read_bytes()[:60])
    bad = ((["--environment", "1,2"], "R,G,B"), (["--environment", "1,x,1"], "R,G,B"),
           (["--environment", str(tmp_path / "none.hdr")], "none.hdr: no such"),
           (["--environment", str(tmp_path / "broken.hdr")], "broken.hdr: the pixel data ends early"),
           (["--max-bounces", "0"], "--max-bounces 0"))
    for opts, reason in bad:
        assert cli.main(["render", str(scene), "-o", str(out), "--view", "path", "--walker", "cpu", *opts]) == 2
        err = capsys.readouterr().err
        assert "error" in err and reason in err and "Traceback" not in err, err
    assert cli.main(["render", str(scene), "-o", str(out), "--environment", "1,1,1"]) == 2
    assert "--view path" in capsys.readouterr().err


@pytest.mark.gpu
def test_path_samples_leave_other_gpu_work_alone(walker_gpu):
    """A render on pruned cells and an evaluation after a path sample equal those before it (the
    path kernels keep their paths' state where the render keeps its pruned cells, and their sums
    in the image's own buffer: the render prunes its cells again)."""
    tape = _coloured_scene()
    pts = np.array([[0.0, 0.0, 0.7], [1.0, 1.0, 1.0]], np.float32)
    before = walker_gpu.render(tape, None, 24, 16, cells=(8, 2)), walker_gpu.evaluate(tape, pts)[0]
    PathImage(walker_gpu, tape, None, 24, 16).add(1)
    np.testing.assert_array_equal(walker_gpu.render(tape, None, 24, 16, cells=(8, 2)), before[0])
    np.testing.assert_array_equal(walker_gpu.evaluate(tape, pts)[0], before[1])


@pytest.mark.slow
@pytest.mark.parametrize("walker_name", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_bench_path_measures_each_scene_and_counts_the_edits_pipelines(tmp_path, monkeypatch, walker_name,
                                                                       request):
    """`taperay bench path` writes a row per scene with its rate and the edits it made; on the GPU
    the edits (materials, a parameter, a topology edit of the same register variant) make no
    pipeline. (The GPU run: the showcase alone, lavapipe being slow.)"""
    import json

    from taperay.tools import bench_path, cli
    if walker_name == "gpu":
        request.getfixturevalue("walker_gpu")
        monkeypatch.setattr(bench_path, "SCENES", bench_path.SCENES[:1])
    assert cli.main(["bench", "path", "--walker", walker_name, "--repeat", "1", "--size", "16x9",
                     "-o", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "path.json").read_text())
    assert [r["scene"] for r in doc["rows"]] == [label for label, _ in bench_path.SCENES]
    for row in doc["rows"]:
        assert row["Msamples/s"] > 0 and row["time to 256 spp s"] > 0, row
        assert row["edits"] >= (3 if row["scene"] != "prospero slab" else 0)
        if walker_name == "gpu":
            assert row["register variants drawn"] == 1 and row["pipelines created by edits"] == 0
        else:
            assert row["pipelines created by edits"] == "-"
    assert "Msamples/s" in (tmp_path / "path.md").read_text()


@pytest.mark.slow
def test_agrees_with_mitsuba_within_noise(walker_cpu):
    """Spheres and boxes on a slab (Lambertian, a white GGX conductor, smooth glass, an emitter,
    a constant environment) in taperay's twin and in Mitsuba 3 (scalar_rgb, its own sphere and
    cube shapes, path integrator, box filter): per 4x4 tile, mean luminance within 4 combined
    standard errors on >= 99 % of tiles (tools/bench_path.py compare_with_mitsuba)."""
    pytest.importorskip("mitsuba")
    from taperay.tools.bench_path import compare_with_mitsuba
    r = compare_with_mitsuba(walker_cpu, W, H, 128, passes=8, tile=4)
    assert np.mean(r["z"] > 0) > 0.5       # (most tiles hold noise: the test is statistical)
    assert r["ok"].mean() >= 0.99, (r["ok"].mean(), r["z"])


@pytest.mark.slow
def test_bench_path_mitsuba_writes_its_row_and_the_pictures(tmp_path):
    import json

    from taperay.tools import cli
    pytest.importorskip("mitsuba")
    assert cli.main(["bench", "path-mitsuba", "--repeat", "16", "--size", "32x24", "-o", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "path-mitsuba.json").read_text())["rows"]
    assert row["tiles"] == 12 and 0 <= row["tiles within 4 SE"] <= 1 and row["mitsuba s"] > 0
    from PIL import Image
    assert Image.open(tmp_path / "path-mitsuba-pictures.png").size == (64, 24)


@pytest.mark.slow
def test_bench_path_noise_writes_its_rows(tmp_path):
    """`bench path-noise` at a small size: a row per spp for the samplers and for the emitter
    samples, each RMSE positive and finite."""
    import json

    from taperay.tools import cli
    assert cli.main(["bench", "path-noise", "--walker", "cpu", "--size", "16x12", "-o", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "path-noise.json").read_text())["rows"]
    assert [(r["measure"], r["spp"]) for r in rows] == [("sampler", 16), ("sampler", 64), ("emitter samples", 16),
                                                       ("emitter samples", 64)]
    for r in rows:
        errors = [r[k] for k in ("RMSE hash", "RMSE sobol", "RMSE without", "RMSE with") if k in r]
        assert len(errors) == 2 and all(0 < e < np.inf for e in errors)
