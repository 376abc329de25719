"""Ray's internals and version conventions that the platform relies on (tested with Ray 2.60.0).

Everything about starting, joining and authenticating to a Ray cluster that Ray's public API
cannot do: keeping a loopback address as given (Ray replaces 127.0.0.1 by the machine's address,
where a loopback-only instance does not listen), the address file that ``ray start`` writes and
``--address auto`` reads, the lines and files by which a node started with ``ray start`` tells
that it runs, and where the autoscaler of a cluster keeps the node types it can add
(:func:`autoscaler_config_file`) and the nodes it is adding (:func:`pending_nodes`). Token
authentication goes through Ray's documented variable and token file (:func:`ensure_token`,
:func:`auth_environment`), but for the driver's own process (:func:`send_token_if_present`).
The modules that use them (:mod:`studies.launcher`, :mod:`studies.connection`) use Ray's public
API for the rest.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import ray

from studies.frameworks import reaching

TESTED_VERSION = "2.60.0"

# What `ray start --temp-dir T` writes once its node runs: the cluster's GCS address in
# T/ray_current_cluster (a head), the line "Ray runtime started" in its output (every node), and
# the link T/session_latest to the session's folder.
ADDRESS_FILE = "ray_current_cluster"
STARTED_LINE = "Ray runtime started"
SESSION_LINK = "session_latest"
# Each address-like option of `ray start` takes 0 for "a free port" except these three, whose
# ports Ray takes from its defaults or from the environment of the processes it starts.
METRICS_PORT_VARIABLES = ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")
# A loopback --node-ip-address stays loopback only with this (Ray 2.60 otherwise turns it into the
# machine's address on Linux); a node joining a loopback head needs the prelude below instead.
KEEP_LOOPBACK_VARIABLE = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Prepended to the script of a `ray start --address` that joins a loopback head: `ray start`
# resolves a loopback address to the machine's (and refuses to join with the variable above).
JOIN_LOOPBACK_PRELUDE = (
    "import ray._private.services as services\n"
    "services.resolve_ip_for_localhost = lambda host: host\n"
)
# The autoscaler of a cluster is the process `ray start --head --autoscaling-config=FILE` starts
# on the head: `python -u .../ray/autoscaler/_private/monitor.py --gcs-address=HOST:PORT
# --autoscaling-config=FILE ...` (autoscaler v2: .../ray/autoscaler/v2/monitor.py). Its node types
# are in FILE only: Ray 2.60 publishes them nowhere a driver can read (the GCS's "cluster config"
# key, which Ray Data reads, stays empty under both autoscalers).
MONITOR_SCRIPTS = (os.path.join("autoscaler", "_private", "monitor.py"),
                   os.path.join("autoscaler", "v2", "monitor.py"))
MONITOR_GCS_OPTION = "--gcs-address="
MONITOR_CONFIG_OPTION = "--autoscaling-config="
# Ray's token authentication (docs.ray.io, "Token authentication"): this variable's "token" or
# "disabled"; the token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else
# ~/.ray/auth_token.
AUTH_MODE_VARIABLE = "RAY_AUTH_MODE"


def _reaching(what: str) -> contextlib.AbstractContextManager[None]:
    return reaching("ray", ray.__version__, TESTED_VERSION, what)


# Ray's internals, reached once when this module is imported: one that moved is one line.
with _reaching("ray._private.services.resolve_ip_for_localhost"):
    from ray._private import services
with _reaching("ray._private.authentication.authentication_token_setup"):
    from ray._private.authentication import authentication_token_setup as auth
# What `ray status` reads: autoscaler v1 writes its report as JSON under this key of the GCS's
# key-value store; autoscaler v2 answers ray.autoscaler.v2.sdk.get_cluster_status.
with _reaching("ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS"):
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
with _reaching("ray.autoscaler.v2.sdk.get_cluster_status"):
    from ray.autoscaler.v2.sdk import get_cluster_status
    from ray.autoscaler.v2.utils import is_autoscaler_v2
with _reaching("ray.experimental.internal_kv._internal_kv_get"):
    from ray.experimental.internal_kv import _internal_kv_get


def recorded_address() -> str | None:
    """The address of the cluster that ``ray start`` last started on this machine (what Ray's
    ``address="auto"`` reads): the file :data:`ADDRESS_FILE` in Ray's default temp folder
    (``$RAY_TMPDIR/ray``, else ``$TMPDIR/ray``, else ``/tmp/ray``), or ``None``."""
    root = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return (Path(root) / "ray" / ADDRESS_FILE).read_text().strip() or None
    return None


@contextlib.contextmanager
def loopback_stays_loopback() -> Iterator[None]:
    """While Ray connects, keep a loopback address as given (``ray.init`` would replace
    127.0.0.1 by the machine's address, where a loopback-only instance does not listen)."""
    with _reaching("ray._private.services.resolve_ip_for_localhost"):
        original = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


def token_auth_wanted() -> bool:
    """Whether a new instance authenticates with a token: Ray's default for a new local cluster,
    unless :data:`AUTH_MODE_VARIABLE` says otherwise."""
    mode = os.environ.get(AUTH_MODE_VARIABLE)
    return mode is None or mode.lower() == "token"


def ensure_token() -> None:
    """Create the token file (readable by this user only, 256 random bits as Ray makes them)
    when Ray would find no token (:func:`local_token`)."""
    if local_token() is not None:
        return
    path = token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(secrets.token_hex(32))


def auth_environment() -> dict[str, str]:
    """The variables a ``ray start`` launched here needs to authenticate as Ray would on its
    own (``ray start --head`` and ``ray.init(address="auto")`` turn token authentication on
    when a token exists and :data:`AUTH_MODE_VARIABLE` is unset; a node joining with
    ``--address`` does not): that variable set to ``token`` then, else nothing."""
    if AUTH_MODE_VARIABLE not in os.environ and local_token() is not None:
        return {AUTH_MODE_VARIABLE: "token"}
    return {}


def send_token_if_present() -> None:
    """Send the local token when connecting to a cluster, also with an explicit address, as
    Ray itself does for ``auto`` only: token authentication on for this process (its cached
    configuration included) when a token exists and :data:`AUTH_MODE_VARIABLE` is unset.

    Ray's warning that token authentication is on (and how to opt out) is held back: the
    platform sends the token on purpose, and its status line says how to sign in to the
    dashboard."""
    logger = logging.getLogger(auth.__name__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with _reaching("ray._private.authentication.authentication_token_setup"):
            auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        logger.setLevel(level)


def token_path() -> Path:
    """Where Ray keeps the token (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``)."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def local_token() -> str | None:
    """The token Ray would send (``RAY_AUTH_TOKEN``, else the token file), if any."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    with contextlib.suppress(OSError):
        return token_path().read_text().strip() or None
    return None


def autoscaler_config_file(gcs_address: str) -> Path | None:
    """The config file of the autoscaler serving the cluster at ``gcs_address`` (``HOST:PORT``),
    where that autoscaler runs on this machine as this user (a driver on the head node, as
    ``ray exec cluster.yaml`` runs it); ``None`` elsewhere, or for a cluster without one.

    The autoscaler is found by its command line (:data:`MONITOR_SCRIPTS`): the one whose GCS
    address is ``gcs_address``, else, when that address is one of this machine's, the only one
    on its port (the same head seen through another of its addresses; another machine's
    cluster on the same port is not this one).
    """
    host, _, port = gcs_address.rpartition(":")
    local = _is_this_machine(host)
    exact, same_port = [], []
    for proc in psutil.process_iter():
        try:
            if proc.uids().real != os.getuid():
                continue
            args = proc.cmdline()
            if not any(a.endswith(MONITOR_SCRIPTS) for a in args[:4]):
                continue
            gcs = _option(args, MONITOR_GCS_OPTION)
            config = _option(args, MONITOR_CONFIG_OPTION)
            if gcs is None or config is None:
                continue  # an autoscaler without a config: a cluster that cannot grow
            path = Path(os.path.expanduser(config))
            path = path if path.is_absolute() else Path(proc.cwd()) / path
        except (psutil.Error, OSError):
            continue
        if gcs == gcs_address:
            exact.append(path)
        elif local and gcs.rpartition(":")[2] == port:
            same_port.append(path)
    if exact:
        return exact[0]
    return same_port[0] if len(same_port) == 1 else None


def _is_this_machine(host: str) -> bool:
    """Whether ``host`` (a name or an IP address) is one of this machine's addresses."""
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host.strip("[]")))
    except (OSError, ValueError):
        return False
    if address.is_loopback:
        return True
    return str(address) in {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}


def _option(args: list[str], prefix: str) -> str | None:
    return next((a[len(prefix):] for a in args if a.startswith(prefix)), None)


def pending_nodes() -> list[str] | None:
    """The nodes the autoscaler of the connected cluster is adding, as ``ray status`` lists
    them under "Pending" (launches requested and nodes started that have not joined): their
    node types, one entry a node. ``None`` when no autoscaler reports (a cluster that cannot
    grow) or its report cannot be read."""
    try:
        if is_autoscaler_v2():
            status = get_cluster_status(ray.get_runtime_context().gcs_address)
            return ([launch.ray_node_type_name for launch in status.pending_launches
                     for _ in range(launch.count)]
                    + [node.ray_node_type_name for node in status.pending_nodes])
        raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
    except Exception:  # noqa: BLE001 - a report the status line can do without
        return None
    if not raw:
        return None
    try:
        return pending_in_report(json.loads(raw).get("autoscaler_report") or {})
    except (ValueError, TypeError, AttributeError):
        return None


def pending_in_report(report: dict) -> list[str]:
    """The pending nodes of an autoscaler v1 report (``AutoscalerSummary`` as JSON):
    ``pending_launches`` (node type -> count) and ``pending_nodes`` ([ip, node type, status])."""
    launches = [kind for kind, count in (report.get("pending_launches") or {}).items()
                for _ in range(int(count))]
    return launches + [str(node[1]) for node in report.get("pending_nodes") or ()]
