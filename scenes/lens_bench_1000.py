"""The optics bench (scenes/optics_bench.py: a rail with eight lens mounts, themselves a linear
pattern) copied 1,000 times as a 10 x 100 grid pattern: a pattern of patterns, two nested
REPEAT_* loops whatever the count (41,000 primitive instances, 8,000 lenses)."""
from taperay.scenes.optics_bench import scene as bench

SPACING = (10.0, 1.25, 1.0)   # the bench spans x -1..8, y -0.52..0.52: copies never overlap


def build(nx: int = 10, ny: int = 100):
    """nx x ny copies of the whole optics bench."""
    return bench.grid_pattern(SPACING, (nx, ny, 1))


scene = build()

TEST = {"size": (96, 64), "instances": 10 * 100 * (1 + 8 * 5)}
