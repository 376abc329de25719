"""The Ray cluster a study runs on, and how its trials are sized for it.

A local study starts a private Ray instance (:mod:`studies.launcher`) whose every server listens
on 127.0.0.1 and wants Ray's token; ``--address auto|HOST:PORT`` joins a running cluster
instead, after checking in seconds that a Ray cluster answers there and accepts the local token
(Ray itself would retry for minutes). What this needs of Ray's internals (keeping a loopback
address as given, Ray's token setup, the address ``ray start`` records, the autoscaler's config
file) is in :mod:`studies.frameworks.ray`.

Trials are sized for the cluster a study can *reach*, not only the one it finds: a cluster run
to save money starts with a head that holds no trials and GPU worker types that the autoscaler
adds when trials ask for GPUs (``cluster.yaml``). Joining one, the study reads the autoscaler's
node types (:class:`Growth`; or ``--gpus N`` says how many GPUs the cluster can reach), and each
trial reserves a GPU, or ``1/N`` of one with ``--trials-per-gpu N``, with its share of a GPU
node's cores; as many trials run at once as the GPUs it can reach hold. A cluster with no GPU
that cannot add one runs CPU trials, and says so.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
import ray
import yaml

from icr.errors import UserError
from studies import launcher, records, signals
from studies.frameworks import ray as ray_internals
from studies.launcher import LocalInstance

JOIN_TIMEOUT_S = 5.0  # how long a cluster given with --address may take to answer
MAX_CPUS_PER_TRIAL = 8  # a trial's data loading and evaluation use no more cores than this
# NVIDIA MPS: `nvidia-cuda-mps-control -d` runs the control daemon, which writes its pid file into
# its pipe folder (CUDA_MPS_PIPE_DIRECTORY, /tmp/nvidia-mps by default) and removes it when it
# quits; its `control` socket stays behind (seen on an H200 machine's driver, 2026-11-27).
MPS_PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
MPS_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
MPS_DAEMON = "nvidia-cuda-mps-control"
MPS_PID_FILE = "nvidia-cuda-mps-control.pid"


@dataclass(frozen=True)
class NodeType:
    """A kind of worker node the cluster's autoscaler can add: its CPUs and GPUs, and how many
    of it may run at once (``None``: no limit of its own)."""

    name: str
    cpus: float
    gpus: float
    max_workers: int | None


@dataclass(frozen=True)
class Growth:
    """What a cluster can grow to, and where that was read (``source``, said at start).

    Either its autoscaler's worker node types with their limits (``max_workers``: worker
    nodes at once, all types together; ``head``: the head node type's CPUs and GPUs), or the
    GPUs the user stated (``stated_gpus``, from ``--gpus N``).
    """

    source: str
    node_types: tuple[NodeType, ...] = ()
    max_workers: int | None = None
    head: tuple[float, float] = (0.0, 0.0)
    stated_gpus: int | None = None

    def fullest(self, resource: str) -> list[tuple[NodeType, int | None]]:
        """The worker nodes that hold the most of ``resource`` ("cpus" or "gpus") within the
        limits, as (node type, count); a count of ``None`` is unlimited.

        Every node takes one of the ``max_workers`` places whatever its type, so the most is
        had by filling the places with the richest types first, each up to its own limit.
        """
        left = self.max_workers
        chosen: list[tuple[NodeType, int | None]] = []
        for kind in sorted(self.node_types, key=lambda t: -getattr(t, resource)):
            if getattr(kind, resource) <= 0 or left == 0:
                continue
            limits = [n for n in (kind.max_workers, left) if n is not None]
            count = min(limits) if limits else None
            if count == 0:
                continue
            chosen.append((kind, count))
            if left is not None and count is not None:
                left -= count
        return chosen

    def most(self, resource: str) -> float:
        """The most of ``resource`` ("cpus" or "gpus") the cluster can hold: the head's and its
        fullest workers' (:meth:`fullest`); ``math.inf`` when a node type has no limit."""
        if self.stated_gpus is not None:
            return float(self.stated_gpus) if resource == "gpus" else 0.0
        nodes = self.fullest(resource)
        if any(count is None for _, count in nodes):
            return math.inf
        head = self.head[1] if resource == "gpus" else self.head[0]
        return head + sum(getattr(kind, resource) * (count or 0) for kind, count in nodes)

    def most_workers(self) -> float:
        """The most worker nodes the autoscaler can run at once, all types together
        (``math.inf`` when neither the types nor the cluster set a limit)."""
        each = sum(math.inf if kind.max_workers is None else kind.max_workers
                   for kind in self.node_types)
        return each if self.max_workers is None else min(each, self.max_workers)

    def describe(self, resource: str) -> str:
        """The fullest workers in words, e.g. "worker_gpu4 x2, worker_gpu1 x6"."""
        return ", ".join(f"{kind.name} x{'any' if count is None else count}"
                         for kind, count in self.fullest(resource))


def growth_from_config(config: Mapping[str, Any], source: str) -> Growth:
    """The growth that a Ray cluster config (``cluster.yaml``'s format, as the autoscaler reads
    it) allows: its ``available_node_types`` other than the head's, each with its
    ``resources`` and ``max_workers`` (by default the cluster's ``max_workers``, as Ray fills
    it in), and the cluster's ``max_workers`` (Ray's default: 2)."""
    types = config.get("available_node_types") or {}
    head_name = config.get("head_node_type")
    cluster_max = config.get("max_workers", 2)
    kinds = []
    for name, spec in types.items():
        if name == head_name:
            continue
        resources = (spec or {}).get("resources") or {}
        kinds.append(NodeType(str(name), float(resources.get("CPU", 0)),
                              float(resources.get("GPU", 0)),
                              int((spec or {}).get("max_workers", cluster_max))))
    head = (types.get(head_name) or {}).get("resources") or {}
    return Growth(source, tuple(kinds), int(cluster_max),
                  (float(head.get("CPU", 0)), float(head.get("GPU", 0))))


def autoscaler_growth(gcs_address: str) -> Growth | None:
    """What the autoscaler of the cluster at ``gcs_address`` can add, read from its config file
    where it runs on this machine (:func:`studies.frameworks.ray.autoscaler_config_file`);
    ``None`` when there is none here, or when it cannot be read."""
    path = ray_internals.autoscaler_config_file(gcs_address)
    if path is None:
        return None
    try:
        config = yaml.safe_load(path.read_text())
        return growth_from_config(config, f"the autoscaler's config {path}")
    except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError):
        return None


def gpu_fraction(trials: int) -> float:
    """The GPU a trial reserves when ``trials`` share one: ``1/trials``, rounded down to Ray's
    precision of 0.0001 (rounded up, 7 trials of 0.1429 would not fit on one GPU)."""
    return 1 if trials == 1 else math.floor(10_000 / trials) / 10_000


def trials_sharing(gpu: float) -> int:
    """The trials per GPU that reserve ``gpu`` each (:func:`gpu_fraction`'s inverse): exact for
    N up to 99, where the rounded fraction still exceeds ``1/(N + 1)`` (the option stops at
    :data:`studies.plan.MAX_TRIALS_PER_GPU`)."""
    return 1 if gpu >= 1 else math.floor(1 / gpu + 1e-9)


def mps_state(environ: Mapping[str, str] = os.environ) -> str:
    """Whether NVIDIA MPS runs on this node, in words: "running (...)" or "not running".

    Read without CUDA: the control daemon's process, or its pid file in the pipe folder (a
    daemon in another container that shares the folder; one killed without quitting leaves its
    pid file too).
    """
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == MPS_DAEMON:
            return f"running (control daemon pid {proc.pid})"
    pid_file = Path(environ.get(MPS_PIPE_VARIABLE) or MPS_DEFAULT_PIPE_DIR) / MPS_PID_FILE
    if pid_file.is_file():
        return f"running (control daemon's pid file {pid_file})"
    return "not running"


@dataclass(frozen=True)
class Cluster:
    """The Ray cluster the study runs on: what it has now, and what it can grow to."""

    address: str
    dashboard_url: str | None
    cpus: int
    gpus: int
    nodes: int
    started_here: bool  # a private instance this process started (and stops)
    hosts: int | None = None  # distinct machines among the nodes (None: unknown)
    instance: LocalInstance | None = field(default=None, compare=False, repr=False)
    shapes: tuple[tuple[float, float], ...] = ()  # (CPUs, GPUs) of each node alive now
    growth: Growth | None = None  # what its autoscaler can add (or --gpus says it can reach)
    mps: str | None = None  # NVIDIA MPS on the driver's node, where that node has GPUs

    @property
    def reachable_gpus(self) -> int:
        """The most GPUs the study can use at once: ``--gpus``, else those the cluster has now
        or can grow to, whichever is more (an autoscaler without limits: those it has now)."""
        if self.growth is None:
            return self.gpus
        most = self.growth.most("gpus")
        if self.growth.stated_gpus is not None:
            return int(most)
        return self.gpus if math.isinf(most) else int(max(self.gpus, most))

    @property
    def reachable_nodes(self) -> float:
        """The most nodes the cluster can have at once: those alive now, or its head and the
        most workers its autoscaler runs (``math.inf`` without a limit), whichever is more; with
        ``--gpus N`` above the GPUs it has now, at least one more (a node does not gain GPUs:
        new nodes bring them)."""
        if self.growth is None:
            return self.nodes
        if self.growth.stated_gpus is not None:
            return self.nodes + (1 if self.growth.stated_gpus > self.gpus else 0)
        return max(self.nodes, 1 + self.growth.most_workers())

    @property
    def reachable_hosts(self) -> int | None:
        """The machines the nodes it can reach run on: one when its head is at a loopback
        address (a node elsewhere cannot join it: Ray's fake autoscaler, several nodes started
        on one machine), those of the nodes alive now when it cannot grow, else unknown."""
        parsed = host_port(self.address)
        if parsed is not None and _is_loopback(parsed[0]):
            return 1
        return self.hosts if self.reachable_nodes == self.nodes else None

    @property
    def reachable_cpus(self) -> int:
        """As :attr:`reachable_gpus`, for the CPUs of a cluster without GPUs."""
        most = self.growth.most("cpus") if self.growth is not None else 0.0
        return self.cpus if math.isinf(most) else int(max(self.cpus, most))

    def cpu_share(self, trials_per_gpu: int = 1) -> float:
        """A trial's share of a GPU node's cores: the node's CPUs over its GPUs times the trials
        per GPU, on the GPU node (alive or addable) with the fewest (so the trial fits on any),
        at most :data:`MAX_CPUS_PER_TRIAL`; whole cores from 1 up, hundredths below."""
        shapes = self._trial_nodes(gpu=True)
        if not shapes and self.gpus:
            shapes = [(self.cpus, self.gpus)]
        shares = [c / (g * trials_per_gpu) for c, g in shapes if c > 0]
        if not shares:
            return 1
        share = min(MAX_CPUS_PER_TRIAL, min(shares))
        return math.floor(share) if share >= 1 else max(0.01, math.floor(share * 100) / 100)

    def trial_resources(self, cpus_per_trial: int | None = None,
                        trials_per_gpu: int = 1) -> dict[str, float]:
        """What a trial reserves: ``1/trials_per_gpu`` of a GPU and its share of the node's
        cores (:meth:`cpu_share`) when the cluster has or can reach GPUs, else CPUs only."""
        gpu = bool(self.reachable_gpus)
        largest = max((cpus for cpus, _ in self._trial_nodes(gpu)), default=None)
        if cpus_per_trial is not None and largest is not None and cpus_per_trial > largest:
            raise UserError(f"--cpus-per-trial {cpus_per_trial}: the largest node that can hold "
                            f"a trial has {largest:g} CPUs; give at most {math.floor(largest)}")
        if gpu:
            return {"cpu": cpus_per_trial or self.cpu_share(trials_per_gpu),
                    "gpu": gpu_fraction(trials_per_gpu)}
        return {"cpu": cpus_per_trial or 1}

    def _trial_nodes(self, gpu: bool) -> list[tuple[float, float]]:
        """(CPUs, GPUs) of the nodes that can hold a trial (with a GPU when ``gpu``): those
        alive now and the types the autoscaler can add within its limits; none known with
        ``--gpus N`` before a node has started."""
        shapes = [(c, g) for c, g in self.shapes if g > 0 or not gpu]
        if self.growth is not None:
            shapes += [(t.cpus, t.gpus) for t, _ in self.growth.fullest("gpus" if gpu else "cpus")]
        return shapes

    def concurrency(self, resources: dict[str, float]) -> int:
        """Trials at a time: the GPUs the cluster can reach times the trials per GPU, or its CPU
        slots on a cluster without GPUs."""
        gpu = resources.get("gpu")
        if gpu:
            return max(1, int(self.reachable_gpus // max(gpu, 1)) * trials_sharing(gpu))
        return max(1, int(self.reachable_cpus // resources["cpu"]))

    def describe(self, resources: dict[str, float]) -> str:
        """The start line: the cluster now, what it can grow to, what a trial reserves."""
        parts = [f"Ray: {self.nodes} node(s), {self.cpus} CPUs, {self.gpus} GPUs"]
        gpu = resources.get("gpu")
        if self.growth is not None:
            parts.append(self._describe_growth("gpus" if gpu else "cpus"))
        if gpu:
            per_gpu = trials_sharing(gpu)
            share = "one GPU" if per_gpu == 1 else f"1/{per_gpu} of a GPU ({per_gpu} trials per GPU)"
            parts.append(f"{share} and {resources['cpu']:g} CPU(s) per trial")
        elif self.growth is not None and self.growth.stated_gpus is None:
            parts.append(f"no GPU in the cluster and none its autoscaler can add: CPU-only "
                         f"trials, {resources['cpu']:g} CPU(s) each")
        else:
            hint = "" if self.started_here else (
                " (no autoscaler config on this node: --gpus N sizes the study for the GPUs "
                "the cluster can add)")
            parts.append(f"no GPU in the cluster: CPU-only trials, {resources['cpu']:g} CPU(s) "
                         f"each{hint}")
        parts.append(f"{self.concurrency(resources)} trial(s) at a time")
        if gpu and self.mps is not None:
            shared = gpu < 1 and self.mps == "not running"
            parts.append(f"MPS: {self.mps}" + (
                " (the trials time-share each GPU; docs/gpu.md says how to start it)"
                if shared else ""))
        return "; ".join(parts)

    def _describe_growth(self, resource: str) -> str:
        growth = self.growth
        assert growth is not None
        if growth.stated_gpus is not None:
            if self.gpus > growth.stated_gpus:
                return f"{self.gpus} GPUs now, sized for {growth.stated_gpus} (--gpus)"
            return f"{self.gpus} of up to {self.reachable_gpus} GPUs now (--gpus {growth.stated_gpus})"
        most = growth.most(resource)
        unit, now = ("GPUs", self.gpus) if resource == "gpus" else ("CPUs", self.cpus)
        if math.isinf(most):
            return (f"autoscaling: {growth.describe(resource)} without a limit ({growth.source}); "
                    f"sized for the {now} {unit} now: --gpus N sizes it for N")
        reach = self.reachable_gpus if resource == "gpus" else self.reachable_cpus
        nodes = growth.describe(resource)
        return (f"autoscaling: {now} of up to {reach} {unit} now"
                + (f", {nodes}" if nodes else "") + f" ({growth.source})")


def connect(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    dashboard: bool = True,
    record: Path | None = None,
    reachable_gpus: int | None = None,
) -> Cluster:
    """Join the cluster at ``address`` or start a private instance on 127.0.0.1.

    ``record``: where to write the private instance's record (session folder, GCS address,
    processes) for :func:`stop_recorded_instance`; kept in the study's run folder.
    ``reachable_gpus``: the most GPUs the cluster can reach (``--gpus``), said outright instead
    of read from its autoscaler.
    """
    if ray.is_initialized():
        return _describe(ray.get_runtime_context().gcs_address, None, started=False,
                         stated_gpus=reachable_gpus)
    if address:
        return _join(address, reachable_gpus)
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
        ray_internals.send_token_if_present()
        with ray_internals.loopback_stays_loopback(), signals.handlers_kept():
            info = ray.init(address=instance.address, log_to_driver=False, configure_logging=False)
        dashboard_url = _url(info.dashboard_url)
        if record is not None:
            records.write_record(instance, record, dashboard_url)
    except BaseException:
        ray.shutdown()
        launcher.stop_instance(instance, keep_logs=True)
        raise
    return _describe(instance.address, dashboard_url, started=True, instance=instance)


def _join(address: str, stated_gpus: int | None = None) -> Cluster:
    gcs = reachable_gcs(address)
    ray_internals.send_token_if_present()
    try:
        with ray_internals.loopback_stays_loopback(), signals.handlers_kept():
            info = ray.init(address=gcs, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot join the Ray cluster at --address {address}: {reason}") from None
    return _describe(gcs, _url(info.dashboard_url), started=False, stated_gpus=stated_gpus)


def _describe(address: str, dashboard_url: str | None, *, started: bool,
              instance: LocalInstance | None = None, stated_gpus: int | None = None) -> Cluster:
    """The cluster now (``ray.nodes()``), what it can grow to (``--gpus``, else, on a cluster
    joined, its autoscaler's node types) and MPS on the driver's node where it has GPUs."""
    resources = ray.cluster_resources()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    hosts = len({(n.get("NodeManagerAddress"), n.get("NodeManagerHostname")) for n in alive})
    shapes = tuple((float(n["Resources"].get("CPU", 0)), float(n["Resources"].get("GPU", 0)))
                   for n in alive)
    if stated_gpus is not None:
        growth: Growth | None = Growth("--gpus", stated_gpus=stated_gpus)
    else:
        growth = None if started else autoscaler_growth(address)
    here = ray.get_runtime_context().get_node_id()
    own_gpus = sum(n["Resources"].get("GPU", 0) for n in alive if n["NodeID"] == here)
    return Cluster(address, dashboard_url, int(resources.get("CPU", 0)), int(resources.get("GPU", 0)),
                   len(alive), started, hosts or None, instance, shapes, growth,
                   mps_state() if own_gpus else None)


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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


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
