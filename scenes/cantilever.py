"""A cantilever: a rectangular beam along x, clamped at x = 0 (the cut plane's material "wall"),
loaded downwards on its free end (material "tip"), with a row of round lightening holes through
its web. Its study (``solvers.Elasticity``) is linear elasticity in aluminium. Lengths in metres.

Named parameters: half_height and half_width (the beam's section, half extents) and hole_radius
(the lightening holes). The hole count is a plain integer (HOLES). The load is a traction (force
per area) on the end face, so the total force follows the section: 1 MPa x the end face's area.
``taperay optimize scenes/cantilever.py --objective compliance --constraint 'mass<=initial'``
trades section against holes at fixed mass.
"""
from taperay.scenegraph import Material, Param, box, cylinder, difference, intersection, plane
from taperay.solvers import Elasticity

BEAM = Material("beam", (0.72, 0.74, 0.78), 0.35)
WALL = Material("wall", (0.45, 0.45, 0.50), 0.6)
TIP = Material("tip", (0.85, 0.40, 0.20), 0.5)

LENGTH = 0.10
HOLES = 3
pitch = LENGTH / (HOLES + 1)

beam = box(LENGTH / 2 + 0.005, Param("half_width", 0.008), Param("half_height", 0.012)).translate(LENGTH / 2, 0, 0)
holes = (cylinder(Param("hole_radius", 0.006), 0.05).rotate((1, 0, 0), 90)
         .translate(pitch, 0, 0).linear_pattern((pitch, 0, 0), HOLES))
part = difference(beam.material(BEAM), holes)
scene = intersection(part, plane((-1, 0, 0), 0.0).material(WALL), plane((1, 0, 0), LENGTH).material(TIP))

study = Elasticity(E=70.0e9, nu=0.33,                    # aluminium
                   fixed={"wall": None},                 # clamped at x = 0
                   traction={"tip": (0.0, 0.0, -1.0e6)})  # 1 MPa downwards on the end face

TEST = {"size": (96, 64), "instances": 6}
