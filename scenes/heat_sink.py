"""A heat sink: a base plate with a linear pattern of fins, cut flat at z = 0 by a half-space
whose material ("heater") names the bottom face. Its study (``solvers.Heat``) puts a heat flux in
through the bottom face and lets the base and the fins convect. Lengths in metres.

Named parameters: base_thickness (the plate, from z = 0), fin_height (a fin's top above z = 0),
fin_half_thickness (half of a fin's thickness). The fin count is a plain integer (FIN_COUNT):
counts are not parameters. Boxes are centred on z = 0 and the half-space keeps z >= 0, so each
parameter is one box half-extent.
"""
from taperay.scenegraph import Material, Param, box, intersection, plane, union
from taperay.solvers import Heat

BASE = Material("base", (0.75, 0.76, 0.78), 0.3)
FINS = Material("fins", (0.62, 0.64, 0.70), 0.35)
HEATER = Material("heater", (0.80, 0.35, 0.20), 0.5)

FIN_COUNT = 6
width, depth = 0.06, 0.04
pitch = width / FIN_COUNT

base = box(width / 2, depth / 2, Param("base_thickness", 0.006)).material(BASE)
fin = box(Param("fin_half_thickness", 0.0015), depth / 2, Param("fin_height", 0.03))
fins = fin.translate(-width / 2 + pitch / 2, 0, 0).linear_pattern((pitch, 0, 0), FIN_COUNT).material(FINS)
scene = intersection(union(base, fins), plane((0, 0, -1), 0.0).material(HEATER))

study = Heat(conductivity=200.0,                         # W/(m K), aluminium
             heat_flux={"heater": 1.0e4},                # W/m^2 into the bottom face (24 W)
             convection={"fins": (25.0, 20.0), "base": (25.0, 20.0)})   # h W/(m^2 K), T_inf degC

TEST = {"size": (96, 64), "instances": 2 + FIN_COUNT}
