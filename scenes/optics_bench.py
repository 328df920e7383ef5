"""A lens-like optics bench: a rail with eight mounts; each mount holds a biconvex lens (the
intersection of two spheres and a cylinder) in a torus ring, repeated along the rail."""
from taperay.scenegraph import Material, Param, box, cylinder, intersection, sphere, torus, union

GLASS = Material("glass", (0.55, 0.75, 0.85), 0.05)
ANODISED = Material("anodised", (0.12, 0.12, 0.14), 0.5)
RAIL = Material("rail", (0.5, 0.5, 0.52), 0.4)

R = Param("lens_surface_radius", 1.2)
lens = intersection(sphere(R).translate(-1.1, 0, 0), sphere(R).translate(1.1, 0, 0),
                    cylinder(0.45, 0.5).rotate((0, 1, 0), 90)).material(GLASS)
ring = torus(0.47, 0.05).rotate((0, 1, 0), 90).material(ANODISED)
post = box(0.04, 0.04, 0.3).translate(0, 0, -0.78).material(ANODISED)
mount = union(lens, ring, post)
rail = box(4.5, 0.15, 0.06).translate(3.5, 0, -1.1).material(RAIL)
scene = union(rail, mount.linear_pattern((1.0, 0, 0), 8))

TEST = {"size": (96, 64), "instances": 1 + 8 * 5}
