"""Everything about the Ray cluster: starting or joining it, resources, storage checks.

Ray's startup, resource and storage APIs have changed often (REFERENCE_NOTES section 7), so they
sit here. A local study starts a private Ray instance whose processes all listen on 127.0.0.1
(with the dashboard); ``--address auto|HOST:PORT`` joins a running cluster instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import ray

from icr.errors import UserError

log = logging.getLogger(__name__)

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://")
# File systems that several machines can mount: a Tune storage path on one of these is shared.
SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "glusterfs", "beegfs",
             "fuse.sshfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.juicefs",
             "efs", "virtiofs", "9p")


@dataclass(frozen=True)
class Cluster:
    """The Ray cluster the study runs on."""

    address: str
    dashboard_url: str | None
    cpus: int
    gpus: int
    nodes: int
    started_here: bool  # a private instance this process started (and stops)

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
) -> Cluster:
    """Join the cluster at ``address`` or start a private instance on 127.0.0.1."""
    started = False
    if ray.is_initialized():
        context = ray.get_runtime_context()
        gcs = context.gcs_address
        dashboard_url = None
    elif address:
        try:
            info = ray.init(address=address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(f"cannot join the Ray cluster at --address {address}: {exc}") from None
        gcs = info.address_info.get("gcs_address", address)
        dashboard_url = info.dashboard_url or None
    else:
        # A private instance: every Ray process binds the loopback address only.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        info = ray.init(
            num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=dashboard,
            dashboard_host="127.0.0.1", log_to_driver=False, configure_logging=False,
        )
        gcs = info.address_info.get("gcs_address", "")
        dashboard_url = info.dashboard_url or None
        started = True
    resources = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if dashboard_url and not dashboard_url.startswith("http"):
        dashboard_url = f"http://{dashboard_url}"
    return Cluster(gcs, dashboard_url, int(resources.get("CPU", 0)), int(resources.get("GPU", 0)),
                   nodes, started)


def disconnect(cluster: Cluster) -> None:
    """Stop the private instance (a joined cluster keeps running)."""
    ray.shutdown()


def dashboard_hint(cluster: Cluster) -> str:
    """Where the dashboard is and how to sign in (Ray 2.60 enables token authentication)."""
    if not cluster.dashboard_url:
        return "Ray dashboard: on the head node of the cluster (port 8265)"
    return (
        f"Ray dashboard: {cluster.dashboard_url} (sign in with the token printed by "
        "`.venv/bin/ray get-auth-token`)"
    )


def check_storage(storage: str, nodes: int, mounts: str | None = None) -> None:
    """A multi-node study needs Tune storage every node can reach (Ray does not sync to the head).

    Accepts ``s3://``, ``gs://`` or a path on a network file system; raises UserError otherwise.
    ``mounts`` is the text of /proc/mounts (read when not given).
    """
    if nodes <= 1 or storage.startswith(REMOTE_SCHEMES):
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
