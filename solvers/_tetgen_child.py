"""The child process that runs TetGen (and pymeshfix): a self-intersecting surface can abort the
whole process inside TetGen (``malloc(): invalid size``, exit 134), so solvers.tetmesh never calls
it in its own process. Usage: ``python -m taperay.solvers._tetgen_child IN.npz OUT.npz``; IN holds
``vertices``, ``faces``, ``mode`` ("tet", "repair", or "abort": die as TetGen does, for tests) and ``options`` (JSON of TetGen switches)."""
import json
import sys

import numpy as np


def main(src: str, dst: str) -> int:
    data = np.load(src)
    v = np.ascontiguousarray(data["vertices"], np.float64)
    f = np.ascontiguousarray(data["faces"], np.int32)
    mode = str(data["mode"])
    if mode == "abort":        # what a TetGen crash looks like to the parent (its tests use it)
        import os
        os.abort()
    if mode == "repair":
        import pymeshfix
        mf = pymeshfix.MeshFix(v, f)
        mf.repair(joincomp=False, remove_smallest_components=False)
        np.savez(dst, vertices=np.asarray(mf.points, np.float64), faces=np.asarray(mf.faces, np.int64))
        return 0
    import tetgen
    opts = json.loads(str(data["options"]))
    tg = tetgen.TetGen(v, f)
    for p in opts.pop("holes", []):
        tg.add_hole(p)
    nodes, elems = tg.tetrahedralize(**opts)[:2]
    np.savez(dst, nodes=np.asarray(nodes, np.float64), elements=np.asarray(elems, np.int64))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1], sys.argv[2]))
    except Exception as e:   # a Python-level failure: one line for the parent
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(3)
