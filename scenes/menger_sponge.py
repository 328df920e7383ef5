"""A Menger sponge of level 7 written as data: one arithmetic field (iq's iterated-cross
formulation: per level, fold space with mod, measure the distance to the three crossing
square bars, carve it out with max). 20^7 = 1.28e9 cubes in 30 records per level; the
tape stands for one field instance."""
from taperay.scenegraph import Material, field
from taperay.scenegraph.fields import abs_, maximum, minimum, mod, sqrt, x, y, z

CERAMIC = Material("ceramic", (0.80, 0.62, 0.45), 0.55)

LEVEL = 7


def sponge_expr(level: int = LEVEL, half: float = 1.0):
    """Distance bound of the level-``level`` sponge filling the cube [-half, half]^3."""
    px, py, pz = x / half, y / half, z / half
    qx, qy, qz = abs_(px) - 1, abs_(py) - 1, abs_(pz) - 1         # the unit cube, exact
    outside = sqrt(maximum(qx, 0) ** 2 + maximum(qy, 0) ** 2 + maximum(qz, 0) ** 2)
    d = outside + minimum(maximum(qx, maximum(qy, qz)), 0)
    s = 1.0
    for _ in range(level):           # one block of records per level (not per cube)
        ax, ay, az = mod(px * s, 2) - 1, mod(py * s, 2) - 1, mod(pz * s, 2) - 1
        s *= 3
        rx, ry, rz = abs_(1 - 3 * abs_(ax)), abs_(1 - 3 * abs_(ay)), abs_(1 - 3 * abs_(az))
        bars = minimum(maximum(rx, ry), minimum(maximum(ry, rz), maximum(rz, rx)))
        d = maximum(d, (bars - 1) / s)
    return d * half


def build(level: int = LEVEL, half: float = 1.0):
    return field(sponge_expr(level, half), bounds=((-half,) * 3, (half,) * 3), name="menger").material(CERAMIC)


scene = build()

TEST = {"size": (96, 64), "instances": 1}
