"""The embedded benchmark: a "shapes world" written in the formats of the real datasets.

Rendered images of one to four objects (shape, colour, size, texture, position) with five true
captions each that mention different subsets of the objects and attributes, BUTD-style region
features computed from the pixels, Flickr30K Entities phrase-to-box annotations, CxC-style extended
positives decided from the scene descriptions, and the ground truth of everything in ``scenes.json``.

``python -m icr.data.synthetic --out DIR --preset {tiny,small,default} --seed N`` or::

    from icr.data.synthetic import ensure_benchmark
    root = ensure_benchmark(workspace.data / "shapes-default-0", "default", 0)
"""

from icr.data.synthetic.semantics import TruthTable, holds
from icr.data.synthetic.world import Scene
from icr.data.synthetic.writer import (
    GENERATOR_VERSION,
    PRESETS,
    Preset,
    ensure_benchmark,
    generate,
    load_scenes,
    read_manifest,
)

__all__ = [
    "GENERATOR_VERSION",
    "PRESETS",
    "Preset",
    "Scene",
    "TruthTable",
    "ensure_benchmark",
    "generate",
    "holds",
    "load_scenes",
    "read_manifest",
]
