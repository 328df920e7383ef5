"""The shade view's colour formula (runtime.shading.compose, a Numba kernel) against the formula of
its docstring written out in numpy, on random march and light results."""
import numpy as np
import pytest

from taperay.runtime.camera import Camera
from taperay.runtime.shading import RenderSettings, compose, to_rgb8
from taperay.scenegraph import Material, box, flatten, sphere, union


def shade_formula(packed_get, materials, dirs, march, light):
    """compose's docstring for "shade", array by array (float64)."""
    hit = march["hit"]
    g = march["grad"].astype(np.float64)[hit]
    glen = np.linalg.norm(g, axis=-1)
    n = g / np.where(glen > 0, glen, 1)[..., None]
    m = np.clip(march["mat"][hit].astype(np.int64), 0, len(materials) - 1)
    base, rough = materials["color"][m].astype(np.float64), materials["roughness"][m].astype(np.float64)
    key, fill = packed_get("key_dir"), packed_get("fill_dir")
    shadow, ao = light["shadow"][hit][..., None], light["ao"][hit][..., None]
    amb = packed_get("ground_color") + (packed_get("sky_color") - packed_get("ground_color")) * (0.5 + 0.5 * n[..., 2:3])
    ndk = n @ key
    hv = key - dirs.astype(np.float64)[hit]
    hv /= np.linalg.norm(hv, axis=-1, keepdims=True)
    spec = packed_get("specular")[0] * (1 - rough) * np.maximum(np.sum(n * hv, -1), 0) ** (2 + 126 * (1 - rough) ** 2)
    spec = np.where(ndk > 0, spec, 0)[..., None]
    key_col = packed_get("key_color")
    lin = base * (amb * ao + key_col * np.maximum(ndk, 0)[..., None] * shadow
                  + packed_get("fill_color") * np.maximum(n @ fill, 0)[..., None]) + key_col * spec * shadow
    out = np.empty(hit.shape + (3,))
    out[...] = packed_get("background")
    out[hit] = np.clip(lin, 0, 1) ** (1 / 2.2)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_shade_colours_follow_the_documented_formula(seed):
    from taperay.runtime.shading import unpack
    rng = np.random.default_rng(seed)
    mats = [Material(f"m{i}", tuple(rng.uniform(0, 1, 3)), float(rng.uniform(0, 1))) for i in range(3)]
    tape = flatten(union(*(sphere(0.5).translate(i, 0, 0).material(mt) for i, mt in enumerate(mats)), box(0.2)))
    h, w = 40, 60
    cam = Camera((1.0, -4.0, 2.0), (1.0, 0.0, 0.0), fov_deg=50)
    _, dirs = cam.rays(w, h)
    grad = rng.normal(size=(h, w, 3)).astype(np.float32)
    grad[0, :4] = 0                                     # no gradient: normal 0
    grad[1, :2] = np.nan                                # NaN gradient: a NaN colour, black in the image
    march = dict(hit=rng.uniform(size=(h, w)) < 0.7, grad=grad,
                 mat=rng.integers(0, len(tape.materials) + 3, (h, w)).astype(np.uint32))   # some out of range
    light = dict(shadow=rng.uniform(0, 1, (h, w)).astype(np.float32), ao=rng.uniform(0, 1, (h, w)).astype(np.float32))
    march["hit"][:2, :4] = True
    packed = RenderSettings().pack(tape, "shade")
    want = shade_formula(lambda k: unpack(packed, k).astype(np.float64), tape.materials, dirs, march, light)
    got = compose("shade", packed, tape.materials, cam.pack(), dirs, march=march, light=light)
    assert np.isnan(got[1, :2]).all() and np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)
    assert (to_rgb8(got)[1, :2] == 0).all()


def test_display_bytes_round_to_nearest_even_and_clip():
    """to_rgb8: NaN 0, clipped into [0, 1] (infinities too), times 255, ties to even."""
    rng = np.random.default_rng(1)
    c = rng.uniform(-0.5, 1.5, (30, 20, 3))
    c[0, :5, 0] = [np.nan, np.inf, -np.inf, 0.5 / 255, 2.5 / 255]       # ties: 0.5 -> 0, 2.5 -> 2
    want = np.rint(np.clip(np.nan_to_num(c), 0, 1) * 255).astype(np.uint8)
    got = to_rgb8(c)
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    assert got[0, :5, 0].tolist() == [0, 255, 0, 0, 2]
