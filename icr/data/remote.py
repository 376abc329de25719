"""Data folders in object storage, copied once per node into a local cache.

A lab whose features live in a bucket (``data.precomp_dir=s3://bucket/coco_precomp``) needs no
shared file system: each node copies the folder into ``<workspace>/cache/remote/<name>-<hash of
the URI>`` and the loaders read that copy as a local folder (:func:`local_folder`, the one place a
data URI becomes a path). The URI is any that ``pyarrow.fs.FileSystem.from_uri`` reads, as Tune
reads its storage: ``s3://`` (credentials and ``AWS_ENDPOINT_URL`` from the environment, or
``?endpoint_override=host:port&scheme=http`` in the query), ``gs://``, ``file://``.

A copy is current when every file of the folder, as listed now, has the size and modification
time it had when copied, the copy of each file still has the size and modification time it was
written with, and, where the folder publishes a ``SHA256SUMS`` file (``sha256sum * >
SHA256SUMS``), the SHA-256 of each copied file equals the one listed there. Each file is copied
into a ``.partial`` file, its SHA-256 computed on the way, its byte count checked against the
listing (and its hash against ``SHA256SUMS``), then renamed; the record of what was copied
(``<copy>.json``, beside the copy) is rewritten after each file. So a copy cut short, an object
changed or a local file truncated is copied again, file by file, and nothing else is. A file
lock (``<copy>.lock``) makes the processes of one node (the driver, two trials) copy a folder
once: the others wait, then find it current.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import time
import urllib.parse
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow
import pyarrow.fs

from icr.config import is_uri
from icr.errors import DataError

logger = logging.getLogger(__name__)

SUMS = "SHA256SUMS"  # published beside the data: `sha256sum * > SHA256SUMS`, checked when present
CHUNK = 8 << 20  # bytes a ranged read asks for; several are in flight at once (object stores)
READERS = 4  # ranged reads in flight per file
ATTEMPTS = 3  # tries of one ranged read: a busy server lets one time out now and then
SECRETS = ("access_key", "secret_key", "session_token")  # query parameters never printed


@dataclass(frozen=True)
class Copy:
    """A folder's local copy, and what bringing it up to date took.

    Attributes:
        uri: the folder's URI as printed (credentials in its query hidden).
        folder: the local copy.
        files: the folder's files; ``size`` their bytes together.
        copied: the files copied by this call (none: the copy was current).
        copied_bytes: their bytes; ``seconds``: how long the call took, waiting included.
        sums: whether the folder publishes ``SHA256SUMS`` (each copied file was checked by it).
    """

    uri: str
    folder: Path
    files: int
    size: int
    copied: tuple[str, ...]
    copied_bytes: int
    seconds: float
    sums: bool

    def describe(self) -> str:
        """One line for preparation and ``--plan``: where the data comes from, where it is."""
        checks = "size, modification time" + (f" and {SUMS}" if self.sums else "")
        if not self.copied:
            return (f"data: {self.uri}: the copy in {self.folder} is current ({self.files} files, "
                    f"{_mb(self.size)}; checked by {checks})")
        rate = self.copied_bytes / max(self.seconds, 1e-9)
        return (f"data: {self.uri} copied to {self.folder}: {len(self.copied)} of {self.files} "
                f"files, {_mb(self.copied_bytes)} in {self.seconds:.1f} s ({_mb(rate)}/s; "
                f"checked by {checks})")


def local_folder(location: str, cache: Path) -> Path:
    """The local folder of ``location``: itself when it is a path, else its copy in ``cache``,
    brought up to date (:func:`fetch`)."""
    return fetch(location, cache).folder if is_uri(location) else Path(location).expanduser()


def copy_folder(uri: str, cache: Path) -> Path:
    """Where the copy of folder ``uri`` lives in ``cache`` (the workspace's ``cache``): the
    same path on every node whose workspace has the same path."""
    parts = urllib.parse.urlsplit(uri)
    name = re.sub(r"[^\w.-]+", "-", f"{parts.netloc}{parts.path}").strip("-")[-60:] or "data"
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    return cache / "remote" / f"{name}-{digest}"


def shown(uri: str) -> str:
    """``uri`` as printed: the values of credentials in its query hidden."""
    parts = urllib.parse.urlsplit(uri)
    if not parts.query:
        return uri
    query = [(k, "***" if k in SECRETS else v) for k, v in urllib.parse.parse_qsl(parts.query)]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, safe=":")))


def fetch(uri: str, cache: Path) -> Copy:
    """Bring the local copy of folder ``uri`` up to date (module docstring) and return it.

    Raises:
        DataError: one line naming the URI and the fix: a URI pyarrow cannot read, a bucket or
            folder that does not exist or is empty, credentials refused, an endpoint that does
            not answer, a file whose copy differs from ``SHA256SUMS``, a local disk that is full.
    """
    start = time.monotonic()
    fs, root = _filesystem(uri)
    folder = copy_folder(uri, cache)
    with _locked(_beside(folder, ".lock"), uri):
        listed = _listing(fs, root, uri)
        sums = _sums(fs, root, uri) if SUMS in listed else {}
        record = _read_record(_beside(folder, ".json"))
        stale = [name for name, info in sorted(listed.items())
                 if not _current(record.get(name), info, folder / name, sums.get(name))]
        if stale:
            logger.info("copying %s (%d of %d files, %s) to %s", shown(uri), len(stale),
                        len(listed), _mb(sum(listed[n].size for n in stale)), folder)
        for name in stale:
            record[name] = _copy_file(fs, listed[name], folder / name, sums.get(name), uri)
            _write_record(_beside(folder, ".json"), record)
        _remove_unlisted(folder, record, listed)
    return Copy(shown(uri), folder, len(listed), sum(i.size for i in listed.values()),
                tuple(stale), sum(listed[n].size for n in stale), time.monotonic() - start,
                bool(sums))


# --- the remote folder -------------------------------------------------------------------------


def _filesystem(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    try:
        fs, root = pyarrow.fs.FileSystem.from_uri(uri)
    except (pyarrow.ArrowException, ValueError, OSError) as exc:
        raise DataError(f"{shown(uri)}: {_first_line(exc)}; give s3://BUCKET/PREFIX (an "
                        "S3-compatible server: ?endpoint_override=HOST:PORT&scheme=http, or "
                        "AWS_ENDPOINT_URL), gs://BUCKET/PREFIX, file:///PATH or a local folder"
                        ) from None
    return fs, root.rstrip("/")


def _listing(fs: pyarrow.fs.FileSystem, root: str, uri: str) -> dict[str, pyarrow.fs.FileInfo]:
    """The folder's files by their path inside it."""
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    except (OSError, pyarrow.ArrowException) as exc:
        raise _remote_error(uri, exc) from None
    files = {info.path[len(root) + 1:]: info for info in infos
             if info.type == pyarrow.fs.FileType.File}
    if not files:
        raise DataError(f"{shown(uri)}: no files under it; give the folder that holds the data "
                        "(e.g. the prefix of train_ims.npy)")
    return files


def _remote_error(uri: str, exc: BaseException) -> DataError:
    """What went wrong reading ``uri``, as one line with the fix."""
    text, where = _first_line(exc), shown(uri)
    if isinstance(exc, FileNotFoundError) or "NO_SUCH_KEY" in text:
        return DataError(f"{where}: no such folder; give the folder that holds the data "
                         "(e.g. the prefix of train_ims.npy)")
    if "NO_SUCH_BUCKET" in text:
        bucket = urllib.parse.urlsplit(uri).netloc
        return DataError(f"{where}: the bucket {bucket} does not exist at this endpoint; check "
                         "its name, and the endpoint (AWS_ENDPOINT_URL or ?endpoint_override=)")
    if re.search(r"ACCESS_DENIED|FORBIDDEN|INVALID_ACCESS_KEY|SIGNATURE|credential|Unauthorized",
                 text, re.IGNORECASE):
        return DataError(f"{where}: access refused ({text}); give every node credentials that can "
                         "read it (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an "
                         "instance role; for gs://, GOOGLE_APPLICATION_CREDENTIALS)")
    if "NETWORK_CONNECTION" in text or "connect" in text.lower():
        return DataError(f"{where}: the object store does not answer ({text}); check the "
                         "endpoint (AWS_ENDPOINT_URL or ?endpoint_override=HOST:PORT&scheme=http) "
                         "and that this node reaches it")
    return DataError(f"{where}: cannot be read ({text}); check the URI and the credentials")


def _sums(fs: pyarrow.fs.FileSystem, root: str, uri: str) -> dict[str, str]:
    """``SHA256SUMS`` as ``{file: hex digest}`` (``sha256sum``'s format, text or binary mode)."""
    try:
        with fs.open_input_stream(f"{root}/{SUMS}") as stream:
            text = stream.readall().decode("utf-8", errors="replace")
    except (OSError, pyarrow.ArrowException) as exc:
        raise _remote_error(uri, exc) from None
    sums = {}
    for line in text.splitlines():
        digest, _, name = line.strip().partition(" ")
        if re.fullmatch(r"[0-9a-fA-F]{64}", digest) and name.strip():
            sums[name.strip().lstrip("*").removeprefix("./")] = digest.lower()
    return sums


# --- the local copy ----------------------------------------------------------------------------


def _current(entry: dict | None, info: pyarrow.fs.FileInfo, local: Path, digest: str | None) -> bool:
    """The copy of one file is that of the object listed (size, modification time), is whole
    (its size and modification time as written) and has the published hash, if any."""
    if entry is None or entry.get("size") != info.size or entry.get("mtime_ns") != info.mtime_ns:
        return False
    if digest is not None and digest != entry.get("sha256"):
        return False
    try:
        stat = local.stat()
    except OSError:
        return False
    return stat.st_size == entry["size"] and stat.st_mtime_ns == entry.get("local_mtime_ns")


def _copy_file(fs: pyarrow.fs.FileSystem, info: pyarrow.fs.FileInfo, dest: Path,
               digest: str | None, uri: str) -> dict:
    """Copy one object to ``dest`` (ranged reads in parallel, written in order and hashed on the
    way); its record: the object's size and modification time, the copy's SHA-256 and its
    modification time."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    sha, written = hashlib.sha256(), 0
    try:
        with fs.open_input_file(info.path) as source, open(partial, "wb") as out, \
                ThreadPoolExecutor(READERS) as pool:
            pending: deque = deque()
            for offset in range(0, info.size, CHUNK):
                pending.append(pool.submit(_read_at, source, min(CHUNK, info.size - offset),
                                           offset))
                while len(pending) > 2 * READERS or (pending and offset + CHUNK >= info.size):
                    block = pending.popleft().result()
                    sha.update(block)
                    out.write(block)
                    written += len(block)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        partial.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the local disk, not the store
            raise DataError(f"{dest.parent}: {exc.strerror} copying {shown(uri)} ({_mb(info.size)} "
                            "for this file); free space there or put the workspace "
                            "(ICR_WORKSPACE) on a larger disk") from None
        raise _remote_error(uri, exc) from None
    except pyarrow.ArrowException as exc:
        partial.unlink(missing_ok=True)
        raise _remote_error(uri, exc) from None
    name = info.path.rsplit("/", 1)[-1]
    if written != info.size:
        partial.unlink(missing_ok=True)
        raise DataError(f"{shown(uri)}: {name} read {written:,} of its {info.size:,} bytes (it "
                        "changed while being copied?); run again")
    if digest is not None and sha.hexdigest() != digest:
        partial.unlink(missing_ok=True)
        raise DataError(f"{shown(uri)}: the SHA-256 of {name} ({sha.hexdigest()[:12]}...) is not "
                        f"the one {SUMS} lists ({digest[:12]}...); the object changed or {SUMS} "
                        "is stale: publish new sums (sha256sum * > SHA256SUMS), then run again")
    os.replace(partial, dest)
    return {"size": info.size, "mtime_ns": info.mtime_ns, "sha256": sha.hexdigest(),
            "local_mtime_ns": dest.stat().st_mtime_ns}


def _read_at(source: pyarrow.NativeFile, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset``, the read tried again when the store times out (a busy
    S3-compatible server drops a slow request after its client's few seconds)."""
    for attempt in range(ATTEMPTS):
        try:
            return source.read_at(size, offset)
        except OSError as exc:
            if attempt == ATTEMPTS - 1 or "NETWORK_CONNECTION" not in str(exc):
                raise
            logger.info("a read of %d bytes timed out; trying again (%s)", size, _first_line(exc))
    raise AssertionError("unreachable")


def _remove_unlisted(folder: Path, record: dict, listed: dict) -> None:
    """Files of the copy (and of its record) no longer in the folder are removed."""
    gone = set(record) - set(listed)
    for name in gone:
        (folder / name).unlink(missing_ok=True)
        del record[name]
    if gone:
        _write_record(_beside(folder, ".json"), record)


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: every file is copied again
    return record.get("files", {}) if isinstance(record, dict) else {}


def _write_record(path: Path, files: dict) -> None:
    """Written whole or not at all (a rename), so a kill leaves the last record."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"files": files}, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(partial, path)


@contextlib.contextmanager
def _locked(path: Path, uri: str) -> Iterator[None]:
    """Hold the node's lock on one copy (released when the process dies, too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process of this node copying %s", shown(uri))
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _beside(folder: Path, suffix: str) -> Path:
    """The file beside the copy that holds its record (``.json``) or its lock (``.lock``)."""
    return folder.with_name(folder.name + suffix)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _mb(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
