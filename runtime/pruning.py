"""The twin's interval pruning, the fast path for arithmetic tapes on the CPU: its public API.

The work is done in modules of one job each, layered in this order (each imports only those
before it):

  * ``runtime.interval_kernels``: float32 interval arithmetic of every arithmetic op
    (``interval_op``) and its evaluation of a tape over boxes, in lanes;
  * ``runtime.pruner``: which tapes prune (``is_arithmetic``), their compact records, a tape's
    intervals and choices over boxes (``interval_eval``) and the backward pass that shortens it
    for one box (``prune``);
  * ``runtime.pruned_eval``: points and 2D images, each group of them on its own pruned tape
    (``evaluate_pruned``, ``sign_image``, ``field_image_pruned``);
  * ``runtime.cells``: a tape pruned for every cell of a 3D grid (``CellTapes``), the grids' cell
    boxes and ``cell_tape``;
  * ``runtime.pruned_march``: the twin's march and light pass on those cells (``march_pruned``,
    ``light_pruned``).

Every driver gives the unpruned twin's values (and images) bit for bit; tapes with ops outside
``Family.ARITH`` fall back to the unpruned twin (``march_pruned`` also takes scene fields). A
tunable constant is read where it is defined: patch it there (e.g. ``cells.LOWER_MAX_RECORDS``).
"""
from __future__ import annotations

from .cells import CellTapes, cell_tape, grid_cell_boxes, grid_ijk, sub_cell_ijk
from .interval_kernels import interval_op
from .pruned_eval import DEFAULT_TILES, PRUNE_MIN_RECORDS, evaluate_pruned, field_image_pruned, sign_image
from .pruned_march import cells_shorten, light_pruned, march_cell_tapes, march_pruned, ray_slabs
from .pruner import FIELD_OPS, compact_records, interval_eval, is_arithmetic, prune

__all__ = ["is_arithmetic", "compact_records", "light_pruned", "cell_tape", "interval_eval", "interval_op", "prune",
           "sign_image", "field_image_pruned", "evaluate_pruned", "march_pruned", "march_cell_tapes", "cells_shorten",
           "ray_slabs",
           "CellTapes", "grid_ijk", "sub_cell_ijk", "grid_cell_boxes", "DEFAULT_TILES", "PRUNE_MIN_RECORDS",
           "FIELD_OPS"]
