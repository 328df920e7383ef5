"""scenegraph: the modelling API, scene files, importers and ``flatten(scene) -> Tape``."""
from . import fields
from .fields import field, vm_field
from .flatten import flatten, node_bounds
from .nodes import (DEFAULT_MATERIAL, Material, Node, Param, box, capped_cone, capsule, cylinder,
                    difference, ellipsoid, extrude, intersection, node_from_dict, plane, revolve,
                    rounded_box, smooth_difference, smooth_intersection, smooth_union, sphere, torus,
                    union, with_params, xor)

__all__ = ["fields", "field", "vm_field", "flatten", "node_bounds", "DEFAULT_MATERIAL", "Material", "Node", "Param", "box",
           "capped_cone", "capsule", "cylinder", "difference", "ellipsoid", "extrude",
           "intersection", "node_from_dict", "plane", "revolve", "rounded_box",
           "smooth_difference", "smooth_intersection", "smooth_union", "sphere", "torus", "union",
           "with_params", "xor"]
