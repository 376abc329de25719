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

Tune writes a folder through :func:`tune_storage`'s file system, which writes each file whole:
Ray copies Tune's saved state from the driver's staging folder to the storage file by file, in
place, while Tune goes on saving; a driver killed during a copy left a state file cut short,
and the experiment, never saved whole, was started over (its trials' work lost). An object
store writes an object whole by itself.
"""

from __future__ import annotations

import fnmatch
import io
import math
import os
import urllib.parse
import uuid
from pathlib import Path

import fsspec.implementations.local
import pyarrow
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


def tune_storage(location: str | os.PathLike) -> tuple[str, pyarrow.fs.FileSystem | None]:
    """What Tune is given for its storage ``location``: ``RunConfig``'s (and ``Tuner.restore``'s)
    ``storage_path`` and ``storage_filesystem``. A folder is written through
    :class:`WholeFiles`; a URI through the file system Tune builds from it (``None``)."""
    location = os.fspath(location)
    if "://" in location:
        return location, None
    return filesystem(location)[1], pyarrow.fs.PyFileSystem(WholeFiles())


def is_local(fs: pyarrow.fs.FileSystem) -> bool:
    """Whether ``fs`` reads and writes this machine's folders (a local or mounted disk): pyarrow's
    own, or :class:`WholeFiles` (named by their ``type_name``, as Ray tells file systems apart)."""
    return fs.type_name in ("local", f"py::{WholeFiles.TYPE_NAME}")


class WholeFiles(pyarrow.fs.FSSpecHandler):
    """This machine's folders, each file written whole: under a hidden temporary name beside
    it (``.NAME.HEX.partial``, which no pattern of Tune's or the platform's matches), renamed
    to ``NAME`` when closed. A reader meets the file as it was before or as it is after a
    write, never part of one: a process killed while writing leaves the old file (and the
    temporary one), and a write that fails is not renamed. A rename within a folder is atomic
    on a local disk and on NFS. Without fsync: a killed process loses nothing the kernel took,
    a machine that loses power may."""

    TYPE_NAME = "icr-whole-files"

    def __init__(self) -> None:
        super().__init__(fsspec.implementations.local.LocalFileSystem())

    def get_type_name(self) -> str:
        return self.TYPE_NAME

    def open_output_stream(self, path: str, metadata: dict | None) -> pyarrow.NativeFile:
        return pyarrow.PythonFile(_WholeFile(path), mode="w")


class _WholeFile(io.FileIO):
    """A file written under a temporary name, moved to ``path`` when closed after every write
    succeeded (:class:`WholeFiles`)."""

    def __init__(self, path: str) -> None:
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)  # as fsspec's local files do: Ray's copies rely on it
        super().__init__(os.path.join(folder, f".{name}.{uuid.uuid4().hex}.partial"), "xb")
        self.path = path
        self.failed = False

    def write(self, data: bytes) -> int:  # type: ignore[override]
        try:
            return super().write(data)
        except BaseException:
            self.failed = True
            raise

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()
        except BaseException:
            self.failed = True
            raise
        finally:
            if self.failed:
                os.remove(self.name)
            else:
                os.replace(self.name, self.path)


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
