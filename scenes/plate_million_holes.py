"""A plate with 10^6 holes: a 100 x 100 plate minus a 1000 x 1000 grid pattern of holes, one
REPEAT_GRID loop (O(1) per point). The hole is a field whose radius grows with
``instance_index`` (per-instance variation by index: 0.02 at the first hole, 0.04 at the last),
so a million different holes are still a handful of records."""
from taperay.scenegraph import Material, box, field
from taperay.scenegraph.fields import abs_, instance_index, maximum, sqrt, x, y, z

ALUMINIUM = Material("aluminium", (0.70, 0.72, 0.75), 0.35)

SIZE = 100.0                  # plate edge (the holes cover it whatever their count)
THICKNESS = 0.6
R_FIRST, R_LAST = 0.2, 0.4    # hole radius at index 0 and at the last index, in units of the pitch


def hole(pitch: float, count: int):
    """A through hole (capped cylinder on z) whose radius grows linearly with the instance index."""
    r0, r1 = R_FIRST * pitch, R_LAST * pitch
    r = r0 + (r1 - r0) / max(count - 1, 1) * instance_index
    h = THICKNESS
    return field(maximum(sqrt(x * x + y * y) - r, abs_(z) - h), bounds=((-r1, -r1, -h), (r1, r1, h)))


def build(n: int = 1000):
    """The plate minus an n x n grid of holes (n^2 hole instances plus the plate)."""
    pitch = SIZE / n
    holes = hole(pitch, n * n).grid_pattern((pitch, pitch, 1.0), (n, n, 1))
    plate = box(SIZE / 2 + pitch, SIZE / 2 + pitch, THICKNESS / 2).material(ALUMINIUM)
    return plate - holes.translate(-pitch * (n - 1) / 2, -pitch * (n - 1) / 2, 0)


scene = build()

TEST = {"size": (96, 64), "instances": 1 + 1000 * 1000}
