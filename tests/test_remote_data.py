"""A data folder in object storage (``data.precomp_dir=s3://...``) copied once per node into the
workspace's cache (:mod:`icr.data.remote`): a copy found current by size, modification time and
``SHA256SUMS``, an object changed or a copy cut short copied again (that file only), concurrent
callers copying once, and each failure one line naming the URI.

The fast tests read ``file://`` URIs (the same pyarrow file system interface as ``s3://``); the
slow one uploads SCAN's ``coco_precomp`` layout (:mod:`published`) to moto's S3 server on
127.0.0.1 (:mod:`servers`) and runs ``--plan`` and ``--debug`` of ``ltd_bound`` on it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
from published import write_scan_coco

from icr.config import check_paths, from_flat, local_paths, remote_paths
from icr.data import remote
from icr.data.datasets import load_source
from icr.errors import ConfigError, DataError
from icr.workspace import Workspace
from studies.failures import NodeCannotRead
from studies.run import main


@pytest.fixture()
def published(tmp_path: Path) -> Path:
    return write_scan_coco(tmp_path / "bucket" / "coco_precomp")


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_folder_is_copied_whole_then_found_current(published: Path, tmp_path: Path) -> None:
    first = remote.fetch(published.as_uri(), tmp_path / "cache")
    assert first.folder == remote.copy_folder(published.as_uri(), tmp_path / "cache")
    assert files_of(first.folder) == files_of(published)  # byte for byte, nothing else
    assert sorted(first.copied) == sorted(files_of(published)) and first.files == 12
    assert first.copied_bytes == first.size == sum(p.stat().st_size for p in published.iterdir())
    assert "copied to" in first.describe() and "12 of 12 files" in first.describe()

    again = remote.fetch(published.as_uri(), tmp_path / "cache")
    assert again.copied == () and again.copied_bytes == 0 and again.folder == first.folder
    assert "is current (12 files" in again.describe()


def test_a_changed_object_is_copied_again_and_only_it(published: Path, tmp_path: Path) -> None:
    copy = remote.fetch(published.as_uri(), tmp_path / "cache").folder
    caps = published / "dev_caps.txt"
    text = caps.read_text(encoding="utf-8")
    changed = text.replace("a", "b", 1) if "a" in text else text.replace(text[0], "x", 1)
    assert len(changed) == len(text) and changed != text  # the same size: not caught by size
    stat = caps.stat()
    caps.write_text(changed, encoding="utf-8")
    os.utime(caps, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as a store dates a new upload
    again = remote.fetch(published.as_uri(), tmp_path / "cache")
    assert again.copied == ("dev_caps.txt",)
    assert (copy / "dev_caps.txt").read_text(encoding="utf-8") == changed


def test_a_copy_cut_short_or_changed_here_is_copied_again(published: Path, tmp_path: Path) -> None:
    uri, cache = published.as_uri(), tmp_path / "cache"
    copy = remote.fetch(uri, cache).folder
    with open(copy / "train_ims.npy", "r+b") as f:  # truncated after the copy
        f.truncate(100)
    (copy / "dev_ids.txt").unlink()  # removed
    assert sorted(remote.fetch(uri, cache).copied) == ["dev_ids.txt", "train_ims.npy"]
    assert files_of(copy) == files_of(published)

    # a copy killed mid-file: its .partial left behind, the record without that file
    record = copy.with_name(copy.name + ".json")
    record.write_text(record.read_text().replace('"testall_ims.npy"', '"gone.npy"'))
    (copy / "testall_ims.npy.partial").write_bytes(b"half")
    assert remote.fetch(uri, cache).copied == ("testall_ims.npy",)
    assert files_of(copy) == files_of(published)  # the partial file written over, renamed


def test_an_object_gone_from_the_folder_is_gone_from_the_copy(published: Path, tmp_path: Path
                                                              ) -> None:
    copy = remote.fetch(published.as_uri(), tmp_path / "cache").folder
    for kind in ("ims.npy", "caps.txt", "ids.txt"):
        (published / f"test_{kind}").unlink()
    assert remote.fetch(published.as_uri(), tmp_path / "cache").copied == ()
    assert files_of(copy) == files_of(published)


def sha256sums(folder: Path) -> None:
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
             for p in sorted(folder.iterdir()) if p.name != remote.SUMS]
    (folder / remote.SUMS).write_text("".join(lines), encoding="utf-8")


def test_published_sums_check_each_copy_and_find_a_change_size_and_date_hide(
        published: Path, tmp_path: Path) -> None:
    uri, cache = published.as_uri(), tmp_path / "cache"
    sha256sums(published)
    first = remote.fetch(uri, cache)
    assert first.sums and "SHA256SUMS" in first.describe() and first.files == 13

    # an object rewritten with the same size and date: only its published hash tells
    ids = published / "dev_ids.txt"
    stat = ids.stat()
    ids.write_text(ids.read_text(encoding="utf-8").replace("2", "3"), encoding="utf-8")
    os.utime(ids, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert ids.stat().st_size == stat.st_size
    assert remote.fetch(uri, cache).copied == ()  # its sums not yet published: looks current
    sha256sums(published)
    assert remote.fetch(uri, cache).copied == (remote.SUMS, "dev_ids.txt")
    assert (first.folder / "dev_ids.txt").read_bytes() == ids.read_bytes()

    # sums that do not match what the store serves: refused, the good copy kept
    (published / "dev_caps.txt").write_text("other\n" * 20, encoding="utf-8")
    with pytest.raises(DataError) as caught:
        remote.fetch(uri, cache)
    assert "dev_caps.txt" in str(caught.value) and "sha256sum * > SHA256SUMS" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert not (first.folder / "dev_caps.txt.partial").exists()


def test_concurrent_callers_of_one_node_copy_once(published: Path, tmp_path: Path) -> None:
    """Four callers at once (threads: each takes the lock through its own open file, as
    processes do): one copies, the others wait for it and find the copy current."""
    uri, cache = published.as_uri(), tmp_path / "cache"
    start, results = threading.Barrier(4), []

    def call() -> None:
        start.wait()
        results.append(remote.fetch(uri, cache))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    copied = sorted(len(r.copied) for r in results)
    assert copied == [0, 0, 0, 12]
    assert files_of(results[0].folder) == files_of(published)


def test_each_failure_is_one_line_naming_the_uri(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cases = {
        (tmp_path / "absent").as_uri(): "no such folder",
        "nosuch://bucket/prefix": "give s3://BUCKET/PREFIX",
    }
    (tmp_path / "empty").mkdir()
    cases[(tmp_path / "empty").as_uri()] = "no files under it"
    for uri, fix in cases.items():
        with pytest.raises(DataError) as caught:
            remote.fetch(uri, cache)
        line = str(caught.value)
        assert line.startswith(uri) and fix in line and "\n" not in line, line


def test_credentials_in_a_uri_are_never_printed() -> None:
    uri = "s3://b/p?access_key=AKIA&secret_key=s3cr3t&endpoint_override=h:9000"
    assert remote.shown(uri) == "s3://b/p?access_key=%2A%2A%2A&secret_key=%2A%2A%2A&endpoint_override=h:9000"
    assert "s3cr3t" not in remote.shown(uri)
    assert remote.copy_folder(uri, Path("c")) != remote.copy_folder(uri.replace("9000", "9001"),
                                                                     Path("c"))  # keyed by URI


def test_only_a_key_that_takes_a_uri_accepts_one() -> None:
    config = from_flat({"data.dataset": "precomp", "data.precomp_dir": "s3://b/coco_precomp"})
    check_paths(config)  # not a local path: copied by the data check, not refused here
    assert remote_paths(config) == {"data.precomp_dir": "s3://b/coco_precomp"}
    assert "data.precomp_dir" not in local_paths(config)
    with pytest.raises(ConfigError, match="data.karpathy_json=s3://b/x.json: no such file"):
        check_paths(from_flat({"data.dataset": "karpathy", "data.karpathy_json": "s3://b/x.json"}))


def test_the_dataset_reads_the_copy_and_says_where_it_came_from(published: Path, tmp_path: Path
                                                                ) -> None:
    workspace = Workspace(tmp_path / "ws")
    flat = {"data.dataset": "precomp", "data.features": "regions", "image.encoder": "regions"}
    source = load_source(from_flat({**flat, "data.precomp_dir": published.as_uri()}), workspace)
    local = load_source(from_flat({**flat, "data.precomp_dir": str(published)}), workspace)
    assert source.root == remote.copy_folder(published.as_uri(), workspace.cache)
    assert {s: v.image_ids for s, v in source.splits.items()} == \
        {s: v.image_ids for s, v in local.splits.items()}
    assert source.notes[0].startswith(f"data: {published.as_uri()} copied to {source.root}")
    assert source.notes[1:] == tuple(n.replace(str(published), str(source.root))
                                     for n in local.notes)


def test_plan_copies_the_folder_and_says_from_where(published: Path, tmp_path: Path, capsys
                                                    ) -> None:
    args = ["ltd_bound", "--plan", "--workspace", str(tmp_path / "ws"), "--set",
            "data.dataset=precomp", f"data.precomp_dir={published.as_uri()}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    copy = remote.copy_folder(published.as_uri(), (tmp_path / "ws").resolve() / "cache")
    assert f"needs data.precomp_dir={published.as_uri()}: copied to this node and checked" in out
    assert f"data: {published.as_uri()} copied to {copy}: 12 of 12 files" in out
    assert "val from dev_*" in out and "test from testall_*" in out
    assert main(args) == 0
    assert f"data: {published.as_uri()}: the copy in {copy} is current" in capsys.readouterr().out

    missing = (tmp_path / "nothing").as_uri()
    assert main([*args[:-1], f"data.precomp_dir={missing}"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {missing}: no such folder; give the folder that holds the data " \
                  "(e.g. the prefix of train_ims.npy)\n"


def test_a_trial_copies_the_folder_on_its_node_or_names_the_node(published: Path, tmp_path: Path
                                                                 ) -> None:
    from test_cluster_checks import job

    from studies.trainable import check_readable

    trial = job(tmp_path)
    config = from_flat({"data.dataset": "precomp", "data.precomp_dir": published.as_uri()})
    check_readable(trial, config, "c")
    copy = remote.copy_folder(published.as_uri(), Workspace.resolve(trial.workspace).cache)
    assert files_of(copy) == files_of(published)
    config = from_flat({"data.dataset": "precomp",
                        "data.precomp_dir": (tmp_path / "elsewhere").as_uri()})
    with pytest.raises(NodeCannotRead, match=r"^node .* cannot copy data.precomp_dir: file://.*"
                                             r"elsewhere: no such folder"):
        check_readable(trial, config, "c")


# --- on an S3-compatible server ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_study_reads_its_features_from_a_bucket(s3, published: Path, tmp_path: Path,
                                                  monkeypatch, capsys) -> None:
    """SCAN's coco_precomp layout uploaded to the bucket; ``--plan`` and ``--debug`` of
    ``ltd_bound`` with ``data.precomp_dir=s3://bucket/prefix`` (the server in
    ``AWS_ENDPOINT_URL``): copied once into the workspace's cache, then found current; a
    missing bucket or prefix, an endpoint that does not answer and missing credentials are
    each one line and exit code 2."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    prefix = f"data-{tmp_path.name}/coco_precomp"
    for path in sorted(published.iterdir()):
        s3.client().upload_file(str(path), s3.bucket, f"{prefix}/{path.name}")
    uri = f"s3://{s3.bucket}/{prefix}"
    workspace = tmp_path / "ws"
    data = ["--set", "data.dataset=precomp", f"data.precomp_dir={uri}"]
    assert main(["ltd_bound", "--plan", "--workspace", str(workspace), *data]) == 0
    out = capsys.readouterr().out
    copy = remote.copy_folder(uri, workspace.resolve() / "cache")
    assert f"data: {uri} copied to {copy}: 12 of 12 files" in out, out
    assert files_of(copy) == files_of(published)

    code = main(["ltd_bound", "--debug", "--condition", "contrastive", "--workspace",
                 str(workspace), *data, "train.warmup_epochs=1", "train.finetune_epochs=0",
                 "train.max_steps_per_epoch=2", "train.batch_size=8"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"data: {uri}: the copy in {copy} is current" in out and "epoch 1/1" in out

    for wrong, fix in ((f"s3://nobucket-{tmp_path.name}/coco_precomp", "does not exist"),
                       (f"s3://{s3.bucket}/absent-{tmp_path.name}", "no such folder"),
                       (f"{uri}?endpoint_override=127.0.0.1:1&scheme=http",
                        "the object store does not answer"),
                       (uri, "access refused")):  # last: without credentials (moto: a HEAD refused)
        if fix == "access refused":
            monkeypatch.delenv("AWS_ACCESS_KEY_ID")
            monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        assert main(["ltd_bound", "--plan", "--workspace", str(tmp_path / "other"), "--set",
                     "data.dataset=precomp", f"data.precomp_dir={wrong}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {wrong}: ") and fix in err and err.count("\n") == 1, err
