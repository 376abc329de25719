"""The Ray cluster a study runs on: a private instance started here, or a cluster joined.

A local study starts a private Ray instance (:mod:`studies.launcher`) whose every server listens
on 127.0.0.1 and wants Ray's token; ``--address auto|HOST:PORT`` joins a running cluster
instead, after checking in seconds that a Ray cluster answers there and accepts the local token
(Ray itself would retry for minutes). What this needs of Ray's internals (keeping a loopback
address as given, Ray's token setup, the address ``ray start`` records) is in
:mod:`studies.frameworks.ray`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import ray

from icr.errors import UserError
from studies import launcher, processes, records
from studies.frameworks import ray as ray_internals
from studies.launcher import LocalInstance

JOIN_TIMEOUT_S = 5.0  # how long a cluster given with --address may take to answer


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
        launcher.stop_instance(cluster.instance, keep_logs=keep_logs)


def _start_private(num_cpus: int | None, num_gpus: int | None, dashboard: bool,
                   record: Path | None) -> Cluster:
    owner = records.owner_of(record) if record is not None else None
    instance = launcher.start_head(num_cpus=num_cpus, num_gpus=num_gpus, dashboard=dashboard,
                                   owner=owner)
    try:
        with ray_internals.loopback_stays_loopback(), processes.handlers_kept():
            info = ray.init(address=instance.address, log_to_driver=False, configure_logging=False)
        dashboard_url = _url(info.dashboard_url)
        if record is not None:
            records.write_record(instance, record, dashboard_url)
    except BaseException:
        ray.shutdown()
        launcher.stop_instance(instance, keep_logs=True)
        raise
    return _describe(instance.address, dashboard_url, started=True, instance=instance)


def _join(address: str) -> Cluster:
    gcs = reachable_gcs(address)
    ray_internals.send_token_if_present()
    try:
        with ray_internals.loopback_stays_loopback(), processes.handlers_kept():
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
    given = address
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or ray_internals.recorded_address()
        if not address:
            raise UserError("--address auto: no Ray cluster was started with `ray start` on this "
                            "machine (start one with `ray start --head`, or leave out --address)")
    parsed = host_port(address)
    if parsed is None:
        raise UserError(f"--address {given}: expected auto or HOST:PORT (e.g. 10.0.0.5:6379)")
    host, port = parsed
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
                        f"head's ~/.ray/auth_token to {ray_internals.token_path()} (or set "
                        "RAY_AUTH_TOKEN)")
    if answer != "OK":
        raise UserError(f"--address {given}: {host}:{port} answers but not as a Ray cluster "
                        "(give the head's GCS address, port 6379 by default)")
    return f"{host}:{port}"


def host_port(address: str) -> tuple[str, int] | None:
    """``HOST:PORT`` or ``[IPv6]:PORT`` as (host, port); ``None`` when not of that form."""
    host, colon, port = address.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit():
        return None
    return host, int(port)


def _gcs_answer(host: str, port: int, timeout: float) -> str:
    """How a Ray GCS at host:port answers a call carrying the local token: "OK", or a gRPC code
    ("UNAUTHENTICATED": a wrong or missing token; anything else: not a Ray GCS)."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return "OK"  # the plain-text probe cannot speak TLS; ray.init will tell

    token = ray_internals.local_token()
    metadata = [("authorization", f"Bearer {token}")] if token else None
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        probe = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")
        try:
            probe(b"", timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def dashboard_hint(cluster: Cluster) -> str:
    """Where the dashboard is and how to sign in (Ray 2.60 enables token authentication)."""
    if not cluster.dashboard_url:
        return "Ray dashboard: on the head node of the cluster (port 8265)"
    return (
        f"Ray dashboard: {cluster.dashboard_url} (sign in with the token printed by "
        "`.venv/bin/ray get-auth-token`)"
    )
