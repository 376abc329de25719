"""Where Tune keeps a study's experiments, and whether every node of the cluster reaches it.

Ray does not copy trials' folders to the head node: on a cluster of several machines Tune's
storage must be one every node can reach (docs/reference-code.md section 7): ``s3://``, ``gs://``, or a
network file system mounted on every node. A local path is refused with one line there, before
anything starts.
"""

from __future__ import annotations

import math
from pathlib import Path

from icr.errors import UserError

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://")
# File systems that several machines can mount: a Tune storage path on one of these is shared.
SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "glusterfs", "beegfs",
             "fuse.sshfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.juicefs",
             "efs", "virtiofs", "9p")


def check_storage(storage: str, nodes: float, mounts: str | None = None,
                  hosts: int | None = None, now: int | None = None) -> None:
    """A multi-node study needs Tune storage every node can reach (Ray does not sync to the head).

    ``nodes`` is the most nodes the cluster can reach (:attr:`studies.connection.Cluster.
    reachable_nodes`), not those alive at the start (``now``): a cluster that starts with its
    head alone and adds workers when trials ask for them (``cluster.yaml``, a RayJob) runs its
    trials on other machines. Accepts ``s3://``, ``gs://``, a path on a network file system, or
    any path when every node runs on one machine (``hosts == 1``: they share its disk); raises
    UserError otherwise. ``mounts`` is the text of /proc/mounts (read when not given).
    """
    if nodes <= 1 or hosts == 1 or storage.startswith(REMOTE_SCHEMES):
        return
    if "://" in storage:
        raise UserError(f"--storage {storage}: only s3://, gs:// or a shared path are supported")
    fstype = filesystem_type(Path(storage), mounts)
    if fstype in SHARED_FS:
        return
    reach = "more than one" if math.isinf(nodes) else f"{nodes:g}"
    alive = f" ({now} now)" if now is not None and now < nodes else ""
    raise UserError(
        f"the cluster can reach {reach} nodes{alive} but the Tune storage {storage} is on a "
        f"local disk ({fstype}); pass --storage s3://BUCKET/PATH, gs://BUCKET/PATH or a path "
        "on NFS mounted on every node"
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
