"""``python -m icr.data.synthetic.retrain NAME [--out DIR]``: train a shapes-world detector again.

Trains the detector ``NAME`` of :data:`.detector.DETECTORS` (minutes on 2 cores for ``default``),
quantises it (:func:`.extractor.quantize`, each layer's scale from its activations on the first
:data:`CALIBRATION_SCENES` training scenes), scores its heads on the held-out scenes through the
integer features, and writes ``detectors/NAME.npz`` (the package's folder unless ``--out``) with
its SHA-256, to be set in :data:`.extractor.SHA256`. Training rounds as the CPU's float kernels
do, so the file is the same only on the same kind of CPU and torch release: that is why the
benchmark ships it rather than training it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from icr.data.synthetic.detector import (
    DETECTORS,
    detector_scenes,
    head_accuracy,
    one_thread,
    train_detector,
)
from icr.data.synthetic.extractor import DETECTOR_DIR, ExactExtractor, quantize, to_bytes

CALIBRATION_SCENES = 256  # training scenes whose activations decide each layer's scale


def retrain(name: str) -> tuple[ExactExtractor, dict[str, float]]:
    """Train detector ``name`` (minutes), quantise it; returns the extractor (its heads scored on
    the held-out scenes through its integer features) and the float network's scores."""
    spec = DETECTORS[name]
    detector, float_accuracy = train_detector(spec)
    calibration = detector_scenes(min(spec.scenes, CALIBRATION_SCENES), spec.seed, 0)
    held_out = detector_scenes(spec.eval_scenes, spec.seed, 1)
    with one_thread():
        extractor = quantize(detector, calibration.pixels, calibration.boxes, name)
        features = torch.from_numpy(extractor.features(held_out.pixels, held_out.boxes))
    accuracy = head_accuracy(detector.heads, features, held_out.labels)
    trained_with = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "machine": platform.machine()}
    return dataclasses.replace(extractor, accuracy=accuracy, trained_with=trained_with), float_accuracy


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m icr.data.synthetic.retrain",
        description="Train a shapes-world detector, quantise it and write its shipped file "
                    "(then set its SHA256 entry in icr/data/synthetic/extractor.py).")
    parser.add_argument("name", choices=sorted(DETECTORS))
    parser.add_argument("--out", default=str(DETECTOR_DIR), help="folder (default: the package's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    extractor, float_accuracy = retrain(args.name)
    data = to_bytes(extractor)
    path = Path(args.out) / f"{args.name}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    rounded = {k: round(v, 3) for k, v in extractor.accuracy.items()}
    print(f"{path}: {len(data)} bytes, SHA-256 {hashlib.sha256(data).hexdigest()}\n"
          f"held-out heads, float network {({k: round(v, 3) for k, v in float_accuracy.items()})}\n"
          f"held-out heads, integer features {rounded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
