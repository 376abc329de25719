"""Trial throughput of the real driver on simulated GPU clusters of 4 to 32 GPUs.

    .venv/bin/python benchmarks/scheduling_scale.py [--concurrency 4 8 16 32] [--epochs 15]
        [--epoch-seconds 6] [--waves 2] [--gpus-per-node 8] [--driver-lines]

For each N of ``--concurrency`` it starts a Ray cluster on 127.0.0.1 whose nodes together have N
fake GPUs (``ray start --num-gpus``: a head and at least one joining node, at most
``--gpus-per-node`` GPUs each and ``--cpus-per-gpu`` CPUs per GPU, so a trial reserves one GPU
and its share of CPUs, and the CPU reservations never hold concurrency below N). On it the real
driver runs a study: ``studies.pipeline.run_study`` joining the cluster by its address, Ray Tune
with Optuna and ASHA, the MLflow callback recording every trial and epoch in a fresh sqlite
store, Tune's storage and the report, all in a temporary workspace. The trials run the fake fit
(``FakeFit``), which keeps the contract of ``icr.train.fit``: each epoch sleeps
``--epoch-seconds`` S, then reports its metrics, trajectory rows and checkpoint. The study
searches eta in one condition with ``--waves`` x N trials of ``--epochs`` E epochs each; ASHA's
grace period is the full budget, so no trial stops early, every trial is the same work and
"trials per minute" is well defined. The winner's confirmation run and the report follow, as in
every study, outside the measurement.

Measured over the search (from the driver's line that starts it to its next phase's line), one
row per N, all in one run; the trials' times are the driver's own records in MLflow:

- ``all up s``: until N trials had started (their actors up: the driver opens a trial's run then);
- ``GPUs busy``: the trials' lives (run opened to closed) over N x the search's time;
- ``trial s``: a trial's mean life, beside the E x S it sleeps;
- ``epoch s``: the mean time between a trial's consecutive epochs as the driver recorded them,
  beside S; a trial waits for the driver to take each result before it goes on, so a driver that
  falls behind stretches every epoch;
- ``trials/min`` finished, the ideal 60 N / (E S) (N trials at once, each E x S seconds and
  nothing else) and their ratio, ``of ideal``;
- ``driver CPU``: the driver process's CPU time (``getrusage(RUSAGE_SELF)``: every thread of it,
  so Tune's loop, ASHA, Optuna, the MLflow writes, the progress lines and Ray's core worker; not
  Ray's own processes) as a share of one core, and per epoch result recorded;
- ``finished``: trials whose MLflow run is FINISHED with the full budget; ``load 1m``: the
  machine's 1-minute load average when the search ended.

What the ideal leaves out is the overhead measured: each trial's start (a Ray worker process
that imports Ray Tune, torch, the platform and the model code, 4 to 12 CPU seconds here
depending on the machine's state (``benchmarks/process_start.py``) and 0.45 GiB, then its
placement group and actor), the per-epoch report and checkpoint copy, the driver's work per
result (a trial waits for it), and the last trials' tail. The sleep stands for the GPU's work: it costs no CPU, so the
overhead is what Ray and the driver add. Why 15 epochs of 6 s: an epoch far shorter than a real
one (minutes on a GPU) sends the driver results far faster than a real cluster would (N / 6 a
second: 5 at N = 32), so the driver is tested beyond its real load; a trial of 90 s is long
enough that starting it is a small part of its life where starting is cheap, as on a cluster,
where each node starts its own trials on its own cores. Here every trial of a wave starts on
this machine's 2 cores, which takes longer the larger N (``all up s`` says how long): the
simulation charges the trials' start more than a cluster would, never less.

Target: at least 90 % of the ideal at N = 32. Other work on the machine (another study in the
background) takes CPU from the trials' starts and the driver: ``load 1m`` says how much. A
cluster that would not fit in the memory left (about 0.45 GiB a trial) is skipped with a line
that says so: the benchmark's raylets stop their workers at 92 % of the machine's memory, before
Ray's default 95 % would stop those of another study on the machine. If other work grows during
a run until they do, Tune 2.60 ends the study (it does not expect Ray's ``OutOfMemoryError``) and
the row says that it failed and why.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from studies.catalog import Study  # noqa: E402

import testfakes  # noqa: E402 - benchmarks/testfakes.py: the platform's test fakes

fakes = testfakes.load()  # tests/fakes.py: FakeFit, fake_prepare, fake_study

CONDITION = "lagrangian"  # fake_study's condition that searches objective.eta
COLUMNS = ("GPUs", "nodes", "finished", "search s", "all up s", "GPUs busy", "trial s",
           "epoch s", "trials/min", "ideal/min", "of ideal", "driver CPU", "driver ms/result",
           "load 1m")
# Memory in GiB, measured here as unique memory: a fake trial's process holds Ray and Tune
# (0.10), torch (0.25) and what the fake fit's decoder imports (0.08); a node's Ray processes
# (launcher, raylet, agents; the head's GCS too) 0.3 to 0.5; the driver grows by about 0.3.
TRIAL_GIB, NODE_GIB, DRIVER_GIB, MARGIN_GIB = 0.45, 0.4, 0.3, 0.5
# The raylets of the benchmark stop their workers when the machine's memory is this full, before
# Ray's default (0.95) would stop those of another study running on the machine.
MEMORY_THRESHOLD = 0.92


def node_gpus(gpus: int, per_node: int) -> tuple[int, ...]:
    """The fake GPUs of each node (the head first) of a cluster of ``gpus`` in all: a head and at
    least one joining node, at most ``per_node`` each, as even as possible."""
    if gpus < 2 or per_node < 1:
        raise ValueError(f"need 2 GPUs or more, at least 1 a node (not {gpus}, {per_node})")
    nodes = max(2, math.ceil(gpus / per_node))
    base, extra = divmod(gpus, nodes)
    return tuple(base + (i < extra) for i in range(nodes))


def memory_shortfall(gpus: int, nodes: int) -> str:
    """Why a cluster of ``gpus`` trials on ``nodes`` nodes would not fit in the memory left below
    :data:`MEMORY_THRESHOLD` with a margin for the rest of the machine ('' if it fits)."""
    import psutil

    memory = psutil.virtual_memory()
    need = gpus * TRIAL_GIB + nodes * NODE_GIB + DRIVER_GIB + MARGIN_GIB
    room = (MEMORY_THRESHOLD * memory.total - (memory.total - memory.available)) / 2**30
    if need <= room:
        return ""
    return (f"skipped: needs about {need:.1f} GiB of memory, {room:.1f} GiB is left below "
            f"{MEMORY_THRESHOLD:.0%} of the machine's (other work uses the rest)")


@contextlib.contextmanager
def loopback_cluster(gpus: Sequence[int], cpus_per_gpu: int) -> Iterator[str]:
    """A Ray cluster on 127.0.0.1: a head with ``gpus[0]`` fake GPUs and a node joining it for
    each further entry, ``cpus_per_gpu`` CPUs per GPU. Yields the head's address. At the end
    (also on an error or Ctrl-C) the driver leaves it (``run_study`` stays connected to a
    cluster it joined) and every node is stopped, the joining ones first."""
    import ray

    from studies import launcher

    nodes = []
    try:
        nodes.append(launcher.start_head(
            num_cpus=gpus[0] * cpus_per_gpu, num_gpus=gpus[0], dashboard=False,
            system_config={"memory_usage_threshold": MEMORY_THRESHOLD}))  # the whole cluster's
        for count in gpus[1:]:
            nodes.append(launcher.start_node(nodes[0].address, num_cpus=count * cpus_per_gpu,
                                                num_gpus=count))
        yield nodes[0].address
    finally:
        ray.shutdown()
        for node in reversed(nodes):
            launcher.stop_instance(node)


def driver_cpu_seconds() -> float:
    """User and system CPU seconds of this process (the driver), all threads, no children."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Stamp:
    """A line the driver said, and when: monotonic and epoch seconds, the driver's CPU seconds
    and the machine's 1-minute load average."""

    wall: float
    epoch: float
    cpu: float
    load: float
    line: str


@dataclass
class DriverLines:
    """The driver's ``say``: every line stamped as it comes (and printed with ``echo``)."""

    echo: bool = False
    stamps: list[Stamp] = field(default_factory=list)

    def __call__(self, line: str) -> None:
        self.stamps.append(Stamp(time.perf_counter(), time.time(), driver_cpu_seconds(),
                                 os.getloadavg()[0], line))
        if self.echo:
            print(f"    {line}", flush=True)

    def first(self, prefix: str, after: Stamp | None = None) -> Stamp:
        """The first line that starts with ``prefix`` (after the line ``after``)."""
        start = self.stamps.index(after) + 1 if after is not None else 0
        for stamp in self.stamps[start:]:
            if stamp.line.startswith(prefix):
                return stamp
        raise RuntimeError(f"the driver never said a line starting with {prefix!r}")


@dataclass(frozen=True)
class TrialRun:
    """A search trial as the driver recorded it in MLflow, in epoch seconds."""

    start: float  # its run opened: Tune reported the trial's actor up
    end: float  # its run closed: the trial ended
    recorded: tuple[float, ...]  # when each of its epoch results was recorded, in epoch order
    full: bool  # FINISHED with the full budget

    @property
    def life(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Row:
    """The search on one cluster, as measured."""

    gpus: int
    nodes: int
    trials: int
    epochs: int
    epoch_seconds: float
    start: Stamp  # the driver's line that starts the search
    end: Stamp  # its next phase's line
    runs: tuple[TrialRun, ...]

    @property
    def wall(self) -> float:
        return self.end.wall - self.start.wall

    @property
    def per_minute(self) -> float:
        return 60.0 * sum(r.full for r in self.runs) / self.wall

    @property
    def ideal_per_minute(self) -> float:
        return 60.0 * self.gpus / (self.epochs * self.epoch_seconds)

    def cells(self) -> tuple[str, ...]:
        """The row's table cells, in the order of :data:`COLUMNS`."""
        starts = sorted(r.start for r in self.runs)
        all_up = starts[self.gpus - 1] - self.start.epoch if len(starts) >= self.gpus else math.nan
        lives = sum(r.life for r in self.runs)
        gaps = [b - a for r in self.runs for a, b in zip(r.recorded, r.recorded[1:], strict=False)]
        results = sum(len(r.recorded) for r in self.runs)
        cpu = self.end.cpu - self.start.cpu
        return (str(self.gpus), str(self.nodes), f"{sum(r.full for r in self.runs)}/{self.trials}",
                f"{self.wall:.0f}", f"{all_up:.0f}",
                f"{100 * lives / (self.gpus * self.wall):.0f} %",
                f"{lives / max(1, len(self.runs)):.1f} ({self.epochs * self.epoch_seconds:g})",
                f"{sum(gaps) / len(gaps) if gaps else math.nan:.2f} ({self.epoch_seconds:g})",
                f"{self.per_minute:.1f}", f"{self.ideal_per_minute:.1f}",
                f"{100 * self.per_minute / self.ideal_per_minute:.1f} %",
                f"{100 * cpu / self.wall:.0f} %", f"{1000 * cpu / max(1, results):.0f}",
                f"{self.end.load:.1f}")


def markdown_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def scale_study(folder: Path, trials: int, epochs: int) -> Study:
    """The fake study searching eta in one condition: ``trials`` trials of ``epochs`` epochs,
    none stopped early (ASHA's grace period is the full budget), one confirmation run."""
    study = fakes.fake_study(folder, budget=trials, conditions=(CONDITION,))
    base = {**study.base, "train.warmup_epochs": 1, "train.finetune_epochs": epochs - 1}
    return replace(study, base=base, grace_period=epochs, seeds=1)


def recorded_trials(tracking_uri: str, experiment: str) -> tuple[TrialRun, ...]:
    """The search trials of the study's MLflow experiment, as the driver recorded them."""
    from studies.tracking import Tracker

    tracker = Tracker(tracking_uri, experiment)
    runs = []
    for run in tracker.find_runs("tags.phase = 'search' and tags.`icr.role` = 'trial'"):
        info, tags = run.info, run.data.tags
        epochs = sorted(tracker.client.get_metric_history(info.run_id, "epoch"),
                        key=lambda m: m.step)
        runs.append(TrialRun(info.start_time / 1000, (info.end_time or info.start_time) / 1000,
                             tuple(m.timestamp / 1000 for m in epochs),
                             info.status == "FINISHED" and tags.get("budget_complete") == "true"))
    return tuple(runs)


def measure(gpus: int, args: argparse.Namespace, root: Path) -> Row:
    """Run the study on a cluster of ``gpus`` fake GPUs; its search as a :class:`Row`."""
    from studies.pipeline import Backend, run_study
    from studies.plan import Options, StudyPlan
    from studies.progress import ProgressOptions

    layout = node_gpus(gpus, args.gpus_per_node)
    folder = root / f"{gpus}-gpus"
    folder.mkdir()
    trials = args.waves * gpus
    lines = DriverLines(echo=args.driver_lines)
    with loopback_cluster(layout, args.cpus_per_gpu) as address:
        plan = StudyPlan.build(scale_study(folder, trials, args.epochs),
                               Options(workspace=str(folder / "workspace"), address=address))
        run_study(plan, Backend(fakes.FakeFit(epoch_seconds=args.epoch_seconds), fakes.fake_prepare),
                  say=lines, progress=ProgressOptions(say=lines, bar=False))
    start = lines.first(f"search {CONDITION}: ")
    end = lines.first("confirm: ", after=start)
    return Row(gpus, len(layout), trials, args.epochs, args.epoch_seconds, start, end,
               recorded_trials(plan.tracking_uri, plan.key))


def table_row(gpus: int, args: argparse.Namespace, root: Path) -> Sequence[str]:
    """The table row of a cluster of ``gpus``: measured, or why it was not."""
    nodes = len(node_gpus(gpus, args.gpus_per_node))
    skipped = memory_shortfall(gpus, nodes)
    if skipped:
        return [str(gpus), str(nodes), skipped]
    try:
        return measure(gpus, args, root).cells()
    except RuntimeError as exc:
        if not killed_for_memory(exc):
            raise
        return [str(gpus), str(nodes), "failed: Ray stopped trials when the machine's memory "
                f"reached {MEMORY_THRESHOLD:.0%} (other work grew), and Tune ends the study then"]


def killed_for_memory(exc: BaseException) -> bool:
    """Whether Tune failed because Ray stopped a trial for memory. Tune 2.60 does not expect
    ``OutOfMemoryError`` from a trial's actor and raises RuntimeError from it, ending ``fit``."""
    from ray.exceptions import OutOfMemoryError

    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, OutOfMemoryError):
        cause = cause.__cause__
    return cause is not None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8, 16, 32],
                        help="cluster sizes in fake GPUs, i.e. trials at once (each 2 or more)")
    parser.add_argument("--epochs", type=int, default=15, help="epochs of every trial")
    parser.add_argument("--epoch-seconds", type=float, default=6.0, help="the sleep of an epoch")
    parser.add_argument("--waves", type=int, default=2, help="search trials per GPU")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--cpus-per-gpu", type=int, default=1)
    parser.add_argument("--driver-lines", action="store_true", help="print the driver's lines")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 2 or min(args.epochs, args.waves, args.gpus_per_node,
                                        args.cpus_per_gpu) < 1 or args.epoch_seconds <= 0:
        parser.error("give --concurrency of 2 or more, --epochs, --waves, --gpus-per-node and "
                     "--cpus-per-gpu of 1 or more, --epoch-seconds above 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from studies.environment import set_quiet_environment
    from studies.signals import Interrupted, StopSignals

    args = parse_args(argv)
    set_quiet_environment()  # as `python -m studies.run` does
    print(f"scheduling_scale: {args.waves} x N trials of {args.epochs} epochs x "
          f"{args.epoch_seconds:g} s (a sleep), none stopped early; at most {args.gpus_per_node} "
          f"fake GPUs a node, {args.cpus_per_gpu} CPU(s) per GPU; {os.cpu_count()} CPU cores, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start",
          flush=True)
    print(markdown_row(COLUMNS))
    print(markdown_row(["---:"] * len(COLUMNS)), flush=True)
    with StopSignals(), tempfile.TemporaryDirectory(prefix="scheduling-scale-") as tmp:
        try:
            for gpus in args.concurrency:
                print(markdown_row(table_row(gpus, args, Path(tmp))), flush=True)
        except (Interrupted, KeyboardInterrupt):
            print("interrupted: its clusters are stopped and its workspace removed",
                  file=sys.stderr)
            return 130
    print("target: at least 90 % of the ideal at 32 GPUs (the ideal: N trials at once, each "
          "E epochs x S s, nothing else)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
