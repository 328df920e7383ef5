"""An irregular assembly: 100,000 hex bolts at random poses (uniform random rotations, scales
0.8..1.2) in an open bin, one INSTANCES record over a vectorised BVH (fixed-seed RNG, no Python
loop per bolt). The same bolt body is shared by every instance."""
import math

import numpy as np

from taperay.scenegraph import Material, box, cylinder, extrude, union

ZINC = Material("zinc", (0.72, 0.74, 0.78), 0.4)
STEEL_BLUE = Material("bin", (0.20, 0.32, 0.50), 0.6)

SEED = 5
BIN = (10.0, 10.0, 1.2)       # inner half extents of the bin
WALL = 0.15


def bolt():
    """A hex-head bolt along z, about 0.3 long."""
    head = extrude([(0.06 * math.cos(a), 0.06 * math.sin(a)) for a in (i * math.pi / 3 for i in range(6))], 0.025)
    return union(head.translate(0, 0, 0.125), cylinder(0.03, 0.12)).material(ZINC)


def poses(n: int, seed: int = SEED, half=BIN):
    """(translations, unit quaternions, scales) of n bolts scattered through the bin's volume."""
    rng = np.random.default_rng(seed)
    hx, hy, hz = half
    t = rng.uniform((-hx + 0.3, -hy + 0.3, -hz + 0.3), (hx - 0.3, hy - 0.3, hz - 0.3), (n, 3))
    q = rng.normal(size=(n, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    s = rng.uniform(0.8, 1.2, n)
    return t, q, s


def build(n: int = 100_000, seed: int = SEED):
    """n bolts in the bin (2 n + 2 primitive instances); piles above 100,000 bolts get a wider bin
    of the same density."""
    k = math.sqrt(max(1.0, n / 100_000))
    hx, hy, hz = BIN[0] * k, BIN[1] * k, BIN[2]
    tray = box(hx + WALL, hy + WALL, hz + WALL / 2) - box(hx, hy, hz + WALL).translate(0, 0, WALL)
    t, q, s = poses(n, seed, (hx, hy, hz))
    return union(tray.material(STEEL_BLUE), bolt().instances(t, q, s))


scene = build()

TEST = {"size": (96, 64), "instances": 2 + 2 * 100_000}
