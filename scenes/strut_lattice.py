"""A lattice of 1,029,000 struts: a 70 x 70 x 70 grid pattern of a three-strut cell (capsules
along +x, +y and +z from the cell's node), one REPEAT_GRID loop whose body is a union of three
capsules (without cull records: the flattener does not wrap groups of one or two primitives)."""
from taperay.scenegraph import Material, capsule, union

TITANIUM = Material("titanium", (0.55, 0.56, 0.60), 0.45)

PITCH = 1.0
RADIUS = 0.09


def cell():
    """The three struts leaving one lattice node."""
    return union(capsule((0, 0, 0), (PITCH, 0, 0), RADIUS), capsule((0, 0, 0), (0, PITCH, 0), RADIUS),
                 capsule((0, 0, 0), (0, 0, PITCH), RADIUS)).material(TITANIUM)


def build(n: int = 70):
    """An n x n x n lattice of cells: 3 n^3 struts."""
    return cell().grid_pattern((PITCH, PITCH, PITCH), (n, n, n))


scene = build()

TEST = {"size": (96, 64), "instances": 3 * 70 ** 3}
