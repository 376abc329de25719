"""Private Ray instances on this machine: ``ray start --block`` launchers and what they leave.

A local study starts a private Ray instance with ``ray start --head --block`` (multi-node tests
and benchmarks add nodes with :func:`start_node`):

- every server binds 127.0.0.1. Ray 2.60 binds each server (GCS, raylet, object manager, workers,
  dashboard agent, runtime-env agent, Ray client server, metrics exporters) to the *node IP*, and
  turns a loopback ``--node-ip-address`` into the machine's address unless told not to
  (:data:`studies.frameworks.ray.KEEP_LOOPBACK_VARIABLE`). The gRPC ports answer only with the
  token (``~/.ray/auth_token``), the dashboard's API too; three Prometheus exporters (read-only
  metrics, no token) stay, on loopback;
- every port Ray would take by default (8265, 52365, 10001, 44217, 44227, 6379) is chosen free,
  so two studies on one machine do not collide;
- its processes form a family marked by one environment variable (:mod:`studies.processes`): the
  launcher stops them on SIGTERM and gets SIGTERM when the driver dies, and a record file lets
  :func:`studies.records.stop_recorded_instance` stop exactly them after the worst crash (a
  study's marker begins with its owner id, and the temp folder holds the marker it was made
  for, :func:`made_for`: what proves them the study's own, whatever the record says).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icr.errors import UserError, message_lines
from studies import processes
from studies.frameworks import ray as ray_internals

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
TEMP_PREFIX = "icr-ray-"
INSTANCE_FILE = "icr-instance"  # in an instance's temp folder: the marker it was made for
START_TIMEOUT_S = 180.0  # `ray start` takes 10-25 s on 2 busy cores
START_ATTEMPTS = 3  # a node whose `ray start` gave up is started again (_retried)
# Ray's Unix sockets live in <temp>/session_<date>_<pid>/sockets/plasma_store and must fit the
# 107-byte limit of socket paths: the temp folder gets at most 44 characters.
MAX_TEMP_DIR = 44
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The launcher: `ray start` that, when it exits, also stops what Ray leaves of its instance
# (processes.sweep_family_at_exit). Arguments: the project root, the temp folder, then
# `ray start`'s own.
_START_SCRIPT = (
    "import os, sys\nfrom pathlib import Path\nsys.path.insert(0, sys.argv.pop(1))\n"
    "from studies.processes import MARKER, sweep_family_at_exit\n"
    "sweep_family_at_exit(os.environ[MARKER], Path(sys.argv.pop(1)))\n"
    "{before}from ray.scripts.scripts import main\nsys.argv[0] = 'ray'\nsys.exit(main())\n"
)
_HEAD_SCRIPT = _START_SCRIPT.format(before="")
_JOIN_LOOPBACK_SCRIPT = _START_SCRIPT.format(before=ray_internals.JOIN_LOOPBACK_PRELUDE)


@dataclass
class LocalInstance:
    """Ray processes started here by ``ray start --block`` (a head, or a node joining one)."""

    launcher: subprocess.Popen
    temp_dir: Path
    marker: str  # the family id every process of the instance carries (processes.MARKER)
    address: str  # the GCS address of the cluster
    ports: dict[str, int] = field(default_factory=dict)  # ports chosen here (others: see ray.nodes())
    record: Path | None = None

    @property
    def session_dir(self) -> Path:
        return (self.temp_dir / ray_internals.SESSION_LINK).resolve()


@dataclass(frozen=True)
class Autoscaling:
    """The autoscaler a head runs: ``ray start --head --autoscaling-config=config``.

    ``port``: the GCS port (an autoscaler's config may name the head's address, e.g. Ray's fake
    multi-node provider, whose nodes join it); ``env``: variables of the head's processes, the
    autoscaler's included (e.g. ``RAY_FAKE_CLUSTER=1``, ``AUTOSCALER_UPDATE_INTERVAL_S``).
    """

    config: Path
    port: int = 0
    env: Mapping[str, str] = field(default_factory=dict)


# --- private instances: `ray start --block` launchers ------------------------------------------


def start_head(
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    dashboard: bool = True,
    resources: Mapping[str, float] | None = None,
    system_config: Mapping[str, Any] | None = None,
    timeout: float = START_TIMEOUT_S,
    owner: str | None = None,
    autoscaling: Autoscaling | None = None,
) -> LocalInstance:
    """Start a head node on 127.0.0.1 with free ports and its own temp folder; wait until it runs.

    Token authentication is on (as ``ray.init`` does it) unless RAY_AUTH_MODE says otherwise.
    ``system_config``: Ray system settings (``--system-config``), e.g. faster health checks.
    ``owner``: the prefix of the instance's marker (:func:`new_marker`). ``autoscaling``: the
    head's autoscaler (its config file, GCS port and environment; tests of autoscaling). A
    ``ray start`` that gives up is tried again (:func:`_retried`).
    """
    if ray_internals.token_auth_wanted():
        ray_internals.ensure_token()
        protect_token()
    return _retried(lambda: _start_head_once(num_cpus, num_gpus, dashboard, resources,
                                             system_config, timeout, owner, autoscaling))


def new_marker(owner: str | None = None) -> str:
    """A new instance's marker: ``<owner>-<random>`` (a study's instances carry its owner id,
    :func:`studies.records.owner_of`, by which it tells its own from any other), or random."""
    return f"{owner}-{uuid.uuid4().hex}" if owner else uuid.uuid4().hex


def made_for(folder: Path, marker: str) -> bool:
    """Whether ``folder`` is a temp folder this module made for the instance ``marker``: a real
    folder (not a link) named ``icr-ray-*``, of this user, that holds the marker it was made for.
    """
    try:
        info = folder.lstat()
        return (folder.is_absolute() and folder.name.startswith(TEMP_PREFIX)
                and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
                and (folder / INSTANCE_FILE).read_text() == marker)
    except (OSError, UnicodeDecodeError):
        return False


def _retried(start_once: Callable[[], LocalInstance]) -> LocalInstance:
    """``start_once()``, again (up to START_ATTEMPTS times, each in a new temp folder) while its
    ``ray start`` exits before the node runs. On a machine starved of CPU a node can need more
    than the 30 s Ray gives its raylet to register ("The current node timed out during startup",
    a constant of Ray's node startup), or its dashboard can answer too late.
    """
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return start_once()
        except _ExitedEarly as failure:
            if attempt == START_ATTEMPTS:
                raise
            log.warning("%s; starting it again", failure)
            remove_temp_dir(failure.temp_dir)
    raise AssertionError("unreachable")  # pragma: no cover


def _start_head_once(num_cpus: int | None, num_gpus: int | None, dashboard: bool,
                     resources: Mapping[str, float] | None,
                     system_config: Mapping[str, Any] | None, timeout: float,
                     owner: str | None, autoscaling: Autoscaling | None) -> LocalInstance:
    marker = new_marker(owner)
    temp_dir = _new_temp_dir(marker)
    # Ray has no "pick a free port" for these three (the two metrics ports come from the
    # environment of the dashboard and the autoscaler monitor).
    names = ("ray_client_server", "dashboard_metrics", "autoscaler_metrics")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    port = autoscaling.port if autoscaling is not None else 0
    cmd = [sys.executable, "-c", _HEAD_SCRIPT, str(PROJECT_ROOT), str(temp_dir), "start", "--head",
           "--node-ip-address", LOOPBACK, "--port", str(port), "--dashboard-host", LOOPBACK,
           "--dashboard-port", "0", "--include-dashboard", str(dashboard).lower(),
           "--ray-client-server-port", str(ports["ray_client_server"]),
           *_node_options(temp_dir, num_cpus, num_gpus, resources)]
    if system_config:
        cmd += ["--system-config", json.dumps(dict(system_config))]
    if autoscaling is not None:
        cmd += ["--autoscaling-config", str(autoscaling.config)]
    keep_loopback, value = ray_internals.KEEP_LOOPBACK_VARIABLE
    dashboard_port, autoscaler_port = ray_internals.METRICS_PORT_VARIABLES
    env = {**_launcher_env(marker), **(autoscaling.env if autoscaling is not None else {}),
           keep_loopback: value, dashboard_port: str(ports["dashboard_metrics"]),
           autoscaler_port: str(ports["autoscaler_metrics"])}
    address_file = temp_dir / ray_internals.ADDRESS_FILE  # written by `ray start` once it runs

    def started() -> str | None:
        return address_file.read_text().strip() if address_file.is_file() else None

    launcher, address = _launch_and_wait(cmd, env, temp_dir, marker, started, timeout,
                                         "the private Ray instance")
    return LocalInstance(launcher, temp_dir, marker, address, ports)


def start_node(
    address: str,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    resources: Mapping[str, float] | None = None,
    timeout: float = START_TIMEOUT_S,
) -> LocalInstance:
    """Start another node of the cluster at ``address`` on this machine (multi-node tests).

    On a loopback head the node binds 127.0.0.1 too (its address as seen from the head). A
    ``ray start`` that gives up is tried again (:func:`_retried`).
    """
    return _retried(lambda: _start_node_once(address, num_cpus, num_gpus, resources, timeout))


def _start_node_once(address: str, num_cpus: int | None, num_gpus: int | None,
                     resources: Mapping[str, float] | None, timeout: float) -> LocalInstance:
    marker = new_marker()
    temp_dir = _new_temp_dir(marker)
    cmd = [sys.executable, "-c", _JOIN_LOOPBACK_SCRIPT, str(PROJECT_ROOT), str(temp_dir), "start",
           "--address", address,
           *_node_options(temp_dir, num_cpus, num_gpus, resources)]
    log_file = temp_dir / "ray-start.log"

    def started() -> str | None:
        if not log_file.is_file():
            return None
        return address if ray_internals.STARTED_LINE in log_file.read_text(errors="replace") else None

    launcher, _ = _launch_and_wait(cmd, _launcher_env(marker), temp_dir, marker, started, timeout,
                                   f"a Ray node joining {address}")
    return LocalInstance(launcher, temp_dir, marker, address)


def _launch_and_wait(cmd: list[str], env: dict[str, str], temp_dir: Path, marker: str,
                     started: Callable[[], str | None], timeout: float,
                     what: str) -> tuple[subprocess.Popen, str]:
    """Launch ``ray start`` and wait until it runs; on Ctrl-C (or a stop signal) meanwhile,
    stop what it started before passing the interruption on."""
    launcher = None
    try:
        with processes.stop_signals_deferred():  # a signal during the fork comes after it
            launcher = _launch(cmd, env, temp_dir)
        return launcher, _wait_started(launcher, temp_dir, marker, started, timeout, what)
    except KeyboardInterrupt:
        processes.stop_family(marker, temp_dir, first=launcher.pid if launcher else None)
        if launcher is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                launcher.wait(timeout=10)
        remove_temp_dir(temp_dir)
        raise


def _node_options(temp_dir: Path, num_cpus: int | None, num_gpus: int | None,
                  resources: Mapping[str, float] | None) -> list[str]:
    """Options of every node: no fixed port, its own temp folder, no usage stats, blocking."""
    options = ["--block", "--dashboard-agent-listen-port", "0", "--dashboard-agent-grpc-port", "0",
               "--runtime-env-agent-port", "0", "--metrics-export-port", "0",
               "--min-worker-port", "0", "--max-worker-port", "0",
               "--temp-dir", str(temp_dir), "--disable-usage-stats"]
    if num_cpus is not None:
        options += ["--num-cpus", str(num_cpus)]
    if num_gpus is not None:
        options += ["--num-gpus", str(num_gpus)]
    if resources:
        options += ["--resources", json.dumps(dict(resources))]
    return options


def _launcher_env(marker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, **ray_internals.auth_environment(), processes.MARKER: marker,
            "RAY_USAGE_STATS_ENABLED": "0"}


def _new_temp_dir(marker: str) -> Path:
    """A new temp folder (mode 0700) holding the marker of the instance it is made for."""
    root = Path(tempfile.gettempdir())
    if len(str(root)) + len(TEMP_PREFIX) + 8 > MAX_TEMP_DIR:
        root = Path("/tmp")
    folder = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=root))
    (folder / INSTANCE_FILE).write_text(marker)
    return folder


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free loopback port below the usual ephemeral range (32768-60999).

    Outgoing connections of the starting instance take ephemeral ports, so they cannot take this
    one before Ray binds it.
    """
    return free_ports(1, low, high)[0]


def free_ports(count: int, low: int = 20000, high: int = 32000) -> list[int]:
    """``count`` distinct free loopback ports (see :func:`free_port`).

    Each stays bound until all are found: probed one at a time, two could be the same port (the
    loss_search smoke once gave Ray's client server and the autoscaler's metrics both 26100, and
    the client server's exit took the instance down).
    """
    held: list[socket.socket] = []
    try:
        for _ in range(200 * count):
            if len(held) == count:
                break
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                probe.bind((LOOPBACK, random.randint(low, high)))
            except OSError:
                probe.close()
                continue
            held.append(probe)
        if len(held) < count:
            raise UserError(f"no {count} free TCP ports between {low} and {high} on {LOOPBACK}")
        return [probe.getsockname()[1] for probe in held]
    finally:
        for probe in held:
            probe.close()


def _launch(cmd: list[str], env: dict[str, str], temp_dir: Path) -> subprocess.Popen:
    """Start ``ray start --block`` in its own session (Ctrl-C reaches the driver only, which
    stops it in order); it gets SIGTERM when this thread dies."""
    with open(temp_dir / "ray-start.log", "wb") as out:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=processes.launched_child_setup)


def _wait_started(launcher: subprocess.Popen, temp_dir: Path, marker: str,
                  started: Callable[[], str | None], timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = started()
        if value:
            return value
        if launcher.poll() is not None:
            processes.stop_family(marker, temp_dir)  # what it started before it gave up
            raise _ExitedEarly(
                f"{what} did not start (`ray start` exited with {launcher.returncode}): "
                f"{_telling_line(temp_dir / 'ray-start.log')}; see {temp_dir}", temp_dir)
        time.sleep(0.2)
    launcher.terminate()
    launcher.wait()
    raise UserError(f"{what} did not start within {timeout:.0f} s; see {temp_dir / 'ray-start.log'}")


class _ExitedEarly(UserError):
    """``ray start`` exited before the instance ran; ``temp_dir`` holds its logs."""

    def __init__(self, message: str, temp_dir: Path) -> None:
        super().__init__(message)
        self.temp_dir = temp_dir


def _telling_line(path: Path) -> str:
    """The last line of a log that reports an error or a failure, else its last line."""
    lines = message_lines(path.read_text(errors="replace"))
    telling = [line for line in lines if any(w in line.lower() for w in ("error", "fail"))]
    return (telling or lines or ["no output"])[-1]


def stop_instance(instance: LocalInstance, *, keep_logs: bool = False) -> list[int]:
    """Stop the instance's processes (the launcher first), its record and (unless kept) its logs."""
    stopped = processes.stop_family(instance.marker, instance.temp_dir,
                                     first=instance.launcher.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        instance.launcher.wait(timeout=10)  # reap it
    if instance.record is not None:
        instance.record.unlink(missing_ok=True)
    if not keep_logs:
        remove_temp_dir(instance.temp_dir)
    return stopped


def remove_temp_dir(path: Path) -> None:
    if path.name.startswith(TEMP_PREFIX) and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def protect_token() -> None:
    """Ray writes the token with the default umask (0644); other users must not read it."""
    path = ray_internals.token_path()
    with contextlib.suppress(OSError):
        info = path.stat()
        if info.st_uid == os.getuid() and info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            path.chmod(0o600)
