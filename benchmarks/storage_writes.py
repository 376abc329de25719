"""What writing each file whole costs: Ray's copy of a folder into Tune's storage through
pyarrow's local file system (each file written in place, as before) and through
``studies.storage.WholeFiles`` (each file under a temporary name, renamed when whole), side by
side in one run, the two alternating.

    .venv/bin/python benchmarks/storage_writes.py [--repeats 7] [--checkpoint-mb 200]

Two copies a study makes many of, with Ray's own copy function (``pyarrow.fs.copy_files``, 64 MiB
chunks, threads, as ``ray.train`` calls it):

- ``state``: Tune's saved state after each turn of its loop: a trials' state of 150 kB (what a
  2-trial search's ``experiment_state-*.json`` held in the tests), a searcher's of 2 kB and a
  few small files;
- ``checkpoint``: a trial's checkpoint, one file of ``--checkpoint-mb`` MB (VSRN's weights and
  optimizer state are of this order) and its small metadata.

Prints each copy's median wall time both ways and their ratio (WholeFiles / in place).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.fs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from studies import storage  # noqa: E402


def make_source(root: Path, kind: str, checkpoint_mb: int) -> Path:
    folder = root / f"source-{kind}"
    folder.mkdir()
    if kind == "state":
        (folder / "experiment_state-1.json").write_bytes(os.urandom(75_000).hex().encode())
        (folder / "searcher-state-1.pkl").write_bytes(os.urandom(1_000).hex().encode())
        for name in ("tuner.pkl", "search_gen_state-1.json", ".validate_storage_marker"):
            (folder / name).write_bytes(os.urandom(500))
    else:
        (folder / "model.pt").write_bytes(os.urandom(checkpoint_mb * 1_000_000))
        (folder / ".metadata.json").write_bytes(b"{}")
    return folder


def copy_seconds(source: Path, destination: Path, filesystem: pyarrow.fs.FileSystem) -> float:
    """One copy, into a folder that holds the previous copy (Ray overwrites its files)."""
    destination.mkdir(exist_ok=True)  # as Ray makes it before it copies
    start = time.perf_counter()
    pyarrow.fs.copy_files(str(source), str(destination), destination_filesystem=filesystem,
                          chunk_size=64 * 1024 * 1024)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--checkpoint-mb", type=int, default=200)
    args = parser.parse_args(argv)
    ways = {"in place": pyarrow.fs.LocalFileSystem(),
            "WholeFiles": storage.tune_storage(tempfile.gettempdir())[1]}
    root = Path(tempfile.mkdtemp(prefix="storage-writes-"))
    try:
        for kind in ("state", "checkpoint"):
            source = make_source(root, kind, args.checkpoint_mb)
            times: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.repeats):
                for way, filesystem in ways.items():
                    times[way].append(copy_seconds(source, root / f"{kind}-{way.replace(' ', '-')}", filesystem))
            median = {way: statistics.median(t) for way, t in times.items()}
            print(f"{kind:>10}: in place {median['in place'] * 1000:8.2f} ms, WholeFiles "
                  f"{median['WholeFiles'] * 1000:8.2f} ms, ratio "
                  f"{median['WholeFiles'] / median['in place']:.2f} "
                  f"(median of {args.repeats})")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
