"""solvers: surface extraction, meshing, FEM, adjoints and optimisation on tapes."""
