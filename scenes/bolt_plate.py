"""A patterned assembly: a plate carrying a 64 x 64 grid of hex-head bolts (4,096 instances, two
leaves each) and a ring of 36 rounded fins, all O(1) per point by domain repetition."""
import math

from taperay.scenegraph import Material, cylinder, extrude, rounded_box, union

ZINC = Material("zinc", (0.72, 0.74, 0.78), 0.4)
PLATE = Material("plate", (0.22, 0.35, 0.55), 0.6)

N = 64
pitch = 0.1
hex_head = extrude([(0.035 * math.cos(a), 0.035 * math.sin(a)) for a in (i * math.pi / 3 for i in range(6))], 0.012)
bolt = union(hex_head.translate(0, 0, 0.03), cylinder(0.018, 0.03)).material(ZINC)
grid = bolt.grid_pattern((pitch, pitch, 1.0), (N, N, 1)).translate(-pitch * (N - 1) / 2, -pitch * (N - 1) / 2, 0.05)
plate = rounded_box(3.6, 3.6, 0.05, 0.02).material(PLATE)
fin = rounded_box(0.25, 0.03, 0.15, 0.02).translate(4.0, 0, 0.1).material(PLATE)
scene = union(plate, grid, fin.polar_pattern(36))

TEST = {"size": (96, 64), "instances": 1 + 2 * N * N + 36}
