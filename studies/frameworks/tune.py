"""Ray Tune's internals and version-specific conventions that the platform relies on (tested
with Ray Tune 2.60.0).

- :func:`labelled_trainable`: Tune's function-trainable class, subclassed so that the
  dashboard names each trial's actor and a trial whose saved checkpoint is gone starts without it;
- :data:`METADATA_FILE`: the file in which a checkpoint keeps its metadata (asked of
  ``Checkpoint.set_metadata``); :data:`BOOKKEEPING`: the keys Tune adds to every result (not
  metrics of the trial; Tune's documented auto-filled metrics and its own keys);
- :class:`EpochJsonLogger`, :class:`EpochCsvLogger`: Tune's result files, each epoch once (the
  CSV logger opens its file with the private ``_setup_trial``, where Tune copies it back);
- :func:`saved_by_tune`: the files in which Tune saves an experiment, and whether they are whole
  (read without executing them); :func:`newest_searcher_state`: the one a restore reads;
- :func:`trial_folder`: how Tune names a trial's folder in the experiment;
- :func:`trial_error`: where Tune writes a failed trial's error before it syncs it;
  :func:`trial_exception`: the same error as the exception the trial raised;
  :func:`raised_in_callback`: how an exception raised in a callback comes out of ``fit``;
- :func:`quiet_retried_syncs`: the logger and the text of one harmless warning of Tune's syncer;
- :func:`sigint_handler_restored`: Tune's SIGINT handler, left installed after ``fit``.
"""

from __future__ import annotations

import abc
import contextlib
import csv
import fnmatch
import json
import logging
import os
import pickle
import pickletools
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray
from ray import tune
from ray.tune.error import TuneError
from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

from studies import storage
from studies.frameworks import reaching
from studies.trials import EpochLedger

log = logging.getLogger(__name__)

TESTED_VERSION = "2.60.0"
# Set in a result that came with a checkpoint (the checkpoint's folder name).
CHECKPOINT_DIR = "checkpoint_dir_name"
RESULT_FILE, PROGRESS_FILE = "result.json", "progress.csv"  # a trial's results, as Tune logs them
SEARCHER_STATE = "searcher-state-*.pkl"  # Searcher.save_to_dir's name (ours holds JSON)
EXPERIMENT_STATE = "experiment_state-*.json"  # the trials' state (JSON)
SEARCH_GEN_STATE = "search_gen_state-*.json"  # a searcher's wrappers (a pickle)
GRID_STATE = "basic-variant-state-*.json"  # a grid's generator (a pickle)
PICKLED = pickle.PROTO  # the first byte of a pickle (protocol 2 or later, as Tune writes them)
# The logger of Tune's background copies of the experiment to its storage.
SYNCER_LOGGER = "ray.train._internal.syncer"


def _reaching(what: str) -> contextlib.AbstractContextManager[None]:
    return reaching("tune", ray.__version__, TESTED_VERSION, what)


# Tune's internals, reached once when this module is imported: one that moved is one line.
with _reaching("ray.tune.trainable.function_trainable.wrap_function"):
    from ray.tune.trainable.function_trainable import wrap_function

# The keys Tune adds to every result a trial reports: its auto-filled metrics (Tune's guide
# "Callbacks & Metrics", Trainable.get_auto_filled_metrics), the checkpoint's folder and its
# own bookkeeping. tests/test_frameworks_tune.py compares them with the installed Tune's.
BOOKKEEPING = frozenset({
    "training_iteration", "time_this_iter_s", "time_total_s", "timestamp", "date", "pid",
    "hostname", "node_ip", "config", "time_since_restore", "timesteps_since_restore",
    "iterations_since_restore", "timesteps_total", "episodes_total", CHECKPOINT_DIR,
    "done", "trial_id", "should_checkpoint", "experiment_tag"})


def _metadata_file() -> str:
    """The file in which ``Checkpoint.set_metadata`` keeps a checkpoint's metadata, found by
    asking it once in an empty folder."""
    with tempfile.TemporaryDirectory(prefix="icr-checkpoint-") as folder:
        tune.Checkpoint.from_directory(folder).set_metadata({})
        (name,) = os.listdir(folder)
    return name


METADATA_FILE = _metadata_file()


def labelled_trainable(fn: Callable[[dict[str, Any]], Any], label: Callable[[str, Any], str]) -> type:
    """The Tune trainable running ``fn`` whose actors show ``label(trial_id, config)`` as their
    Repr, and which starts without a checkpoint when the one Tune restores it from is gone.

    Ray records ``repr(actor)`` right after an actor starts when its class defines ``__repr__``
    (the dashboard's "Repr" column, ``ray.util.state.list_actors(detail=True)[i].repr_name``,
    the prefix of the actor's log lines); Tune's function wrapper returns the function's name.
    The class keeps the function's name (the dashboard's "Class" column), so ``Tuner.restore``
    accepts it for an experiment started with ``fn`` itself. Wrap last:
    ``labelled_trainable(tune.with_resources(tune.with_parameters(fn, ...), resources), label)``.

    Tune's saved state of an experiment can name a checkpoint that Tune has deleted since (it
    keeps ``num_to_keep`` and saves its state in the background): ``Trainable.restore`` then
    raises "Could not recover from checkpoint as it does not exist on storage anymore" and the
    trial fails. Here the trial starts without it (``tune.get_checkpoint()`` is ``None``) and
    ``fn`` continues from what its folder holds (:func:`studies.trainable.resume_point`).
    """
    with _reaching("ray.tune.trainable.function_trainable.wrap_function"):
        base = wrap_function(fn)
    name = getattr(fn, "__name__", "func")  # the trainable's name, as Tune names a function's

    class LabelledTrial(base):  # type: ignore[misc,valid-type]
        def __repr__(self) -> str:
            return label(self.trial_id, self.config)

        def restore(self, checkpoint_path: Any) -> None:
            checkpoint = getattr(checkpoint_path, "checkpoint", None)  # Tune's _TrainingResult
            if checkpoint is not None and not _exists(checkpoint):
                log.info("trial %s: its saved checkpoint %s is gone; it continues from its "
                         "newest checkpoint", self.trial_id, checkpoint.path)
                return
            super().restore(checkpoint_path)

    LabelledTrial.__name__ = LabelledTrial.__qualname__ = name
    return LabelledTrial


def _exists(checkpoint: tune.Checkpoint) -> bool:
    try:
        info = checkpoint.filesystem.get_file_info(checkpoint.path)
    except OSError:
        return False
    return info.type != pyarrow.fs.FileType.NotFound


class _OncePerEpoch:
    """A result-file logger of Tune that writes each epoch of a trial once
    (:class:`studies.trials.EpochLedger`).

    A restored trial reports the epoch it continues after again
    (:func:`studies.trainable.resume_point`), which the trial's file may hold already (the
    driver had logged it before it was killed): Tune's loggers would append it a second time.
    The file's last epoch is read each time Tune's logger opens the file, after Tune has
    copied it back from the storage (when its saved state gives the trial a checkpoint): a new
    driver reads what the last one left, not its own empty staging folder.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ledger = EpochLedger()  # trial id -> the last epoch in its open file

    def log_trial_start(self, trial: Any) -> None:
        self._open(trial)
        self._ledger.open(trial.trial_id, self._last_epoch(Path(trial.local_path)))

    def log_trial_result(self, iteration: int, trial: Any, result: dict) -> None:
        if not self._ledger.knows(trial.trial_id):
            self.log_trial_start(trial)
        epoch = result.get("epoch")
        if isinstance(epoch, int | float) and not self._ledger.admit(trial.trial_id, epoch):
            return
        super().log_trial_result(iteration, trial, result)

    def log_trial_end(self, trial: Any, failed: bool = False) -> None:
        super().log_trial_end(trial, failed)
        self._ledger.close(trial.trial_id)  # opened and read again if it restarts

    @abc.abstractmethod
    def _open(self, trial: Any) -> None:
        """Tune's logger opens the trial's file to append, copied back from the storage."""

    @abc.abstractmethod
    def _last_epoch(self, folder: Path) -> float:
        """The last epoch the trial's file in ``folder`` holds (-inf when none)."""


class EpochJsonLogger(_OncePerEpoch, JsonLoggerCallback):
    """Tune's ``result.json`` (what ResultGrid reads), each epoch once."""

    def _open(self, trial: Any) -> None:
        JsonLoggerCallback.log_trial_start(self, trial)

    def _last_epoch(self, folder: Path) -> float:
        return stored_last_epoch(str(folder))


def last_epoch_of(result_json: str) -> float:
    """The last epoch of the rows of a trial's ``result.json`` (-inf when none: a row cut short
    by a kill is skipped)."""
    last = float("-inf")
    for line in result_json.splitlines():
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            last = max(last, float(json.loads(line).get("epoch")))
    return last


def stored_last_epoch(trial_folder: str) -> float:
    """The last epoch of the ``result.json`` of a trial's folder in the storage (a path or a
    URI, read through its file system); -inf when it has none or cannot be read."""
    fs, path = storage.filesystem(storage.join(trial_folder, RESULT_FILE))
    try:
        with fs.open_input_stream(path) as stream:
            return last_epoch_of(stream.read().decode("utf-8", errors="replace"))
    except OSError:
        return float("-inf")


class EpochCsvLogger(_OncePerEpoch, CSVLoggerCallback):
    """Tune's ``progress.csv``, each epoch once."""

    def _open(self, trial: Any) -> None:
        self._setup_trial(trial)  # Tune opens it only here (its log_trial_start does nothing)

    def _last_epoch(self, folder: Path) -> float:
        last = float("-inf")
        with contextlib.suppress(OSError), open(folder / PROGRESS_FILE, newline="") as f:
            for row in csv.DictReader(f):
                with contextlib.suppress(ValueError, TypeError):
                    last = max(last, float(row.get("epoch")))
        return last


def saved_by_tune(experiment: str | os.PathLike) -> bool:
    """Whether Tune saved ``experiment`` (a folder or a URI: read through its file system,
    :mod:`studies.storage`) whole, so that ``Tuner.restore`` continues it: the newest file of
    each of its state files (what a restore reads) is there and was written whole.

    ``Tuner.can_restore`` asks only for ``tuner.pkl``, which the Tuner writes when it is built,
    before ``fit`` saves anything, and which holds no ``param_space``. A driver killed in that
    window leaves an experiment that "restores" as a new one without the param_space. Tune
    writes the trials' state first (``experiment_state-*``) and the search algorithm's next:
    a searcher's ``searcher-state-*`` and its wrappers' ``search_gen_state-*`` (both), or a
    grid's ``basic-variant-state-*``.

    A driver killed while Ray copies those files from its staging folder to the storage leaves
    a file cut short or not copied yet (the copies run in parallel, and the trials' state is
    rewritten in place at every turn of Tune's loop, ``TUNE_GLOBAL_CHECKPOINT_S=0``). Tune
    2.60's restore then fails wherever it meets it, logs "Failed to restore the run state" and
    "Restarting experiment", and goes on as a new experiment from the state it had restored
    so far: one of ``num_samples=1`` (``tune.run``'s default: a restored Tuner passes none),
    so that ``fit`` returns one new trial where the search planned ``budget``; or, after it
    restored the concurrency limiter, one that waits for ever for the trials the limiter still
    counts as live. Such an experiment is not saved whole either.
    """
    files = storage.names(experiment)
    searcher = [_newest(files, SEARCH_GEN_STATE), _newest(files, SEARCHER_STATE)]
    search = searcher if any(searcher) else [_newest(files, GRID_STATE)]
    read = [_newest(files, EXPERIMENT_STATE), *search]
    return all(read) and all(_whole(storage.join(experiment, name)) for name in read)


def _newest(files: list[str], pattern: str) -> str | None:
    """The file that Tune's restore reads of those named ``pattern``: the last by name (each
    name ends with the time its driver started)."""
    return max(fnmatch.filter(files, pattern), default=None)


def newest_searcher_state(experiment: str | os.PathLike) -> str | None:
    """Where the searcher state is that ``Tuner.restore`` hands to the searcher (the newest by
    name), in ``experiment`` (a folder or a URI)."""
    newest = _newest(storage.names(experiment), SEARCHER_STATE)
    return None if newest is None else storage.join(experiment, newest)


def _whole(state: str) -> bool:
    """Whether a state file was written whole, read without executing anything: JSON (the
    trials' state, the searcher's) parses, and a pickle of Tune's runs to its STOP
    (``pickletools`` reads the opcodes; ``pickle.load`` would run whatever the file asks, and
    the storage may be a shared bucket).
    """
    try:
        data = storage.read_bytes(state)
        if not data.startswith(PICKLED):  # the trials' state, the searcher's (studies.searcher)
            json.loads(data)
            return True
        return any(op.name == "STOP" for op, _, _ in pickletools.genops(data))
    except (OSError, ValueError):  # cut short: a pickle without its STOP, JSON cut anywhere
        return False


def trial_folder(experiment: str) -> str:
    """The storage folder of the trial this worker runs: Tune names a trial's folder alike in
    the experiment and in the worker's own trial directory."""
    return storage.join(experiment, Path(tune.get_context().get_trial_dir()).name)


def trial_error(trial: Any) -> str | None:
    """The text of a failed trial's errors, read where Tune wrote it.

    Tune writes a trial's error file into the driver's staging folder (``trial.error_file``) and
    copies it to the storage in the background; ``Trial.get_error`` reads the storage copy, which
    a callback called right after the failure may not find yet (on a loaded machine, often).
    """
    path = getattr(trial, "error_file", None)
    if path and Path(path).is_file():
        return Path(path).read_text()
    return trial.get_error()


def trial_exception(trial: Any) -> BaseException | None:
    """The error that ended a trial's last try, as the exception Tune caught (a ``RayTaskError``
    whose ``cause`` is the trial's own exception), read from the pickle Tune writes beside the
    error file in the driver's staging folder (``None`` when there is none, e.g. a lost actor).
    The driver reads back what it wrote itself, never a file from the shared storage."""
    path = getattr(trial, "pickled_error_file", None)
    if not path or not Path(path).is_file():
        return None
    try:
        with open(path, "rb") as f:
            error = pickle.load(f)  # cloudpickle's output (Trial.handle_error), a plain pickle
    except Exception:  # noqa: BLE001 - a class that no longer unpickles: no exception to read
        return None
    return error if isinstance(error, BaseException) else None


def raised_in_callback(error: BaseException) -> BaseException | None:
    """The exception a Tune callback raised while the Tuner handled a trial's result or
    failure: Tune 2.60 raises ``TuneError(traceback text)`` out of ``fit`` in its place, with
    the callback's exception as its context. ``None`` for any other error."""
    if isinstance(error, TuneError) and isinstance(error.__context__, Exception):
        return error.__context__
    return None


@contextlib.contextmanager
def sigint_handler_restored(on_sigint: Callable[[], None]) -> Iterator[None]:
    """Run a Tuner's ``fit``, then put back the SIGINT handler it found; ``on_sigint()`` when
    Tune's own handler took a SIGINT meanwhile.

    Tune 2.60 installs its SIGINT handler when ``fit`` starts (unless TUNE_DISABLE_SIGINT_HANDLER
    is set, or outside the main thread) and leaves it installed when ``fit`` returns: a Ctrl-C
    after that (while the next phase starts, or the report is written) would go to the finished
    run's handler, which stops nothing. On a SIGINT that handler puts back the handler it
    found: finding it back means a SIGINT came.
    """
    before = signal.getsignal(signal.SIGINT)
    installs = (not int(os.environ.get("TUNE_DISABLE_SIGINT_HANDLER", "0"))
                and threading.current_thread() is threading.main_thread())
    try:
        yield
    finally:
        if installs and signal.getsignal(signal.SIGINT) is before:
            on_sigint()
        signal.signal(signal.SIGINT, before)


class RetriedSyncFilter(logging.Filter):
    """Drops Tune's traceback for a background state copy that met a file being rewritten.

    Ray copies Tune's staging folder to the storage in the background while Tune keeps saving its
    state there, each file an atomic write through a ``tmp-`` file. A copy that lists such a file
    before its rename fails with FileNotFoundError; Ray logs a warning with the traceback, and the
    next save copies the folder again (the last copy, at the end of ``fit``, is waited for). That
    one case is logged at debug level; every other message of Ray's syncer passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (message.startswith("Last sync command failed") and "FileNotFoundError" in message
                and "tmp-" in message):
            logging.getLogger(__name__).debug(
                "Tune's background copy met a state file being rewritten; it copies again")
            return False
        return True


def quiet_retried_syncs() -> None:
    """Install :class:`RetriedSyncFilter` on Tune's syncer logger (once)."""
    syncer = logging.getLogger(SYNCER_LOGGER)
    if not any(isinstance(f, RetriedSyncFilter) for f in syncer.filters):
        syncer.addFilter(RetriedSyncFilter())
