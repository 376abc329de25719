"""Everything about the Ray cluster: starting or joining it, resources, storage, trial labels.

Ray's startup, resource and storage APIs have changed often (REFERENCE_NOTES section 7), so they
sit here. A local study starts a private Ray instance with ``ray start --head --block``:

- every server binds 127.0.0.1. Ray 2.60 binds each server (GCS, raylet, object manager, workers,
  dashboard agent, runtime-env agent, Ray client server, metrics exporters) to the *node IP*, and
  turns a loopback ``--node-ip-address`` into the machine's address unless
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``; the launcher gets that variable. The gRPC ports
  answer only with the token (``~/.ray/auth_token``), the dashboard's API too; three Prometheus
  exporters (read-only metrics, no token) stay, on loopback;
- every port Ray would take by default (8265, 52365, 10001, 44217, 44227, 6379) is chosen free,
  so two studies on one machine do not collide;
- its processes form a family marked by one environment variable (:mod:`studies.processes`): the
  launcher stops them on SIGTERM and gets SIGTERM when the driver dies, and a record file lets
  :func:`stop_recorded_instance` stop exactly them after the worst crash.

``--address auto|HOST:PORT`` joins a running cluster instead, after checking in seconds that a
Ray cluster answers there.
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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.tune.result import AUTO_RESULT_KEYS

from icr.errors import UserError
from studies import processes

log = logging.getLogger(__name__)

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://")
# File systems that several machines can mount: a Tune storage path on one of these is shared.
SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "glusterfs", "beegfs",
             "fuse.sshfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.juicefs",
             "efs", "virtiofs", "9p")
LOOPBACK = "127.0.0.1"
TEMP_PREFIX = "icr-ray-"
JOIN_TIMEOUT_S = 5.0  # how long a cluster given with --address may take to answer
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
# `ray start --address` turns a loopback address into the machine's one (and refuses to join
# with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): a node joining a loopback head keeps it as given.
_JOIN_LOOPBACK_SCRIPT = _START_SCRIPT.format(
    before="import ray._private.services as services\n"
           "services.resolve_ip_for_localhost = lambda host: host\n")


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
        return (self.temp_dir / "session_latest").resolve()


@dataclass(frozen=True)
class Cluster:
    """The Ray cluster the study runs on."""

    address: str
    dashboard_url: str | None
    cpus: int
    gpus: int
    nodes: int
    started_here: bool  # a private instance this process started (and stops)
    hosts: int | None = None  # distinct machines among the nodes (None: unknown)
    instance: LocalInstance | None = field(default=None, compare=False, repr=False)

    def trial_resources(self, cpus_per_trial: int | None = None) -> dict[str, float]:
        """One GPU per trial when the cluster has GPUs (and its share of CPUs), else CPUs only."""
        if self.gpus:
            cpus = cpus_per_trial or max(1, min(8, self.cpus // self.gpus))
            return {"cpu": cpus, "gpu": 1}
        return {"cpu": cpus_per_trial or 1}

    def concurrency(self, resources: dict[str, float]) -> int:
        """Trials at a time: the number of GPUs, or of CPU slots on a CPU-only cluster."""
        if resources.get("gpu"):
            return max(1, int(self.gpus // resources["gpu"]))
        return max(1, int(self.cpus // resources["cpu"]))

    def describe(self, resources: dict[str, float]) -> str:
        where = f"{self.nodes} node(s), {self.cpus} CPUs, {self.gpus} GPUs"
        if resources.get("gpu"):
            per = f"one GPU and {resources['cpu']:g} CPU(s) per trial"
        else:
            per = f"no GPU in the cluster: CPU-only trials, {resources['cpu']:g} CPU(s) each"
        return f"Ray: {where}; {per}; {self.concurrency(resources)} trial(s) at a time"


def connect(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    dashboard: bool = True,
    record: Path | None = None,
) -> Cluster:
    """Join the cluster at ``address`` or start a private instance on 127.0.0.1.

    ``record``: where to write the private instance's record (session folder, GCS address,
    processes) for :func:`stop_recorded_instance`; kept in the study's run folder.
    """
    if ray.is_initialized():
        return _describe(ray.get_runtime_context().gcs_address, None, started=False)
    if address:
        return _join(address)
    return _start_private(num_cpus, num_gpus, dashboard, record)


def disconnect(cluster: Cluster, *, keep_logs: bool = False) -> None:
    """Leave the cluster; stop the private instance (a joined cluster keeps running).

    ``keep_logs`` keeps the instance's temp folder (Ray's logs, e.g. a crashed worker's stderr).
    """
    ray.shutdown()
    if cluster.instance is not None:
        stop_instance(cluster.instance, keep_logs=keep_logs)


def _start_private(num_cpus: int | None, num_gpus: int | None, dashboard: bool,
                   record: Path | None) -> Cluster:
    instance = start_head(num_cpus=num_cpus, num_gpus=num_gpus, dashboard=dashboard)
    try:
        with _loopback_stays_loopback(), processes.handlers_kept():
            info = ray.init(address=instance.address, log_to_driver=False, configure_logging=False)
        dashboard_url = _url(info.dashboard_url)
        if record is not None:
            _write_record(instance, record, dashboard_url)
    except BaseException:
        ray.shutdown()
        stop_instance(instance, keep_logs=True)
        raise
    return _describe(instance.address, dashboard_url, started=True, instance=instance)


def _join(address: str) -> Cluster:
    gcs = reachable_gcs(address)
    _use_token_if_present()
    try:
        with _loopback_stays_loopback(), processes.handlers_kept():
            info = ray.init(address=gcs, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot join the Ray cluster at --address {address}: {reason}") from None
    return _describe(gcs, _url(info.dashboard_url), started=False)


def _describe(address: str, dashboard_url: str | None, *, started: bool,
              instance: LocalInstance | None = None) -> Cluster:
    resources = ray.cluster_resources()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    hosts = len({(n.get("NodeManagerAddress"), n.get("NodeManagerHostname")) for n in alive})
    return Cluster(address, dashboard_url, int(resources.get("CPU", 0)), int(resources.get("GPU", 0)),
                   len(alive), started, hosts or None, instance)


def _url(dashboard_url: str | None) -> str | None:
    if dashboard_url and not dashboard_url.startswith("http"):
        return f"http://{dashboard_url}"
    return dashboard_url or None


# --- joining: fail in seconds when nothing answers ----------------------------------------------


def reachable_gcs(address: str, timeout: float = JOIN_TIMEOUT_S) -> str:
    """``HOST:PORT`` of the Ray cluster at ``address`` (``auto``: the one `ray start` recorded).

    Raises UserError within about ``2 * timeout`` seconds when nothing answers there, or when what
    answers is not a Ray cluster (Ray itself would retry for minutes). ``auto`` never falls back
    to "any GCS process on this machine" as Ray does: that could be another study's instance.
    """
    from ray._common.network_utils import parse_address
    from ray._private.utils import read_ray_address

    given = address
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or read_ray_address()
        if not address:
            raise UserError("--address auto: no Ray cluster was started with `ray start` on this "
                            "machine (start one with `ray start --head`, or leave out --address)")
    parsed = parse_address(address)
    if parsed is None or not str(parsed[1]).isdigit():
        raise UserError(f"--address {given}: expected auto or HOST:PORT (e.g. 10.0.0.5:6379)")
    host, port = parsed[0], int(parsed[1])
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise UserError(
            f"cannot join the Ray cluster at --address {given}: nothing answers at {host}:{port} "
            f"({exc.strerror or exc}); start it (`ray start --head`) or leave out --address"
        ) from None
    answer = _gcs_answer(host, port, timeout)
    if answer == "UNAUTHENTICATED":
        raise UserError(f"--address {given}: the cluster at {host}:{port} wants its token; copy the "
                        f"head's ~/.ray/auth_token to {_token_path()} (or set RAY_AUTH_TOKEN)")
    if answer != "OK":
        raise UserError(f"--address {given}: {host}:{port} answers but not as a Ray cluster "
                        "(give the head's GCS address, port 6379 by default)")
    return f"{host}:{port}"


def _gcs_answer(host: str, port: int, timeout: float) -> str:
    """How a Ray GCS at host:port answers a call carrying the local token: "OK", or a gRPC code
    ("UNAUTHENTICATED": a wrong or missing token; anything else: not a Ray GCS)."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return "OK"  # the plain-text probe cannot speak TLS; ray.init will tell
    import grpc

    token = _local_token()
    metadata = [("authorization", f"Bearer {token}")] if token else None
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        probe = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")
        try:
            probe(b"", timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


@contextlib.contextmanager
def _loopback_stays_loopback() -> Iterator[None]:
    """While Ray connects, keep a loopback address as given.

    ``ray.init`` replaces 127.0.0.1 by the machine's address before connecting
    (``services.resolve_ip_for_localhost``), and a loopback-only instance does not listen there.
    """
    from ray._private import services

    original = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


# --- token authentication ------------------------------------------------------------------------


def _use_token_auth() -> None:
    """Token authentication for a new instance, as ``ray.init`` does (unless RAY_AUTH_MODE says).

    Sets ``RAY_AUTH_MODE=token`` for this process and its children and creates the token
    (``~/.ray/auth_token``) if missing, readable by its owner only.
    """
    from ray._private.authentication import authentication_token_setup as auth

    if auth.enable_token_auth_by_default():
        auth.ensure_token_if_auth_enabled(None, create_token_if_missing=True)
        _protect_token()


def _use_token_if_present() -> None:
    """Send the local token when joining, also with an explicit address (Ray only does for auto)."""
    from ray._private.authentication import authentication_token_setup as auth

    auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _token_path() -> Path:
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def _local_token() -> str | None:
    """The token Ray would send (RAY_AUTH_TOKEN, else the token file), if any."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    with contextlib.suppress(OSError):
        return _token_path().read_text().strip() or None
    return None


def _protect_token() -> None:
    """Ray writes the token with the default umask (0644); other users must not read it."""
    path = _token_path()
    with contextlib.suppress(OSError):
        info = path.stat()
        if info.st_uid == os.getuid() and info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            path.chmod(0o600)


# --- private instances: `ray start --block` launchers ------------------------------------------


def start_head(
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    dashboard: bool = True,
    resources: Mapping[str, float] | None = None,
    system_config: Mapping[str, Any] | None = None,
    timeout: float = START_TIMEOUT_S,
) -> LocalInstance:
    """Start a head node on 127.0.0.1 with free ports and its own temp folder; wait until it runs.

    Token authentication is on (as ``ray.init`` does it) unless RAY_AUTH_MODE says otherwise.
    ``system_config``: Ray system settings (``--system-config``), e.g. faster health checks.
    A ``ray start`` that gives up is tried again (:func:`_retried`).
    """
    _use_token_auth()
    return _retried(lambda: _start_head_once(num_cpus, num_gpus, dashboard, resources,
                                             system_config, timeout))


def _retried(start_once: Callable[[], LocalInstance]) -> LocalInstance:
    """``start_once()``, again (up to START_ATTEMPTS times, each in a new temp folder) while its
    ``ray start`` exits before the node runs. On a machine starved of CPU a node can need more
    than the 30 s Ray gives its raylet to register ("The current node timed out during startup",
    a constant in ``ray._private.node``), or its dashboard can answer too late; both seen in CI.
    """
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return start_once()
        except _ExitedEarly as failure:
            if attempt == START_ATTEMPTS:
                raise
            log.warning("%s; starting it again", failure)
            _remove_temp_dir(failure.temp_dir)
    raise AssertionError("unreachable")  # pragma: no cover


def _start_head_once(num_cpus: int | None, num_gpus: int | None, dashboard: bool,
                     resources: Mapping[str, float] | None,
                     system_config: Mapping[str, Any] | None, timeout: float) -> LocalInstance:
    temp_dir = _new_temp_dir()
    marker = uuid.uuid4().hex
    # Ray has no "pick a free port" for these three (the two metrics ports come from the
    # environment of the dashboard and the autoscaler monitor).
    ports = {"ray_client_server": free_port(), "dashboard_metrics": free_port(),
             "autoscaler_metrics": free_port()}
    cmd = [sys.executable, "-c", _HEAD_SCRIPT, str(PROJECT_ROOT), str(temp_dir), "start", "--head",
           "--node-ip-address", LOOPBACK, "--port", "0", "--dashboard-host", LOOPBACK,
           "--dashboard-port", "0", "--include-dashboard", str(dashboard).lower(),
           "--ray-client-server-port", str(ports["ray_client_server"]),
           *_node_options(temp_dir, num_cpus, num_gpus, resources)]
    if system_config:
        cmd += ["--system-config", json.dumps(dict(system_config))]
    env = {**_launcher_env(marker), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "DASHBOARD_METRIC_PORT": str(ports["dashboard_metrics"]),
           "AUTOSCALER_METRIC_PORT": str(ports["autoscaler_metrics"])}
    address_file = temp_dir / "ray_current_cluster"  # written by `ray start` once it runs

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
    temp_dir = _new_temp_dir()
    marker = uuid.uuid4().hex
    cmd = [sys.executable, "-c", _JOIN_LOOPBACK_SCRIPT, str(PROJECT_ROOT), str(temp_dir), "start",
           "--address", address,
           *_node_options(temp_dir, num_cpus, num_gpus, resources)]
    log_file = temp_dir / "ray-start.log"

    def started() -> str | None:
        if not log_file.is_file():
            return None
        return address if "Ray runtime started" in log_file.read_text(errors="replace") else None

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
        _remove_temp_dir(temp_dir)
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
    return {**env, processes.MARKER: marker, "RAY_USAGE_STATS_ENABLED": "0"}


def _new_temp_dir() -> Path:
    root = Path(tempfile.gettempdir())
    if len(str(root)) + len(TEMP_PREFIX) + 8 > MAX_TEMP_DIR:
        root = Path("/tmp")
    return Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=root))


def free_port(low: int = 20000, high: int = 32000) -> int:
    """A free loopback port below the usual ephemeral range (32768-60999).

    Outgoing connections of the starting instance take ephemeral ports, so they cannot take this
    one before Ray binds it.
    """
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise UserError(f"no free TCP port between {low} and {high} on {LOOPBACK}")


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
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
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
        _remove_temp_dir(instance.temp_dir)
    return stopped


def _remove_temp_dir(path: Path) -> None:
    if path.name.startswith(TEMP_PREFIX) and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


# --- records: stopping what a dead driver left ---------------------------------------------------


def _write_record(instance: LocalInstance, path: Path, dashboard_url: str | None) -> None:
    """Write what identifies the instance's processes to ``path`` (JSON)."""
    instance.record = path
    members = processes.describe(processes.family(instance.marker, instance.temp_dir))
    launcher, driver = processes.describe([instance.launcher.pid, os.getpid()])
    processes.write_record(path, {
        "marker": instance.marker, "temp_dir": str(instance.temp_dir),
        "session_dir": str(instance.session_dir), "gcs_address": instance.address,
        "dashboard_url": dashboard_url, "ports": instance.ports, "launcher": launcher,
        "driver": driver, "processes": members,
    })


def stop_recorded_instance(record_path: Path, *, force: bool = False) -> list[int]:
    """Stop the Ray instance a record names (its launcher, then any process left); PIDs stopped.

    Only processes of this user that carry the instance's marker or hold a file open in its temp
    folder (or that the record lists, with their start time) are signalled, so a reused PID or
    another study's Ray is never touched. Refuses (UserError) while the driver that started it
    still runs, unless ``force``. Removes the record and the instance's temp folder.

    A record that cannot be read whole (damaged, or from another version) is used for what it
    still tells; when it tells nothing that finds processes, it is removed with a log line if no
    private Ray instance of this user runs that no live driver accounts for (so none can be its),
    else refused in one line that names the file and says when removing it is safe.
    """
    record_path = Path(record_path)
    try:
        text = record_path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UserError(f"cannot read the Ray instance record {record_path} ({exc.strerror}); "
                        "give this user access to it, or remove it") from None
    record, problem = _parse_record(text)
    driver = record.get("driver") or {}
    if (not force and _is_process(driver) and driver["pid"] != os.getpid()
            and processes.alive(driver["pid"], driver["create_time"])):
        raise UserError(f"the Ray instance in {record_path} belongs to a running driver "
                        f"(PID {driver['pid']}); stop it first: kill -INT {driver['pid']}")
    marker = record.get("marker") if isinstance(record.get("marker"), str) else None
    marker = marker or None
    temp_dir = Path(record["temp_dir"]) if isinstance(record.get("temp_dir"), str) else None
    if temp_dir is not None and not (temp_dir.is_absolute() and temp_dir.name.startswith(TEMP_PREFIX)):
        temp_dir = None  # only a folder this module makes names processes (not e.g. /tmp)
    listed = [p for p in record.get("processes") or () if _is_process(p)]
    if marker is None and temp_dir is None and not listed:
        _unusable_record(record_path, problem or "it names no process")
        return []
    launcher = record.get("launcher") or {}
    stopped = []
    if marker is not None or temp_dir is not None:
        stopped = processes.stop_family(marker, temp_dir,
                                         first=launcher.get("pid") if _is_process(launcher) else None)
    left = [p["pid"] for p in listed if processes.alive(p["pid"], p["create_time"])]
    if left:
        stopped += processes.stop_pids(left)
    if problem:
        log.warning("the Ray instance record %s was incomplete (%s); stopped what it named "
                    "(%d process(es) left by a killed driver) and removed it", record_path,
                    problem, len(stopped))
    if temp_dir is not None:
        _remove_temp_dir(temp_dir)
    record_path.unlink(missing_ok=True)
    return stopped


def _parse_record(text: str) -> tuple[dict[str, Any], str]:
    """The record as a mapping, and what is wrong with it ('' if nothing)."""
    try:
        record = json.loads(text)
    except ValueError as exc:
        return {}, f"not JSON: {exc}"
    if not isinstance(record, dict):
        return {}, "not a JSON object"
    missing = [k for k in ("marker", "temp_dir", "launcher", "driver", "processes") if k not in record]
    return record, f"no {', '.join(missing)}" if missing else ""


def _is_process(entry: Any) -> bool:
    """A record's ``{"pid": int, "create_time": float}`` entry."""
    return (isinstance(entry, dict) and isinstance(entry.get("pid"), int)
            and isinstance(entry.get("create_time"), (int, float)))


def _unusable_record(path: Path, problem: str) -> None:
    """A record that finds no process: removed if no private Ray instance of this user could be
    the one it recorded, else a UserError saying when removing it is safe."""
    running = processes.instance_markers()
    for sibling in path.parent.glob("*.ray.json"):  # instances of live drivers of other studies
        if sibling != path:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                other = json.loads(sibling.read_text())
                driver = other.get("driver") or {}
                if _is_process(driver) and processes.alive(driver["pid"], driver["create_time"]):
                    running.pop(other.get("marker"), None)
    if not running:
        log.warning("removed the unreadable Ray instance record %s (%s): no private Ray instance "
                    "of this user runs, so nothing it recorded is left", path, problem)
        path.unlink(missing_ok=True)
        return
    pids = sorted(pid for family in running.values() for pid in family)
    raise UserError(
        f"the Ray instance record {path} is unreadable ({problem}) and {len(running)} private Ray "
        f"instance(s) of this user run without a live driver here (PIDs {_shorten(pids)}): "
        f"removing the record is safe if none of them is this study's (stop it with kill "
        f"-TERM PID); rm {path}, then run the same command again")


def _shorten(pids: list[int], shown: int = 5) -> str:
    return " ".join(map(str, pids[:shown])) + (f" and {len(pids) - shown} more" if len(pids) > shown else "")


# --- what users see: dashboard, storage, trial labels -------------------------------------------


def dashboard_hint(cluster: Cluster) -> str:
    """Where the dashboard is and how to sign in (Ray 2.60 enables token authentication)."""
    if not cluster.dashboard_url:
        return "Ray dashboard: on the head node of the cluster (port 8265)"
    return (
        f"Ray dashboard: {cluster.dashboard_url} (sign in with the token printed by "
        "`.venv/bin/ray get-auth-token`)"
    )


def check_storage(storage: str, nodes: int, mounts: str | None = None,
                  hosts: int | None = None) -> None:
    """A multi-node study needs Tune storage every node can reach (Ray does not sync to the head).

    Accepts ``s3://``, ``gs://``, a path on a network file system, or any path when all nodes run
    on one machine (``hosts == 1``: they share its disk); raises UserError otherwise.
    ``mounts`` is the text of /proc/mounts (read when not given).
    """
    if nodes <= 1 or hosts == 1 or storage.startswith(REMOTE_SCHEMES):
        return
    if "://" in storage:
        raise UserError(f"--storage {storage}: only s3://, gs:// or a shared path are supported")
    fstype = filesystem_type(Path(storage), mounts)
    if fstype in SHARED_FS:
        return
    raise UserError(
        f"the cluster has {nodes} nodes but the Tune storage {storage} is on a local disk "
        f"({fstype}); pass --storage s3://BUCKET/PATH, gs://BUCKET/PATH or a path on NFS "
        "mounted on every node"
    )


def filesystem_type(path: Path, mounts: str | None = None) -> str:
    """The type of the file system holding ``path``: the longest mount point above it."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return "unknown"
    path = path.expanduser().absolute()
    best, fstype = "", "unknown"
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1]
        inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, fstype = point, parts[2]
    return fstype


def trial_label(trial_id: str, config: Mapping[str, Any]) -> str:
    """``trial <id> [<condition> key=value ...]``: how the dashboard and logs name a trial."""
    values = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in config.items() if k != "condition")
    inside = " ".join(str(part) for part in (config.get("condition"), values) if part)
    return f"trial {trial_id} [{inside}]" if inside else f"trial {trial_id}"


def labelled_trainable(fn: Callable[[dict[str, Any]], Any]) -> type:
    """The Tune trainable running ``fn`` whose actors show :func:`trial_label` as their Repr.

    Ray records ``repr(actor)`` right after an actor starts when its class defines ``__repr__``
    (the dashboard's "Repr" column, ``ray.util.state.list_actors(detail=True)[i].repr_name``,
    the prefix of the actor's log lines); Tune's function wrapper returns the function's name.
    The class keeps the function's name (the dashboard's "Class" column), so ``Tuner.restore``
    accepts it for an experiment started with ``fn`` itself. Wrap last:
    ``labelled_trainable(tune.with_resources(tune.with_parameters(fn, ...), resources))``.
    """
    from ray.tune.trainable.function_trainable import wrap_function

    base = wrap_function(fn)

    class LabelledTrial(base):  # type: ignore[misc,valid-type]
        def __repr__(self) -> str:
            return trial_label(self.trial_id, self.config)

    LabelledTrial.__name__ = LabelledTrial.__qualname__ = base._name
    return LabelledTrial


# --- checkpoints a restored trial continues from (studies.trainable) -------------------------

REPORTED = "icr_reported"  # a checkpoint's metadata key: the result the driver recorded with it
_BOOKKEEPING = {*AUTO_RESULT_KEYS, "done", "trial_id", "should_checkpoint", "experiment_tag"}


def trial_folder(experiment: str) -> str:
    """The storage folder of the trial this worker runs: Tune names a trial's folder alike in
    the experiment and in the worker's own trial directory."""
    from ray import tune

    return f"{experiment.rstrip('/')}/{Path(tune.get_context().get_trial_dir()).name}"


def mark(checkpoint: Any, result: Mapping[str, Any]) -> None:
    """Write into a persisted checkpoint the result it came with (Tune's bookkeeping left out)."""
    checkpoint.set_metadata({REPORTED: {k: v for k, v in result.items() if k not in _BOOKKEEPING}})


def unmark(checkpoint: Any) -> None:
    with contextlib.suppress(OSError):
        checkpoint.set_metadata({})


def marked_checkpoints(folder: str) -> list[tuple[Any, dict[str, Any]]]:
    """The checkpoints in a trial's folder that carry a mark, with the result each was marked
    with (a mark that cannot be read, e.g. half written, counts as none)."""
    import pyarrow.fs
    from ray import tune

    fs, path = _filesystem(folder)
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []
    found = []
    for info in infos:
        if info.type != pyarrow.fs.FileType.Directory or not info.base_name.startswith("checkpoint_"):
            continue
        checkpoint = tune.Checkpoint(info.path, filesystem=fs)
        try:
            record = checkpoint.get_metadata().get(REPORTED)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("epoch"), int | float):
            found.append((checkpoint, record))
    return found


def _filesystem(uri: str) -> tuple[Any, str]:
    import pyarrow.fs

    if "://" in uri:
        return pyarrow.fs.FileSystem.from_uri(uri)
    return pyarrow.fs.LocalFileSystem(), str(Path(uri).absolute())
