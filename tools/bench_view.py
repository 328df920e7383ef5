"""``taperay bench view``: the live viewer's edit-to-frame latency for every scene in scenes/,
through the offscreen window (the same present pipeline and panel as the desktop window):
slider moves (named-parameter writes) and topology edits (viewer.edit_script: a row of 10 to
100,000 spheres added, cut, removed), each to its presented frame, and the pipelines the edits
created (none is the rule)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .bench import BenchResult

SLIDER_MOVES = 20
TOPOLOGY_EDITS = 10
SCENES = Path(__file__).resolve().parent.parent / "scenes"


def bench_view(opts) -> BenchResult:
    from taperay.runtime.walkers import walker as choose_walker
    from .cli import parse_size
    from .view_window import offscreen_window, run_offscreen_edits
    from .viewer import Viewer
    size = parse_size(opts.size) if opts.size else ((1920, 1080) if opts.walker == "gpu" else (320, 180))
    walker = choose_walker(opts.walker)
    rows = []
    for path in sorted(p for p in SCENES.glob("*.py") if p.name != "__init__.py"):
        viewer = Viewer(path, walker=walker, size=size)
        window = offscreen_window(viewer)
        sliders = SLIDER_MOVES if viewer.params else 0
        instances = int(viewer.tape.instance_count)
        print(f"view: {path.stem}: {sliders} slider moves, {TOPOLOGY_EDITS} topology edits at {size[0]}x{size[1]}",
              flush=True)
        report = run_offscreen_edits(window, sliders, TOPOLOGY_EDITS)
        row = {"scene": path.stem, "instances": instances,
               "first frame ms": report["startup"]["first_frame_ms"]}
        for kind in ("slider", "topology"):
            edits = [r for r in report["edits"] if r["kind"] == kind]
            lat = np.array([r["latency_ms"] for r in edits]) if edits else np.array([np.nan])
            row[f"{kind} median ms"] = float(np.median(lat))
            row[f"{kind} max ms"] = float(np.max(lat))
            if kind == "slider":
                row["refit median ms"] = float(np.median([r["edit_ms"] for r in edits])) if edits else float("nan")
                row["slider frame median ms"] = (float(np.median([r["frame_ms"] for r in edits])) if edits
                                                 else float("nan"))
            if kind == "topology":
                row["flatten median ms"] = float(np.median([r["flatten_ms"] for r in edits]))
                row["topology frame median ms"] = float(np.median([r["frame_ms"] for r in edits]))
        created = sum(r["pipelines_created"] for r in report["edits"])
        # the same edits as the window draws them first (a slider dragged, a watched file's new
        # scene), from the scene as opened (the edits above leave their last scene behind)
        window = offscreen_window(Viewer(path, walker=walker, size=size))
        drafts = run_offscreen_edits(window, sliders, TOPOLOGY_EDITS, draft=True)["edits"]
        for kind in ("slider", "topology"):
            lat = [r["latency_ms"] for r in drafts if r["kind"] == kind]
            row[f"{kind} draft median ms"] = float(np.median(lat)) if lat else float("nan")
        created += sum(r["pipelines_created"] for r in drafts)
        row["pipelines created by edits"] = created
        rows.append(row)
    machine = {"gpu": walker.adapter_name} if getattr(walker, "adapter_name", None) else {}
    return BenchResult(rows, machine=machine, settings={"walker": walker.name, "size": f"{size[0]}x{size[1]}",
                                       "slider moves": SLIDER_MOVES, "topology edits": TOPOLOGY_EDITS},
                       notes=["latency: from the edit's start to the offscreen canvas returning the presented "
                              "frame (read back to the host, so an upper bound of the window's); a slider "
                              "move's latency includes its refit and upload (refit), a topology edit's its "
                              "flatten (each reported apart, with the walker's frame; the rest is the present "
                              "and read-back); scenes without named "
                              "parameters have no slider moves (nan); draft: the same edits drawn as the window "
                              "draws them first, while a slider is dragged or after a watched file's new scene "
                              "(half size each way, no shadows or AO), the full frame following once still; "
                              "the viewer's defaults: primary rays end within a pixel's footprint (hit cone)"],
                       chart=("scene", "slider median ms"))
