"""COCOS counters on hand-built similarity matrices, and over a split against a batch loop."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from icr.analysis.cocos import (
    COCOS_COUNTERS,
    COCOS_KEYS,
    build_counter,
    cocos_over_split,
    smoothap_contributing_counts,
    summarize_batches,
    triplet_active_counts,
)
from icr.data.sampler import ImageBatchSampler, PairBatchSampler
from icr.errors import ConfigError

SIMS_3X3 = torch.tensor([[0.9, 0.8, 0.1], [0.25, 0.5, 0.6], [0.2, 0.4, 0.7]], dtype=torch.float64)
# margin 0.2, active when 0.2 + s- - s+ > 0:
#   rows (image queries): row 0: 0.8 yes, 0.1 no;  row 1: 0.25 no, 0.6 yes;  row 2: none
#   cols (caption queries): col 0: none;  col 1: 0.8 yes, 0.4 yes;  col 2: 0.1 no, 0.6 yes


def _summary(prefix, contributing, contributing_all, total, zero):
    return {
        f"{prefix}contributing": contributing,
        f"{prefix}contributing_nonempty": contributing,
        f"{prefix}contributing_all": contributing_all,
        f"{prefix}batch_total": total,
        f"{prefix}zero_queries": zero,
    }


# ---------------------------------------------------------------- triplet


def test_triplet_all_hand_counts():
    i2t, t2i = triplet_active_counts(SIMS_3X3, margin=0.2, hardest=False)
    assert i2t.tolist() == [1, 1, 0] and t2i.tolist() == [0, 2, 1]
    got = COCOS_COUNTERS.get("triplet_all")(SIMS_3X3, margin=0.2)
    want = _summary("i2t_", 1.0, 2 / 3, 2.0, 1.0) | _summary("t2i_", 1.5, 1.0, 3.0, 1.0)
    assert got == pytest.approx(want)


def test_triplet_sh_counts_the_hardest_negative_only():
    i2t, t2i = triplet_active_counts(SIMS_3X3, margin=0.2, hardest=True)
    assert i2t.tolist() == [1, 1, 0] and t2i.tolist() == [0, 1, 1]
    got = COCOS_COUNTERS.get("triplet")(SIMS_3X3, margin=0.2)
    want = _summary("i2t_", 1.0, 2 / 3, 2.0, 1.0) | _summary("t2i_", 1.0, 2 / 3, 2.0, 1.0)
    assert got == pytest.approx(want)


def test_triplet_margin_and_shared_images():
    # margin 0: only negatives scoring above the positive: row 1 (0.6 > 0.5), col 1 (0.8 > 0.5)
    i2t, t2i = triplet_active_counts(SIMS_3X3, margin=0.0, hardest=False)
    assert i2t.tolist() == [0, 1, 0] and t2i.tolist() == [0, 1, 0]
    # pairs 1 and 2 share an image: (1, 2) and (2, 1) are not negatives
    i2t, t2i = triplet_active_counts(SIMS_3X3, torch.tensor([0, 1, 1]), margin=0.2, hardest=False)
    assert i2t.tolist() == [1, 0, 0] and t2i.tolist() == [0, 1, 0]


# ---------------------------------------------------------------- NT-Xent


def ntxent_loop(sims: list[list[float]], tau: float, eps: float) -> dict[str, list[float]]:
    """Per query C^{qv-}, W^{qv-} and 1 - p_pos with plain exps (all images distinct)."""
    n = len(sims)
    out: dict[str, list[float]] = {}
    for prefix, rows in (("i2t", sims), ("t2i", [list(c) for c in zip(*sims, strict=True)])):
        counts, weights, positives = [], [], []
        for q in range(n):
            z = sum(math.exp(s / tau) for s in rows[q])
            negative = [math.exp(rows[q][j] / tau) / z for j in range(n) if j != q]
            counts.append(sum(w > eps for w in negative))
            weights.append(sum(w for w in negative if w > eps))
            positives.append(1 - math.exp(rows[q][q] / tau) / z)
        out[prefix] = [counts, weights, positives]
    return out


def test_ntxent_hand_counts_and_loop_weights():
    # tau 0.1, weights of the negatives (hand-computed):
    #   rows: 0: 0.2689, 0.0002 -> 1;  1: 0.0216, 0.7153 -> 2;  2: 0.0064, 0.0471 -> 1
    #   cols: 0: 0.0015, 0.0009 -> 0;  1: 0.936, 0.017 -> 2;  2: 0.0018, 0.268 -> 1
    got = COCOS_COUNTERS.get("infonce")(SIMS_3X3, tau=0.1, eps=0.01)
    loop = ntxent_loop(SIMS_3X3.tolist(), tau=0.1, eps=0.01)
    assert loop["i2t"][0] == [1, 2, 1] and loop["t2i"][0] == [0, 2, 1]
    for d in ("i2t", "t2i"):
        counts, weights, positives = (np.array(x, dtype=float) for x in loop[d])
        assert got[f"{d}_contributing_all"] == pytest.approx(counts.mean())
        assert got[f"{d}_contributing"] == pytest.approx(counts[counts > 0].mean())
        assert got[f"{d}_contributing_nonempty"] == got[f"{d}_contributing"]
        assert got[f"{d}_zero_queries"] == (counts == 0).sum()
        assert got[f"{d}_negative_weight"] == pytest.approx(weights.mean(), rel=1e-12)
        assert got[f"{d}_positive_weight"] == pytest.approx(positives.mean(), rel=1e-12)
    assert got["i2t_negative_weight"] == pytest.approx(
        (0.268877 + 0.736865 + 0.047123) / 3, abs=1e-5
    )


def test_ntxent_excludes_pairs_sharing_an_image():
    # with pairs 1 and 2 sharing an image, row 1 keeps only col 0 as negative (weight 0.076)
    got = COCOS_COUNTERS.get("infonce")(SIMS_3X3, torch.tensor([0, 1, 1]), tau=0.1, eps=0.01)
    assert got["i2t_contributing_all"] == pytest.approx((1 + 1 + 0) / 3)
    w_row1 = math.exp(2.5) / (math.exp(2.5) + math.exp(5.0))
    w_row0 = math.exp(8.0) / (math.exp(9.0) + math.exp(8.0) + math.exp(1.0))
    assert got["i2t_negative_weight"] == pytest.approx((w_row0 + w_row1) / 3, rel=1e-9)


# ---------------------------------------------------------------- SmoothAP

# Images A (captions c0, c1) and B (c2, c3); images x captions:
#   A: 0.9 0.9 0.2 0.0      B: 0.9 0.3 0.3 0.3
# tau 0.01: a tie gives G = 1/2 and G' = 0.25 / tau = 25; a gap of 0.3 or more gives G' < 1e-9,
# a gap of 0.1 gives G' = sigma(10)(1 - sigma(10)) / tau = 0.0045 < 0.01.
#   A, positive c0: c1 ties (R = 1 + 1/2 = 1.5), weight 25 / 2.25 = 11.1 -> 1; c1 likewise -> 1
#   B, positive c2: c0 above, c1 and c3 tie (R = 1 + 1 + 1 = 3), weight 25 / 9 = 2.8 -> 2;
#      c3 likewise -> 2
#   captions: c0 ties A with B (R = 1.5) -> 1; c1, c2, c3: gaps of 0.6, 0.1, 0.3 -> 0
SMOOTHAP_MATRIX = torch.tensor([[0.9, 0.9, 0.2, 0.0], [0.9, 0.3, 0.3, 0.3]], dtype=torch.float64)
SMOOTHAP_CAPTION_IMAGE = [0, 0, 1, 1]


def _smoothap_pairs():
    return SMOOTHAP_MATRIX[SMOOTHAP_CAPTION_IMAGE], torch.tensor([5, 5, 9, 9])


def test_smoothap_hand_counts():
    sims, ids = _smoothap_pairs()
    i2t, t2i = smoothap_contributing_counts(sims, ids, tau=0.01, eps=0.01)
    assert i2t.tolist() == [1.0, 2.0] and t2i.tolist() == [1.0, 0.0, 0.0, 0.0]
    got = COCOS_COUNTERS.get("smoothap")(sims, ids, tau=0.01, eps=0.01)
    want = _summary("i2t_", 1.5, 1.5, 3.0, 0.0) | _summary("t2i_", 1.0, 0.25, 1.0, 3.0)
    assert got == pytest.approx(want)


def test_smoothap_weight_has_the_rank_and_the_temperature():
    # eps 5: A's weights 11.1 pass, B's 2.8 do not (the 1 / R^2 of Eq. 13). Without the 1/tau of
    # G' (the ECIR code), every weight would be at most 0.25 and nothing would pass.
    sims, ids = _smoothap_pairs()
    i2t, t2i = smoothap_contributing_counts(sims, ids, tau=0.01, eps=5.0)
    assert i2t.tolist() == [1.0, 0.0] and t2i.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_smoothap_one_query_per_image():
    # the same batch with each pair of A listed again: still two image queries
    sims, ids = _smoothap_pairs()
    order = [0, 1, 2, 3, 0, 1]  # captions c0 and c1 twice: they are then 4 positives of A
    i2t, t2i = smoothap_contributing_counts(sims[order][:, order], ids[order], tau=0.01)
    assert len(i2t) == 2 and len(t2i) == 6


# ---------------------------------------------------------------- registry, split


def test_counters_for_every_loss_of_the_paper():
    assert {"triplet", "triplet_all", "infonce", "smoothap"} <= set(COCOS_COUNTERS.names())
    with pytest.raises(ConfigError, match="margin"):
        build_counter("infonce", margin=0.2)
    with pytest.raises(ConfigError, match="unknown COCOS counter"):
        build_counter("nt_xent")


@pytest.mark.parametrize("name", COCOS_COUNTERS.names())
def test_every_counter_counts_a_registered_loss_on_its_training_batches(name):
    from icr.losses import LOSSES

    assert name in LOSSES
    assert COCOS_COUNTERS.meta(name)["sampler"] in ("pairs", "images")
    options = set(inspect.signature(COCOS_COUNTERS.get(name)).parameters) - {"sims", "image_ids"}
    assert options <= {*LOSSES.options(name), "eps"}


def test_smoothap_is_counted_over_image_batches_as_the_paper_trains_it():
    # section 5: SmoothAP trains on batches of 128 images with all their captions
    assert COCOS_COUNTERS.meta("smoothap")["sampler"] == "images"


def _split(n_img: int = 30, per_image: int = 5, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    caption_image = torch.arange(n_img).repeat_interleave(per_image)
    caption_image = caption_image[torch.randperm(len(caption_image), generator=g)]
    images = F.normalize(torch.randn(n_img, dim, generator=g, dtype=torch.float64), dim=1)
    noise = torch.randn(len(caption_image), dim, generator=g, dtype=torch.float64)
    captions = F.normalize(images[caption_image] + 0.8 * noise, dim=1)
    return images, captions, caption_image


@pytest.mark.parametrize("loss", COCOS_COUNTERS.names())
def test_over_split_is_mean_and_std_over_training_batches(loss):
    images, captions, caption_image = _split()
    got = cocos_over_split(images, captions, caption_image, loss, batch_size=8, seed=3)
    if COCOS_COUNTERS.meta(loss)["sampler"] == "images":
        sampler = ImageBatchSampler(caption_image, 8, seed=3)
    else:
        sampler = PairBatchSampler(caption_image, 8, seed=3)
    rows = []
    for batch in sampler:
        idx = caption_image[batch]
        rows.append(COCOS_COUNTERS.get(loss)(images[idx] @ captions[batch].t(), idx))
    assert got["cocos_batches"] == len(rows) == len(sampler)
    assert {f"{d}_{k}" for d in ("i2t", "t2i") for k in COCOS_KEYS} <= set(rows[0])
    assert {f"cocos_{k}_{s}" for k in rows[0] for s in ("mean", "std")} | {"cocos_batches"} \
        == set(got)
    for key in rows[0]:
        values = np.array([row[key] for row in rows])
        assert not np.isnan(values).any() or key.endswith("_contributing_nonempty")
        values = values[~np.isnan(values)]
        assert got[f"cocos_{key}_mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert got[f"cocos_{key}_std"] == pytest.approx(values.std(), rel=1e-12, abs=1e-12)
    assert got["cocos_i2t_contributing_all_std"] > 0  # batches differ: the std is measured


def test_over_split_of_a_perfect_encoder_counts_no_triplet():
    caption_image = torch.arange(16).repeat_interleave(2)
    images = torch.eye(16, dtype=torch.float64)
    got = cocos_over_split(images, images[caption_image], caption_image, "triplet", batch_size=8)
    assert got["cocos_i2t_zero_queries_mean"] == 8 and got["cocos_t2i_batch_total_mean"] == 0
    assert got["cocos_i2t_contributing_mean"] == 0.0  # no batch has a contributing query: 0s
    assert got["cocos_i2t_contributing_std"] == 0.0
    assert math.isnan(got["cocos_i2t_contributing_nonempty_mean"])  # nothing left to average


# SmoothAP batches where caption queries (one positive each) have no contributing image: with
# tau 0.01, a caption's own image 0.6 or more above the other gives G' < 1e-20.
#   batch A = SMOOTHAP_MATRIX: caption c0 ties A with B -> C^q = 1, the others 0: t2i C^q 1.0
#   batch B: every caption far from the other image -> no caption query contributes
SMOOTHAP_FAR = torch.tensor([[0.9, 0.9, 0.1, 0.0], [0.2, 0.1, 0.9, 0.95]], dtype=torch.float64)


def test_batches_without_a_contributing_query_count_zero_in_the_mean():
    sims_a, ids = _smoothap_pairs()
    sims_b = SMOOTHAP_FAR[SMOOTHAP_CAPTION_IMAGE]
    counter = COCOS_COUNTERS.get("smoothap")
    row_a, row_b = counter(sims_a, ids, tau=0.01), counter(sims_b, ids, tau=0.01)
    assert row_b["t2i_zero_queries"] == 4 and row_b["t2i_contributing"] == 0.0
    assert math.isnan(row_b["t2i_contributing_nonempty"])
    got = summarize_batches([row_a, row_b, row_b])
    # the notebooks' mean over batches: (1 + 0 + 0) / 3, std of (1, 0, 0)
    assert got["cocos_t2i_contributing_mean"] == pytest.approx(1 / 3)
    assert got["cocos_t2i_contributing_std"] == pytest.approx(math.sqrt(2) / 3)
    # the batches that have a contributing query only: batch A
    assert got["cocos_t2i_contributing_nonempty_mean"] == 1.0
    assert got["cocos_t2i_contributing_nonempty_std"] == 0.0
    # image queries contribute in every batch (each image's positives score close): equal means
    assert got["cocos_i2t_contributing_mean"] == got["cocos_i2t_contributing_nonempty_mean"]
    assert got["cocos_batches"] == 3


@pytest.mark.parametrize(("name", "option"), [("triplet", {"margin": 0.5}), ("infonce", {"tau": 0.3})])
def test_live_cocos_counts_with_the_losss_options_from_the_config(name, option):
    # The loss, its warm-up form and its counters read their options in one place
    # (icr.losses.contrastive.config_options): the counter sees the run's margin / tau.
    from icr.config import from_flat
    from icr.losses import config_options
    from icr.train.retrieval import live_cocos

    config = from_flat({"loss.name": name, **{f"loss.{k}": v for k, v in option.items()}})
    assert config_options(config.loss) == option
    live = live_cocos(config)(SIMS_3X3, None)
    expected = build_counter(name, **option)(SIMS_3X3)
    assert live == {f"cocos_{k}": v for k, v in expected.items() if not math.isnan(v)}
    default = build_counter(name)(SIMS_3X3)
    assert any(default[k] != expected[k] for k in expected)  # the option changes the counts
