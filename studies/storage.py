"""Where Tune keeps a study's experiments, whether every node of the cluster reaches it, and
how the driver reads and writes it.

Ray does not copy trials' folders to the head node: on a cluster of several machines Tune's
storage must be one every node can reach (docs/reference-code.md section 7): ``s3://``, ``gs://``, or a
network file system mounted on every node. A local path is refused with one line there, before
anything starts.

The storage is a folder or a URI, and the platform reads and writes it as Tune does: through
the file system ``pyarrow.fs.FileSystem.from_uri`` gives for it (:func:`filesystem`), never
``pathlib`` or ``shutil`` on a URI. A URI may carry its file system's options in its query
string, as Ray documents for S3-compatible servers
(``s3://bucket/path?endpoint_override=host:9000&scheme=http``): sub-paths are joined to its path,
before the query (:func:`join`), so every location keeps them.
"""

from __future__ import annotations

import fnmatch
import math
import os
import urllib.parse
from pathlib import Path

import pyarrow.fs

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


# --- reading and writing the storage ------------------------------------------------------------


def join(location: str | os.PathLike, *parts: str) -> str:
    """``location`` (a folder or a URI) with ``parts`` appended to its path, before a URI's
    query string: ``join("s3://b/p?scheme=http", "x", "y") == "s3://b/p/x/y?scheme=http"``."""
    location = os.fspath(location)
    if "://" not in location:
        return "/".join([location.rstrip("/"), *parts])
    parsed = urllib.parse.urlsplit(location)
    return urllib.parse.urlunsplit(parsed._replace(path="/".join([parsed.path.rstrip("/"), *parts])))


def with_query_of(uri: str, location: str) -> str:
    """``uri`` with the query string of ``location`` (a URI's file system options), if any."""
    query = urllib.parse.urlsplit(location).query if "://" in location else ""
    return urllib.parse.urlunsplit(urllib.parse.urlsplit(uri)._replace(query=query)) if query else uri


def filesystem(location: str | os.PathLike) -> tuple[pyarrow.fs.FileSystem, str]:
    """The file system of a folder or a URI, and the path in it (Tune's reading of its storage:
    a URI's query string gives its file system's options)."""
    location = os.fspath(location)
    if "://" in location:
        return pyarrow.fs.FileSystem.from_uri(location)
    return pyarrow.fs.LocalFileSystem(), str(Path(location).expanduser().absolute())


def read_bytes(location: str | os.PathLike) -> bytes:
    """The content of the file at ``location``. Raises OSError (FileNotFoundError when absent)."""
    fs, path = filesystem(location)
    with fs.open_input_stream(path) as stream:
        return stream.readall()


def names(location: str | os.PathLike, pattern: str = "*") -> list[str]:
    """The names of the files in folder ``location`` that match ``pattern`` (a glob), sorted;
    none when the folder does not exist."""
    fs, path = filesystem(location)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    return sorted(info.base_name for info in infos if info.type == pyarrow.fs.FileType.File
                  and fnmatch.fnmatchcase(info.base_name, pattern))


def remove_folder(location: str | os.PathLike) -> None:
    """Remove folder ``location`` and everything in it (nothing when it does not exist)."""
    fs, path = filesystem(location)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound:
        fs.delete_dir(path)
