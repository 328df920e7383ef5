"""solvers: the planned home of surface extraction, meshing, FEM and adjoints on tapes; empty so far."""
