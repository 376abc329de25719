"""A trial at the papers' data scale: how long it takes to start, what memory it holds, how fast it
steps, alone and with 2 or 4 trials at once on one machine.

    python benchmarks/paper_scale.py --folder /data/coco-scale --write        # COCO's size
    python benchmarks/paper_scale.py --folder /data/coco-scale --trials 1 2 4 --steps 20
    python benchmarks/paper_scale.py --folder /tmp/scale --write --images 2000 --trials 1

``--write`` makes a SCAN/BUTD precomputed folder shaped like COCO's (random values; the real
shapes and formats, :mod:`icr.data.precomp`): ``{train,val,test}_ims.npy`` of ``(N, 36, 2048)``
float32 written chunk by chunk through a memory map (never whole in memory), the caption files
(5 captions an image, COCO's mean of 10.5 words from a 1,000-word vocabulary) and the ids files.
``--images`` training images (default and at most 113,287: COCO's Karpathy train with restval),
5,000 each for validation and test (fewer when ``--images`` is small). At full size the folder
takes 36 GB; ``--sparse`` leaves the features as holes in a sparse file instead (zeros, no disk
and seconds to write: the same shapes, pages and memory for a measurement of memory and speed).

Then, for each K of ``--trials``, K trial processes start at once, each building the trial's
task exactly as a trial does (the paper recipe of ``--recipe``, its data prepared beforehand
as the platform's driver does, here by this script) and training ``--steps`` steps on
``--device``. Each reports, and the script prints per K:

- start: seconds from its process's start to its first step (imports, data, model);
- its memory at its end, from ``/proc/<pid>/smaps_rollup``: **anonymous** memory (the heap,
  pinned buffers, the CUDA context's host side: what the trial itself holds), **file-backed**
  resident pages (the memory-mapped features and caption tables, the shared libraries: the page
  cache's, which the kernel can drop and other trials share), and the proportional set size
  (PSS: every page divided among the processes mapping it, so the PSS of all trials adds up to
  what they hold together). Linux counts a file page as private (USS, also printed) while only
  one process maps it, so USS mixes the two kinds;
- the anonymous memory at each stage of its start (imports, the CUDA context, the task built:
  data, model, inputs placed; the first batch: the epoch's plan; the steps), which says where
  it goes, and the pinned host memory torch's caching allocator holds at the end;
- steps/s over its steps after the first.

The issue's targets at full COCO size: a trial starts in at most 60 s and holds at most 4 GB of
anonymous memory; 4 trials at most 10 GB together.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

COCO_TRAIN = 113_287  # Karpathy train + restval
EVAL_IMAGES = 5_000
REGIONS, DIM = 36, 2048  # BUTD's precomputed features
WORDS, CAPTION_WORDS = 1_000, 10.5  # COCO: about 10.5 words a caption


def write_folder(folder: Path, images: int, seed: int = 0, chunk: int = 2_000,
                 sparse: bool = False) -> None:
    """The COCO-shaped precomputed folder of the module docstring."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocabulary = [f"w{i}" for i in range(WORDS)]
    evaluation = min(EVAL_IMAGES, max(images // 20, 10))
    for split, n in (("train", images), ("val", evaluation), ("test", evaluation)):
        features = np.lib.format.open_memmap(folder / f"{split}_ims.npy", mode="w+",
                                             dtype=np.float32, shape=(n, REGIONS, DIM))
        for start in range(0, 0 if sparse else n, chunk):  # sparse: the file's holes read as 0
            stop = min(start + chunk, n)
            # BUTD features are non-negative (pooled ReLU outputs), mostly small
            features[start:stop] = rng.exponential(0.5, (stop - start, REGIONS, DIM))
        features.flush()
        del features
        lengths = rng.poisson(CAPTION_WORDS - 1, 5 * n) + 1
        with (folder / f"{split}_caps.txt").open("w", encoding="utf-8") as f:
            for length in lengths:
                f.write(" ".join(rng.choice(vocabulary, length)) + "\n")
        (folder / f"{split}_ids.txt").write_text(
            "".join(f"{split}_{i:06d}.jpg\n" for i in range(n)), encoding="utf-8")
        print(f"wrote {split}: {n:,} images, {5 * n:,} captions", flush=True)


def trial_config(recipe: str, folder: Path, device: str, steps: int,
                 extra: Sequence[str] = ()) -> dict:
    """The flat config of a trial of ``study:condition``'s paper recipe on ``folder``, as
    ``--debug`` would train it (searched keys at their midpoints); ``extra``: ``KEY=VALUE``
    overrides (a test's small model)."""
    from icr.config import to_flat
    from studies.catalog import get_study
    from studies.plan import Options, StudyPlan

    study, condition = recipe.split(":")
    from icr.config import parse_overrides

    overrides = {"data.precomp_dir": str(folder), "data.relevance": "none", "eval.test": "false",
                 "train.device": device, "train.max_steps_per_epoch": str(steps),
                 **parse_overrides(list(extra))}
    plan = StudyPlan.build(get_study(study), Options(overrides=overrides, recipe="paper",
                                                    workspace=str(folder / "workspace")))
    return to_flat(plan.debug_config(condition))


def memory_kinds(rollup: str) -> dict[str, float]:
    """GB of anonymous and file-backed resident memory and the PSS, from the text of a
    ``/proc/<pid>/smaps_rollup`` (its values in kB)."""
    kb = {}
    for line in rollup.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            kb[parts[0].rstrip(":")] = int(parts[1])
    gb = {name: value / 2**20 for name, value in kb.items()}
    return {"anon_gb": gb["Anonymous"], "file_gb": gb["Rss"] - gb["Anonymous"],
            "pss_gb": gb["Pss"]}


def _anonymous_gb() -> float:
    return memory_kinds(Path("/proc/self/smaps_rollup").read_text())["anon_gb"]


def child(args: argparse.Namespace) -> None:
    """One trial: build, train ``--steps`` steps; print one JSON line."""
    import psutil
    import torch

    from icr.config import from_flat
    from icr.train.tasks import build_task
    from icr.workspace import Workspace

    me = psutil.Process()
    stages = {"imports": _anonymous_gb()}
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.ones(1, device=device).sum().item()  # the CUDA context
        stages["cuda context"] = _anonymous_gb()
    config = from_flat(trial_config(args.recipe, args.folder, args.device, args.steps, args.set))
    task = build_task(config, Workspace(args.workspace), device)
    stages["task built"] = _anonymous_gb()
    task.net.train()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    started, first = None, time.perf_counter()
    for step, batch in enumerate(task.batches(0, args.steps)):
        if step == 0:  # its inputs are ready (the epoch's plan made)
            started = time.time() - me.create_time()
            stages["first batch"] = _anonymous_gb()
        task.train_step(batch, 0, step)
        sync()
        if step == 0:
            first = time.perf_counter()
    stages["steps"] = _anonymous_gb()
    rate = (args.steps - 1) / (time.perf_counter() - first) if args.steps > 1 else float("nan")
    pinned = (torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0) / 2**30
              if device.type == "cuda" and hasattr(torch.cuda.memory, "host_memory_stats")
              else 0.0)
    print(json.dumps({"start_s": started, "uss_gb": me.memory_full_info().uss / 2**30,
                      **memory_kinds(Path("/proc/self/smaps_rollup").read_text()),
                      "stages": stages, "pinned_gb": pinned, "steps_per_s": rate,
                      "resident": task.stores["train"].resident}), flush=True)


def prepare(args: argparse.Namespace) -> float:
    """What the platform's driver does before any trial: the data prepared and cached."""
    from icr.config import from_flat
    from icr.train.tasks import prepare as prepare_task
    from icr.workspace import Workspace

    start = time.perf_counter()
    config = from_flat(trial_config(args.recipe, args.folder, args.device, args.steps, args.set))
    prepare_task(config, Workspace(args.workspace))
    return time.perf_counter() - start


def run_trials(args: argparse.Namespace, k: int) -> list[dict]:
    command = [sys.executable, __file__, "--child", "--folder", str(args.folder), "--recipe",
               args.recipe, "--device", args.device, "--steps", str(args.steps), "--workspace",
               str(args.workspace), "--set", *args.set]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(k)]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"a trial failed: {stderr.strip().splitlines()[-1:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--write", action="store_true", help="write the folder first")
    parser.add_argument("--sparse", action="store_true",
                        help="with --write: the features as a sparse file of zeros")
    parser.add_argument("--images", type=int, default=COCO_TRAIN)
    parser.add_argument("--trials", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--recipe", default="pooling_objective:max_adopt",
                        help="study:condition whose paper recipe the trials train")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workspace", type=Path, help="caches (default: <folder>/workspace)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides of the trials")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.workspace = args.workspace or args.folder / "workspace"
    if args.child:
        child(args)
        return 0
    if args.write:
        if not 0 < args.images <= COCO_TRAIN:
            parser.error(f"--images must lie in 1..{COCO_TRAIN}")
        start = time.perf_counter()
        write_folder(args.folder, args.images, sparse=args.sparse)
        print(f"folder written in {time.perf_counter() - start:.0f} s", flush=True)
    train = np.load(args.folder / "train_ims.npy", mmap_mode="r")
    print(f"{args.folder}: {len(train):,} training images x {train.shape[1:]} "
          f"({train.nbytes / 2**30:.1f} GB), recipe {args.recipe} (paper), {args.steps} steps "
          f"on {args.device}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    print(f"prepared the data (the driver's part) in {prepare(args):.1f} s", flush=True)
    for k in args.trials:
        rows = run_trials(args, k)
        anon = [r["anon_gb"] for r in rows]
        print(f"{k} trial(s) at once: start {max(r['start_s'] for r in rows):.1f} s (slowest), "
              f"anonymous memory {max(anon):.2f} GB each at most, {sum(anon):.2f} GB together; "
              f"file-backed {max(r['file_gb'] for r in rows):.2f} GB each at most; PSS "
              f"{sum(r['pss_gb'] for r in rows):.2f} GB together; private (USS) "
              f"{max(r['uss_gb'] for r in rows):.2f} GB each at most; "
              f"{np.mean([r['steps_per_s'] for r in rows]):.2f} steps/s each, training features "
              f"{'resident on ' + args.device if rows[0]['resident'] else 'read per batch'}",
              flush=True)
        stages = ", ".join(f"{name} {gb:.2f}" for name, gb in rows[0]["stages"].items())
        print(f"  anonymous GB of the first trial by stage: {stages}; pinned host memory "
              f"{rows[0]['pinned_gb']:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
