"""A machined flange: a rounded base plate blended (smooth union) into a boss, a through bore, a
polar pattern of bolt holes and a linear pattern of slots. The README's showcase scene."""
import math

from taperay.scenegraph import (Material, Param, box, cylinder, extrude, rounded_box, smooth_difference,
                                smooth_union)

STEEL = Material("steel", (0.62, 0.64, 0.68), 0.35)
BRASS = Material("brass", (0.78, 0.60, 0.28), 0.3)

hole_r = Param("bolt_hole_radius", 0.09)
base = rounded_box(1.6, 1.1, 0.18, 0.08).material(STEEL)
boss = cylinder(0.55, 0.45).translate(0, 0, 0.35).material(BRASS)
body = smooth_union(base, boss, k=0.2)
bore = cylinder(0.3, 1.0)
bolt_circle = cylinder(hole_r, 1.0).translate(0.8, 0, 0).polar_pattern(8)
hexagon = [(0.12 * math.cos(a), 0.12 * math.sin(a)) for a in (i * math.pi / 3 for i in range(6))]
slots = extrude(hexagon, 1.0).translate(-1.3, -0.8, 0).linear_pattern((0, 0.4, 0), 5)
edge_notch = box(0.3, 2.0, 0.3).translate(1.75, 0, 0.2)
scene = smooth_difference(body, bore, bolt_circle, slots, edge_notch, k=0.03)

TEST = {"size": (96, 64), "instances": 1 + 1 + 1 + 8 + 5 + 1}
