"""The benchmark scripts run end to end on small inputs (their timings are not tested)."""

import importlib.util
import itertools
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    if str(BENCHMARKS) not in sys.path:  # a script's own folder, where its helpers are
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _tracking_rows(out: str) -> dict[tuple[str, str], float]:
    """(store, way) -> epoch records/s, from the benchmark's printed lines."""
    rows = {}
    for line in out.splitlines():
        found = re.match(r"\s*(.+?) \|\s+(.+?):\s+([\d.]+) epoch records/s", line)
        if found:
            rows[found[1], found[2]] = float(found[3])
    return rows


def test_tracking_throughput_small(capsys, monkeypatch):
    """The tracking benchmark end to end on a few records of a local store: the three ways, their
    ratios, and the study's need beside the platform's rate."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    load("tracking_throughput").main(["--epochs", "2", "--rows", "5", "--trials", "2",
                                      "--stores", "local"])
    out = capsys.readouterr().out
    rows = _tracking_rows(out)
    assert set(rows) == {("local sqlite", w) for w in ("sync log_batch", "async log_batch",
                                                        "platform")}
    assert all(rate > 0 for rate in rows.values())
    assert "local sqlite | async / sync = " in out and "platform / sync = " in out
    # 8 GPUs x 4 trials x (58,723 / 4 / 80,000) epochs a second of each trial
    assert "need: 8 GPUs x 4 trials x 0.184 epochs/s (58,723 pairs/s a GPU, 80,000 pairs an " \
           "epoch) = 5.87 epoch records/s" in out
    assert "the platform records >= 5.87 epoch records/s: local sqlite " in out


@pytest.mark.slow
def test_tracking_throughput_small_on_an_mlflow_server(capsys, monkeypatch):
    """The server half: started on loopback, measured with the public API, stopped."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    load("tracking_throughput").main(["--epochs", "2", "--rows", "5", "--trials", "2",
                                      "--stores", "server", "--server-workers", "1"])
    out = capsys.readouterr().out
    assert {w for s, w in _tracking_rows(out) if s == "mlflow server (1 worker)"} == {
        "sync log_batch", "async log_batch", "platform"}


def test_eval_speed_small(capsys, monkeypatch):
    """The eval_speed script end to end on a small split: every line, ratios and metrics."""
    eval_speed = load("eval_speed")
    argv = ["eval_speed", "--images", "40", "--captions", "200", "--dim", "16",
            "--loop-queries", "10", "--repeats", "1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    eval_speed.main()
    out = capsys.readouterr().out
    for needle in ("(a) floor", "(b) full", "(c) loop", "full / floor =", "loop / full  =", "rsum="):
        assert needle in out


def test_benchmark_realism_tiny(capsys, tmp_path):
    """The realism tables end to end on the tiny preset: COCO's column from eccv-caption's files
    (CxC gives 0.42 extra images per caption among 5,000), the preset's exact statistics, the
    region probes beside BUTD's figures, and a two-epoch learnability run beside the papers'."""
    realism = load("benchmark_realism")
    realism.main(["--workspace", str(tmp_path), "--presets", "tiny", "--learnability",
                  "--epochs", "2", "--sizes", "recipe"])
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines()}
    coco, tiny = (c.strip() for c in rows["regions per image"].strip(" |").split(" | ")[1:3])
    assert coco.startswith("36") and tiny == "36"
    cxc = float(rows["false negatives per caption per 1,000 images"].split(" | ")[1].split(" / ")[0])
    assert cxc == pytest.approx(0.42 / 4999 * 1000, abs=0.002)
    mean, share = realism.batch_false_negatives(np.array([0, 10, 4999]), 4999, batch=128)
    assert mean == pytest.approx((0 + 10 + 4999) * 127 / 4999 / 3)
    assert share == pytest.approx((0 + (1 - _no_hit(10, 4999, 127)) + 1) / 3)
    for attribute, classes in (("shape", 13), ("colour", 10), ("size", 3), ("texture", 5)):
        cells = rows[f"{attribute} ({classes})"].strip(" |").split(" | ")
        best, every, majority = map(float, re.findall(r"[\d.]+", cells[3]))
        assert 0 <= majority <= 100 and 0 <= best <= 100 and 0 <= every <= 100
    assert "10.2 %" in rows["shape (13)"]  # BUTD's object heads, cited
    assert rows["COCO 1k [P]"].split(" | ")[2].strip() == "520.5"
    ceiling = rows["ranks what is true first [C]"].strip(" |").split(" | ")
    assert 0 < float(ceiling[3]) <= 100 and 0 < float(ceiling[2]) <= 600
    objects = rows["the same, reading objects, not relations or counts [C]"].strip(" |").split(" | ")
    assert float(objects[2]) <= float(ceiling[2])  # a looser reading is true of more images
    run = rows["recipe sizes"].strip(" |").split(" | ")
    assert re.fullmatch(r"2 \(\d+\)", run[1]) and 0 <= float(run[2].split()[0]) <= 600
    rates = re.findall(r"(\d+): ([\d.]+) / ([\d.]+)", run[5])
    assert [int(e) for e, _, _ in rates] == [1, 2]  # the first two epochs (the last is the 2nd)
    assert all(0 <= float(v) <= 100 for _, a, b in rates for v in (a, b))


def test_learnability_alone_needs_no_coco_files_and_tests_any_study(capsys, tmp_path, monkeypatch):
    """--only-learnability (a GPU machine's run): no statistics or probe tables and no
    eccv-caption; another study's condition, whose recipe skips the test split, is still tested,
    and each epoch's training loss is reported (where a triplet SH collapse shows)."""
    realism = load("benchmark_realism")
    monkeypatch.setitem(sys.modules, "eccv_caption", None)  # importing it now fails
    realism.main(["--workspace", str(tmp_path), "--presets", "tiny", "--only-learnability",
                  "--epochs", "2", "--sizes", "recipe", "--study", "loss_functions",
                  "--condition", "vsrn_triplet_sh"])
    out = capsys.readouterr().out
    assert "regions per image" not in out and "shape (13)" not in out
    run = next(line for line in out.splitlines() if line.startswith("| recipe sizes"))
    assert 0 <= float(run.strip(" |").split(" | ")[2].split()[0]) <= 600  # a test rsum, not nan
    losses = out.split("Mean training loss per epoch:")[1].strip().splitlines()[0]
    assert len(re.findall(r"\d+\.?\d*", losses.split(":")[1])) == 2 and "nan" not in losses


def test_bag_of_objects_keeps_objects_and_background_only():
    realism = load("benchmark_realism")
    red, blue = {"colour": "red", "hpos": "left"}, {"shape": "square"}
    meaning = [{"kind": "relation", "rel": "left_of", "a": red, "b": blue},
               {"kind": "count", "desc": blue, "n": 3}, {"kind": "count", "desc": red, "n": 0},
               {"kind": "total", "n": 5}, {"kind": "background", "hue": "grey"}]
    assert realism.bag_of_objects(meaning) == [
        {"kind": "exists", "desc": red}, {"kind": "exists", "desc": blue},
        {"kind": "exists", "desc": blue}, {"kind": "background", "hue": "grey"}]


def test_ceiling_recalls_against_every_order_of_the_ties():
    """A model that ranks the true items first, in every order of them equally often: the share
    of orders that put the own image (a caption's query) or an own caption (an image's) in the
    first k."""
    realism = load("benchmark_realism")
    other_images, other_captions, per_image = np.array([0, 2, 4]), np.array([0, 1, 3]), 2
    got = realism.ceiling_recalls(other_images, other_captions, per_image, ks=(1, 2, 3))
    for k in (1, 2, 3):  # 3: more than some images' true captions
        t2i = [np.mean([order.index(0) < k for order in itertools.permutations(range(1 + n))])
               for n in other_images]  # item 0: the own image
        i2t = [np.mean([min(order.index(c) for c in range(per_image)) < k
                        for order in itertools.permutations(range(per_image + n))])
               for n in other_captions]  # items 0 .. per_image - 1: the own captions
        assert got[f"t2i_R_at_{k}"] == pytest.approx(100 * np.mean(t2i))
        assert got[f"i2t_R_at_{k}"] == pytest.approx(100 * np.mean(i2t))
    assert got["rsum"] == pytest.approx(sum(v for key, v in got.items() if key != "rsum"))


def test_in_batch_top1_is_the_exact_expectation_over_batches():
    """Against every batch: the share of (query, batch) pairs whose positive is ranked first,
    averaged over all ways to draw the batch's other candidates."""
    realism = load("benchmark_realism")
    rng = np.random.default_rng(0)
    n_img, per_image, batch = 6, 2, 4
    img = torch.from_numpy(rng.standard_normal((n_img, 3)).astype(np.float32))
    cap = torch.from_numpy(rng.standard_normal((n_img * per_image, 3)).astype(np.float32))
    caption_image = torch.arange(n_img).repeat_interleave(per_image)
    sims = (img @ cap.t()).numpy()
    t2i, i2t = [], []
    for c, p in enumerate(caption_image.tolist()):
        others = [j for j in range(n_img) if j != p]
        t2i += [np.mean([sims[p, c] > sims[list(s), c].max()
                         for s in itertools.combinations(others, batch - 1)])]
        foreign = [k for k in range(len(cap)) if caption_image[k] != p]
        i2t += [np.mean([sims[p, c] > sims[p, list(s)].max()
                         for s in itertools.combinations(foreign, batch - 1)])]
    for chunk in (1, 4, 64):  # images per chunk: several chunks on each side, and one
        got_i2t, got_t2i = realism.in_batch_top1(img, cap, caption_image, batch=batch, chunk=chunk)
        assert got_i2t == pytest.approx(np.mean(i2t)) and got_t2i == pytest.approx(np.mean(t2i))


def _no_hit(positives: int, others: int, draws: int) -> float:
    """P(no positive among ``draws`` of ``others`` without replacement), as a plain product."""
    p = 1.0
    for i in range(draws):
        p *= (others - positives - i) / (others - i)
    return p


def test_negative_generators_tiny(capsys, tmp_path):
    """The negative-quality benchmark end to end on the tiny preset: every setting is a row whose
    verdict shares add up to 1, and the row of the smallest pool says it does no re-ranking."""
    load("negative_generators").main(["--workspace", str(tmp_path), "--preset", "tiny",
                                      "--negatives", "2", "--candidates", "4", "2", "--quiet"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    body = rows[2:]  # below the header and the alignment row
    assert [r.split(" | ")[0] for r in body] == [
        "| random", "| context, 4 candidates", "| context, 2 candidates (no re-ranking)"]
    for row in body:
        tn, fn, unjudged, same = (float(x) for x in row.strip(" |").split(" | ")[1:5])
        assert abs(tn + fn + unjudged - 1.0) <= 1.5e-3 and 0.0 <= same <= 1.0  # 3 decimals each


def test_gpu_trial_without_cuda_says_so_and_exits_0(capsys, monkeypatch):
    gpu_trial = load("gpu_trial")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu_trial.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_gpu_trial_measures_steps_with_a_given_clock():
    """Each step costs 3 ticks of waiting and 7 of work on a fake clock: the shares are exact."""
    gpu_trial = load("gpu_trial")
    ticks = iter(range(0, 10**6))
    now = [0.0]

    def clock() -> float:
        return now[0]

    class Batches:
        def __iter__(self):
            return self

        def __next__(self):
            now[0] += 3.0  # waiting for the loader
            return [next(ticks)] * 4  # a batch of 4 samples

    def step(batch):
        now[0] += 7.0

    synced = []
    stats = gpu_trial.measure_steps(Batches(), step, 5, warmup=2, sync=lambda: synced.append(1),
                                    clock=clock)
    assert (stats.steps, stats.samples, len(synced)) == (5, 20, 7)  # warm-up steps sync too
    assert stats.seconds == 50.0 and stats.wait_seconds == 15.0
    assert stats.wait_share == 0.3 and stats.samples_per_second == 0.4
    with pytest.raises(ValueError, match="ran out after 3 of 4"):
        gpu_trial.measure_steps(iter([[1], [2], [3]]), step, 4, clock=clock)


def test_gpu_trial_busy_share_is_the_union_of_kernel_intervals():
    """Kernels at 0-2, 1-3 (overlapping, on another stream) and 6-7 of a 10-unit wall: the GPU
    is busy 4 units, not the 5 their durations add up to."""
    gpu_trial = load("gpu_trial")
    assert gpu_trial.busy_share([(6.0, 7.0), (0.0, 2.0), (1.0, 3.0), (1.5, 2.5)], 10.0) == 0.4
    assert gpu_trial.busy_share([], 10.0) == 0.0


def test_gpu_trial_batch_metrics_against_a_hand_example():
    """Three pairs, images 7, 7, 9: the batch's distinct images are 7 and 9 (rows 0 and 2)."""
    import torch

    gpu_trial = load("gpu_trial")
    img = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    cap = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.1, 0.9]])  # caption 1 looks like image 9
    out = gpu_trial.batch_metrics(img, cap, torch.tensor([7, 7, 9]))
    # i2t: image 7 ranks caption 0 first (its own), image 9 caption 2 (its own): R@1 = 100
    # t2i: captions 0 and 2 find their image first, caption 1 finds image 9: R@1 = 2/3
    assert out["i2t_R_at_1"] == 100.0 and out["t2i_R_at_1"] == pytest.approx(200 / 3)
    assert out["rsum"] == pytest.approx(100 + 100 + 100 + 200 / 3 + 100 + 100)


def test_gpu_trial_agreement_rule():
    gpu_trial = load("gpu_trial")
    ref = {"loss": 2.0, "i2t_R_at_1": 50.0, "rsum": 300.0, "emb_max_abs": 0.0}
    close = {"loss": 2.001, "i2t_R_at_1": 51.0, "rsum": 306.0, "emb_max_abs": 5e-4}
    far = {"loss": 2.01, "i2t_R_at_1": 52.0, "rsum": 307.0, "emb_max_abs": 2e-3}
    ok = {n: within for n, _, _, within in gpu_trial.agreement(ref, close, tolerance=1e-3,
                                                                 recall_step=1.0)}
    bad = {n: within for n, _, _, within in gpu_trial.agreement(ref, far, tolerance=1e-3,
                                                                  recall_step=1.0)}
    assert all(ok.values()) and not any(bad.values())


@pytest.mark.parametrize("arch", ["ltd_bound"])
def test_gpu_trial_runs_an_architecture_on_cpu(arch, capsys, workspace):
    """The GPU path end to end on CPU (2 steps, tiny preset): its row is printed and the CPU
    copy of the weights agrees with them exactly."""
    import argparse

    gpu_trial = load("gpu_trial")
    args = argparse.Namespace(steps=2, warmup=1, batch_size=16, preset="tiny", tolerance=1e-6,
                              sizes="recipe",
                              set=["model.embed_dim=16", "decoder.hidden_dim=16",
                                   "image.transformer_layers=1", "text.bert_layers=1"])
    import torch

    assert gpu_trial.run_arch(arch, args, workspace, torch.device("cpu"))
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith(f"| {arch} |") and "emb_max_abs=0/0 " in row and "DIFFERS" not in row


def test_data_path_prints_one_line_per_architecture(capsys, workspace, monkeypatch):
    """benchmarks/data_path.py on the tiny preset: the issue's line format, with the per-pair
    reference path beside the assembly; its batches at 128 pairs exceed the tiny preset's
    captions, so the benchmark's batch is lowered for the test."""
    data_path = load("data_path")
    monkeypatch.setattr(data_path, "BATCH", 16)
    data_path.main(["--archs", "ltd_bound", "vsepp", "--steps", "2", "--preset", "tiny",
                    "--workspace", str(workspace.root), "--set", "model.embed_dim=16",
                    "decoder.hidden_dim=16"])
    lines = capsys.readouterr().out.strip().splitlines()
    for arch, line in zip(("ltd_bound", "vsepp"), lines[1:], strict=True):
        found = re.match(rf"{arch} assembly ([\d.]+) ms step ([\d.]+) ms ratio ([\d.]+) "
                         r"\(per-pair path ([\d.]+) ms: ([\d.]+)x; epoch plan", line)
        assert found, line
        assert float(found[3]) == pytest.approx(float(found[1]) / float(found[2]), rel=0.05,
                                                abs=1e-4)


def test_paper_scale_writes_a_precomputed_folder_the_loader_reads(tmp_path):
    """COCO's shapes and formats at a small count: 36 x 2048 float32 regions, 5 captions an
    image, ids; validation and test a twentieth of the training images (at least 10)."""
    from icr.data.precomp import load_precomp

    load("paper_scale").write_folder(tmp_path, images=240)
    train, val = load_precomp(tmp_path, "train"), load_precomp(tmp_path, "val")
    assert train.features.shape == (240, 36, 2048) and train.features.dtype == np.float32
    assert isinstance(train.features, np.memmap)
    assert train.images.num_captions == 1200 and val.images.num_images == 12
    words = [len(c.split()) for c in train.images.captions]
    assert 9.5 < np.mean(words) < 11.5  # COCO's 10.5
    assert train.features[:5].min() >= 0 and train.features[:5].max() > 0
    load("paper_scale").write_folder(tmp_path / "sparse", images=240, sparse=True)
    sparse = load_precomp(tmp_path / "sparse", "train")
    assert sparse.features.shape == (240, 36, 2048) and not sparse.features[::40].any()
    allocated = (tmp_path / "sparse" / "train_ims.npy").stat().st_blocks * 512
    assert allocated < train.features.nbytes / 10  # holes: no disk for the features


@pytest.mark.slow
def test_paper_scale_runs_trials_at_once_and_reports_memory_and_start(tmp_path, capsys):
    """Two trials at once of a small model on a small folder: the printed row's figures."""
    load("paper_scale").main([
        "--folder", str(tmp_path), "--write", "--images", "60", "--trials", "2", "--steps", "2",
        "--set", "model.embed_dim=16", "text.hidden_dim=16", "image.hidden_dim=16",
        "image.output_dim=16", "text.word_dim=8", "train.batch_size=16"])
    out = capsys.readouterr().out
    row = re.search(r"2 trial\(s\) at once: start ([\d.]+) s \(slowest\), anonymous memory "
                    r"([\d.]+) GB each at most, ([\d.]+) GB together; file-backed ([\d.]+) GB "
                    r"each at most; PSS ([\d.]+) GB together", out)
    assert row, out
    assert float(row[1]) > 0 and 0 < float(row[2]) <= float(row[3])
    assert float(row[4]) > 0 and float(row[5]) > 0
    assert "training features resident on cpu" in out
    assert re.search(r"by stage: imports [\d.]+, task built [\d.]+, first batch [\d.]+, steps", out)


def test_paper_scale_reads_the_kinds_of_memory_of_a_process():
    """A hand-written smaps_rollup: 3 GiB resident of which 1 GiB anonymous, PSS 2 GiB."""
    rollup = ("00400000-7fff0000 ---p 00000000 00:00 0  [rollup]\n"
              f"Rss:             {3 * 2**20} kB\nPss:             {2 * 2**20} kB\n"
              f"Pss_Anon:        {2**20} kB\nAnonymous:       {2**20} kB\n")
    kinds = load("paper_scale").memory_kinds(rollup)
    assert kinds == {"anon_gb": 1.0, "file_gb": 2.0, "pss_gb": 2.0}


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_plan_estimate_compares_the_calibrated_estimate_with_a_measured_time(capsys, workspace):
    """The estimate of ltd_bound --smoke from one timed step per phase, against a given time."""
    load("plan_estimate").main(["--steps", "1", "--measured", "60", "--workspace",
                                str(workspace.root)])
    out = capsys.readouterr().out
    assert out.count("calibrated:") == 3
    assert "ltd_bound --recipe smoke: estimated" in out and "estimate / measured =" in out


def test_scheduling_scale_spreads_gpus_over_nodes():
    """A head and at least one joining node, at most the given GPUs a node, as even as can be."""
    scale = load("scheduling_scale")
    assert [scale.node_gpus(n, 8) for n in (2, 4, 8, 12, 16, 32)] == [
        (1, 1), (2, 2), (4, 4), (6, 6), (8, 8), (8, 8, 8, 8)]
    assert scale.node_gpus(20, 8) == (7, 7, 6)
    with pytest.raises(ValueError):
        scale.node_gpus(1, 8)


def test_scheduling_scale_row_from_hand_made_records():
    """The row of a search of 40 s on 2 GPUs, 4 trials of 2 epochs x 5 s (ideal 12 trials/min),
    from records made by hand: every cell against its arithmetic."""
    scale = load("scheduling_scale")
    start = scale.Stamp(wall=100.0, epoch=1000.0, cpu=1.0, load=0.5, line="search ...")
    end = scale.Stamp(wall=140.0, epoch=1040.0, cpu=3.0, load=0.7, line="confirm: ...")
    runs = (scale.TrialRun(1002.0, 1012.0, (1007.0, 1012.0), True),  # lives 10, 10, 12, 24
            scale.TrialRun(1004.0, 1014.0, (1009.0, 1014.0), True),  # epoch gaps 5, 5, 6, 12
            scale.TrialRun(1012.0, 1024.0, (1018.0, 1024.0), True),
            scale.TrialRun(1014.0, 1038.0, (1026.0, 1038.0), False))
    row = scale.Row(2, 2, 4, 2, 5.0, start, end, runs)
    assert dict(zip(scale.COLUMNS, row.cells(), strict=True)) == {
        "GPUs": "2", "nodes": "2", "finished": "3/4", "search s": "40",
        "all up s": "4",  # the second trial's actor came up 4 s into the search
        "GPUs busy": "70 %",  # 56 s of trials over 2 x 40 s
        "trial s": "14.0 (10)", "epoch s": "7.00 (5)",
        "trials/min": "4.5", "ideal/min": "12.0", "of ideal": "37.5 %",
        "driver CPU": "5 %", "driver ms/result": "250",  # 2 s of CPU, 8 results
        "load 1m": "0.7"}


def test_scheduling_scale_tells_a_trial_stopped_for_memory_from_a_bug():
    """Tune raises RuntimeError from Ray's OutOfMemoryError (a row says so); any other
    RuntimeError is a bug and goes on up."""
    from ray.exceptions import OutOfMemoryError

    scale = load("scheduling_scale")
    try:
        try:
            raise OutOfMemoryError("3 worker(s) were killed due to the node running low on memory")
        except OutOfMemoryError as oom:
            raise RuntimeError(f"Caught unexpected exception: {oom}") from oom
    except RuntimeError as tune_error:
        assert scale.killed_for_memory(tune_error)
    assert not scale.killed_for_memory(RuntimeError("something else"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_scheduling_scale_on_the_smallest_cluster(capsys):
    """The benchmark end to end on a head and a joining node of one fake GPU each: 4 search
    trials of 2 short epochs through the real driver, one row, every trial finished with the
    full budget (its timings are not tested)."""
    scale = load("scheduling_scale")
    assert scale.main(["--concurrency", "2", "--epochs", "2", "--epoch-seconds", "0.2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, align, row = (r.strip("| ").split(" | ") for r in rows)
    assert header == list(scale.COLUMNS) and len(align) == len(header)
    cells = dict(zip(header, row, strict=True))  # a skipped cluster has 3 cells: it fails here
    assert (cells["GPUs"], cells["nodes"], cells["finished"]) == ("2", "2", "4/4")
    assert cells["of ideal"].endswith(" %") and cells["trial s"].endswith(" (0.4)")


@pytest.mark.slow
def test_process_start_prints_both_ways_for_both_processes(capsys):
    """The start benchmark end to end on one repeat: a row per kind of process, with the CPU
    seconds of both ways and their ratio."""
    load("process_start").main(["--repeats", "1"])
    rows = re.findall(r"^\| (plan|trial) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      capsys.readouterr().out, re.M)
    assert [r[0] for r in rows] == ["plan", "trial"]
    for _, now, before, ratio in rows:
        assert float(now) > 0 and float(before) > 0
        assert float(ratio) == pytest.approx(float(before) / float(now), abs=0.01)


def test_frozen_features_times_both_ways_per_size():
    """benchmarks/frozen_features.py --smoke: one row per image size, its speed-up the ratio of
    the two epoch times it prints (the real EfficientNet-Lite0 weights; timings not tested)."""
    threads = torch.get_num_threads()
    try:
        rows = load("frozen_features").main(["--smoke", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert [row["size"] for row in rows] == [32]
    for row in rows:
        assert row["recompute"] > 0 and row["cached"] > 0 and row["build"] > 0
        assert row["ratio"] == pytest.approx(row["recompute"] / row["cached"])


@pytest.mark.slow
def test_search_efficiency_sets_the_search_beside_the_papers_grid(capsys, tmp_path):
    """The benchmark end to end on the tiny preset: the paper's six etas at the full budget and
    the platform's search, both through the real Tune runs, and the ratios of the two."""
    bench = load("search_efficiency")
    bench.main(["--smoke", "--workspace", str(tmp_path)])
    out = capsys.readouterr().out
    epochs = int(re.search(r"preset tiny, (\d+) epochs per trial", out)[1])
    grid = re.search(r"grid +\(6 etas, full budget\): best val rsum ([\d.]+) at eta ([\d.]+), "
                     r"(\d+) epochs", out)
    found = re.search(r"search \((\d+) trials, ASHA\): +best val rsum ([\d.]+) at eta "
                      r"([\d.]+), (\d+) epochs", out)
    assert float(grid[2]) in bench.GRID and int(grid[3]) == len(bench.GRID) * epochs
    assert 1 <= int(found[4]) <= int(found[1]) * epochs
    ratios = re.search(r"search / grid: best ([\d.]+), epochs ([\d.]+)", out)
    # Both bests are printed to 2 decimals, their ratio to 4 from the unrounded values.
    assert float(ratios[1]) == pytest.approx(float(found[2]) / float(grid[1]), rel=1e-3)
    assert float(ratios[2]) == pytest.approx(int(found[4]) / int(grid[3]), abs=0.01)


@pytest.mark.slow
def test_trial_overhead_times_the_same_epochs_in_process_and_under_tune(capsys, tmp_path):
    """The benchmark end to end on the tiny preset: both runs report every epoch, and the ratio
    is that of the two means after the first epoch (its timings are not tested)."""
    threads = torch.get_num_threads()
    try:
        times = load("trial_overhead").main(["--preset", "tiny", "--epochs", "2",
                                             "--workspace", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    local, tuned = times["local"], times["tuned"]
    assert len(local) == len(tuned) == 2 and min(local + tuned) > 0
    out = capsys.readouterr().out
    assert f"in-process epoch times (s): {local[0]:.2f}, {local[1]:.2f}" in out
    assert f"Ray Tune   epoch times (s): {tuned[0]:.2f}, {tuned[1]:.2f}" in out
    assert f"ratio Ray Tune / in-process: {tuned[1] / local[1]:.3f}" in out


def test_epoch_cost_under_load_prints_both_costs_alone_and_loaded(capsys, workspace):
    """benchmarks/epoch_cost_under_load.py on the tiny preset with one busy process: both costs,
    alone and loaded, each ratio the quotient of the two figures printed beside it."""
    bench = load("epoch_cost_under_load")
    measured = bench.main(["--preset", "tiny", "--epochs", "1", "--busy", "1",
                           "--workspace", str(workspace.root)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "1 busy process(es)" in lines[0]
    for name, line in zip(("epoch_time_s", "epoch_cpu_s"), lines[1:], strict=True):
        found = re.match(rf"\s*{name}: alone ([\d.]+) s, loaded ([\d.]+) s, ratio loaded / alone "
                         r"([\d.]+)$", line)
        assert found, line
        assert float(found[3]) == pytest.approx(float(found[2]) / float(found[1]), rel=0.05,
                                                abs=0.02)
    (wall, cpu), (wall_loaded, cpu_loaded) = measured["alone"], measured["loaded"]
    assert min(wall, cpu, wall_loaded, cpu_loaded) > 0
