"""runtime: the tape format (record dtypes, the opcode table) and the walkers that run it."""
from .tape import (INSTR_DTYPE, MATERIAL_DTYPE, OPS, Family, Op, Tape, TapeError, TaperayError,
                   validate)

__all__ = ["INSTR_DTYPE", "MATERIAL_DTYPE", "OPS", "Family", "Op", "Tape", "TapeError",
           "TaperayError", "validate"]
