"""The training data path (caption tables, image stores, icr.data.batches) against plain loops,
torchvision and the tokenizer: what a batch holds, whatever the placement of the data."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

from icr.data.batches import TrainingBatches
from icr.data.captions import VocabInput, WordpieceInput, word_dropout
from icr.data.images import (
    ERASING_ATTEMPTS,
    SplitImages,
    erase,
    erasing_boxes,
    erasing_boxes_from,
    place_images,
)
from icr.data.pipeline import imagenet_normalize
from icr.data.vocab import Vocabulary
from icr.models.tokens import load_bert_tokenizer

CAPTIONS = [
    "a small red circle left of a big blue square",
    "two striped triangles",
    "a",
    "zebra's hat is quite nice and striped today, isn't it?",
    "the quadrilateral above the dotted hexagon is green and the circle is tiny",
    "",
    "one two three four five six seven eight nine ten eleven twelve",
]


# ---------------------------------------------------------------- word dropout: the oracle


def dropout_loop(words: list[list[int]], u_unk: list[float], u_delete: list[float], unk: int,
                 unk_prob: float, delete_prob: float) -> list[int]:
    """augment_caption's semantics on one caption of words made of pieces, given its uniforms:
    a word becomes one unk piece where u_unk < p; the int(n p) words of smallest u_delete
    (ties by position) are deleted."""
    kept = [[unk] if u_unk[i] < unk_prob else w for i, w in enumerate(words)]
    deleted = set(sorted(range(len(words)), key=lambda i: (u_delete[i], i))[
        : int(len(words) * delete_prob)])
    return [p for i, w in enumerate(kept) if i not in deleted for p in w]


def _uniforms(table, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (len(table), int(table.num_words.max()))
    return torch.rand(shape, generator=g), torch.rand(shape, generator=g)


def _words(table, c: int) -> list[list[int]]:
    pieces, owner = table.pieces[c].tolist(), table.piece_word[c].tolist()
    words: list[list[int]] = [[] for _ in range(int(table.num_words[c]))]
    for p, w in zip(pieces, owner, strict=True):
        if w >= 0:
            words[w].append(p)
    return words


@pytest.fixture(scope="module")
def vocab_input():
    return VocabInput(Vocabulary.build(CAPTIONS), max_len=9, unk_prob=0.3, delete_prob=0.3)


@pytest.fixture(scope="module")
def wordpiece_input():
    return WordpieceInput(load_bert_tokenizer(), max_len=12, unk_prob=0.3, delete_prob=0.3)


@pytest.mark.parametrize("unk_prob, delete_prob", [(0.3, 0.3), (0.0, 0.5), (0.9, 0.0), (0.1, 0.1)])
@pytest.mark.parametrize("kind", ["vocab", "wordpiece"])
def test_word_dropout_of_a_whole_table_equals_the_loop(kind, unk_prob, delete_prob, vocab_input,
                                                       wordpiece_input, request):
    table = (vocab_input if kind == "vocab" else wordpiece_input).table(CAPTIONS)
    u_unk, u_delete = _uniforms(table, seed=3)
    pieces, count = word_dropout(table.pieces, table.piece_word, table.num_words, u_unk,
                                 u_delete, unk_id=table.unk, unk_prob=unk_prob,
                                 delete_prob=delete_prob)
    changed = 0
    for c in range(len(table)):
        n = int(table.num_words[c])
        want = dropout_loop(_words(table, c), u_unk[c, :n].tolist(), u_delete[c, :n].tolist(),
                            table.unk, unk_prob, delete_prob)
        assert pieces[c, : count[c]].tolist() == want
        assert not pieces[c, count[c]:].any()  # padding
        changed += want != [p for w in _words(table, c) for p in w]
    assert changed >= 2  # the comparison bites


def test_augmented_wordpieces_are_what_the_tokenizer_makes_of_the_augmented_words(
        wordpiece_input):
    """The old path augmented the words, joined them and tokenised the string with truncation;
    the table must give the same ids for the same decisions."""
    tok, table = wordpiece_input.tokenizer, wordpiece_input.table(CAPTIONS)
    u_unk, u_delete = _uniforms(table, seed=5)
    pieces, count = word_dropout(table.pieces, table.piece_word, table.num_words, u_unk,
                                 u_delete, unk_id=table.unk, unk_prob=0.3, delete_prob=0.3)
    from icr.data.captions import _wrap

    tokens, lengths = _wrap(pieces, count, table.begin, table.end, table.max_pieces)
    for c, caption in enumerate(CAPTIONS):
        words = caption.split()
        n = len(words)
        kept = [tok.unk_token if u_unk[c, i] < 0.3 else w for i, w in enumerate(words)]
        deleted = set(sorted(range(n), key=lambda i: (float(u_delete[c, i]), i))[: int(n * 0.3)])
        text = " ".join(w for i, w in enumerate(kept) if i not in deleted)
        want = tok(text, truncation=True, max_length=12)["input_ids"]
        assert tokens[c, : lengths[c]].tolist() == want


def test_clean_ids_are_the_inputs_own_ids(vocab_input, wordpiece_input):
    for source in (vocab_input, wordpiece_input):
        tokens, lengths = source.table(CAPTIONS).clean()
        for c, caption in enumerate(CAPTIONS):
            assert tokens[c, : lengths[c]].tolist() == source.ids(caption).tolist()
            assert not tokens[c, lengths[c]:].any()


def test_augmentation_rates(vocab_input):
    """Over many draws: exactly int(n p) words deleted from every caption, and a word replaced by
    <unk> with probability p (binomial bounds at 5 standard deviations)."""
    table = VocabInput(vocab_input.vocab, 40, 0.2, 0.1).table(CAPTIONS * 300)
    g = torch.Generator().manual_seed(0)
    tokens, lengths = table.augmented(g, 0.2, 0.1)
    n = table.num_words
    assert torch.equal(lengths, n - torch.floor(n.double() * 0.1).long() + 2)
    unk = int((tokens == table.unk).sum())
    words = int((lengths - 2).sum())
    sd = math.sqrt(words * 0.2 * 0.8)
    assert abs(unk - 0.2 * words) < 5 * sd


def test_a_tokenizer_that_splits_words_by_context_is_refused():
    class Contextual:  # the second word's pieces depend on the first: not word-separable
        pad_token_id, cls_token_id, sep_token_id, unk_token_id, unk_token = 0, 1, 2, 3, "?"

        def __call__(self, text, truncation=False, max_length=None, add_special_tokens=True):
            if isinstance(text, list):
                return {"input_ids": [[10 + len(w)] for w in text]}
            ids = [10 + len(w) + i for i, w in enumerate(text.split())]
            return {"input_ids": [1, *ids, 2]}

    from icr.errors import ConfigError

    with pytest.raises(ConfigError, match="WordPiece"):
        WordpieceInput(Contextual(), 10, 0.0, 0.0).table(["ab cd"])


# ---------------------------------------------------------------- random erasing


def torchvision_box(u_area, u_ratio, u_top, u_left, height, width):
    """torchvision's RandomErasing._get_params, written out, on given uniforms."""
    area = height * width
    log_lo, log_hi = math.log(0.3), math.log(3.3)
    for a, r, t, left in zip(u_area, u_ratio, u_top, u_left, strict=True):
        erase_area = area * (0.02 + 0.31 * a)
        aspect = math.exp(log_lo + (log_hi - log_lo) * r)
        h = int(round(math.sqrt(erase_area * aspect)))
        w = int(round(math.sqrt(erase_area / aspect)))
        if not (h < height and w < width):
            continue
        return [int(t * (height - h + 1)), int(left * (width - w + 1)), h, w]
    return [0, 0, 0, 0]


@pytest.mark.parametrize("height, width", [(16, 16), (8, 24), (3, 3)])
def test_erasing_boxes_follow_torchvisions_algorithm(height, width):
    g = torch.Generator().manual_seed(1)
    n = 400
    u_apply = torch.rand(n, generator=g, dtype=torch.float64)
    u = [torch.rand(n, ERASING_ATTEMPTS, generator=g, dtype=torch.float64) for _ in range(4)]
    boxes = erasing_boxes_from(u_apply, *u, height, width, p=0.5)
    for i in range(n):
        want = torchvision_box(*(x[i].tolist() for x in u), height, width)
        assert boxes[i].tolist() == (want if u_apply[i] < 0.5 else [0, 0, 0, 0])


def test_erasing_matches_torchvision_in_distribution():
    """The erased share of the image and how often something is erased, against torchvision's
    own RandomErasing on 2,000 images (different random streams: means within 5 sd)."""
    from torchvision.transforms import v2

    n, size = 2000, 16
    torch.manual_seed(0)
    ours = erase(torch.ones(n, 1, size, size),
                 erasing_boxes(n, size, size, 0.5, torch.Generator().manual_seed(2)))
    theirs = torch.stack([v2.RandomErasing(p=0.5)(torch.ones(1, size, size)) for _ in range(n)])
    for images in (ours, theirs):
        assert images.shape == (n, 1, size, size)
    share = [(x == 0).float().mean(dim=(1, 2, 3)) for x in (ours, theirs)]
    erased = [(s > 0).float().mean() for s in share]
    assert abs(erased[0] - erased[1]) < 5 * math.sqrt(0.25 / n) * math.sqrt(2)
    sd = share[1].std() / math.sqrt(n) * math.sqrt(2)
    assert abs(share[0].mean() - share[1].mean()) < 5 * sd


# ---------------------------------------------------------------- images: rows, boxes, placement


def test_split_images_read_the_split_order_and_append_scaled_boxes_without_a_copy(tmp_path):
    g = np.random.default_rng(0)
    features = g.standard_normal((5, 3, 4)).astype(np.float32)
    boxes = g.uniform(0, 64, (5, 3, 4)).astype(np.float32)
    np.save(tmp_path / "f.npy", features)
    mapped = np.load(tmp_path / "f.npy", mmap_mode="r")
    rows = np.array([4, 0, 2])
    images = SplitImages(mapped, rows, boxes / 64)
    assert images.shape == (3, 3, 8) and images.nbytes == 3 * 3 * 8 * 4
    got = images.take([2, 0])
    want = np.concatenate([features[[2, 4]], boxes[[2, 4]] / 64], axis=-1)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    assert isinstance(images.array, np.memmap)  # the file stays mapped


def test_placement_fills_the_budget_in_order():
    small = SplitImages(np.zeros((10, 4), dtype=np.float32))  # 160 bytes
    stores = place_images({"train": small, "val": small, "test": small}, torch.device("cpu"), 350)
    assert [s.resident for s in stores.values()] == [True, True, False]
    for store in stores.values():
        assert torch.equal(store.rows(2, 5), torch.zeros(3, 4))


# ---------------------------------------------------------------- TrainingBatches


def _batches(budget: float = 1e9, prefetch: bool | None = None, pixels: bool = False,
             sampler: str = "pairs", erasing: float = 0.0, targets: str = "device",
             unk_prob: float = 0.0, delete_prob: float = 0.0, seed: int = 0,
             static_shapes: bool = False):
    g = np.random.default_rng(1)
    caption_image = np.repeat(np.arange(12), 3)  # 36 captions, 3 per image
    if pixels:
        array = g.integers(0, 256, (12, 3, 8, 8)).astype(np.uint8)
    else:
        array = g.standard_normal((12, 4, 6)).astype(np.float32)
    store = place_images({"train": SplitImages(array)}, torch.device("cpu"), budget)["train"]
    captions = [CAPTIONS[i % len(CAPTIONS)] + f" {i}" for i in range(len(caption_image))]
    source = VocabInput(Vocabulary.build(captions), 12, unk_prob, delete_prob)
    table = source.table(captions)
    target_array = g.standard_normal((36, 5)).astype(np.float32)
    target = torch.from_numpy(target_array) if targets == "device" else target_array
    return TrainingBatches(
        images=store, caption_image=caption_image, captions=table, clean=table,
        targets=target, sampler=sampler, batch_size=4 if sampler == "images" else 8,
        epoch_unit="captions", seed=seed, unk_prob=unk_prob, delete_prob=delete_prob,
        random_erasing=erasing, normalize=imagenet_normalize, device=torch.device("cpu"),
        prefetch=prefetch, static_shapes=static_shapes), array, table, target_array, caption_image


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("sampler", ["pairs", "images"])
def test_an_epoch_is_the_samplers_plan_with_each_captions_inputs(sampler):
    batches, array, table, targets, caption_image = _batches(sampler=sampler)
    order, bounds = batches.sampler.plan()
    clean, lengths = table.clean()
    seen = []
    for b, batch in enumerate(batches.epoch(0)):
        captions = order[bounds[b]:bounds[b + 1]]
        seen.extend(captions)
        assert batch["image_index"].tolist() == caption_image[captions].tolist()
        assert torch.equal(batch["images"], torch.from_numpy(array[caption_image[captions]]))
        assert torch.equal(batch["lengths"], lengths[captions])
        assert torch.equal(batch["tokens"], clean[captions, : int(lengths[captions].max())])
        assert torch.equal(batch["clean_tokens"], batch["tokens"])
        assert torch.equal(batch["targets"], torch.from_numpy(targets[captions]))
    assert b + 1 == len(batches)
    # pairs: 4 batches of 8 distinct captions of the 36; images: 3 batches of 4 images, each
    # with its 3 captions, so every caption once
    assert len(set(seen)) == len(seen) == (32 if sampler == "pairs" else 36)


def test_an_epoch_is_a_function_of_the_seed_and_the_epoch():
    a = list(_batches(unk_prob=0.3, delete_prob=0.3)[0].epoch(1))
    b = list(_batches(unk_prob=0.3, delete_prob=0.3)[0].epoch(1))
    c = list(_batches(unk_prob=0.3, delete_prob=0.3)[0].epoch(2))
    assert all(_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(_equal(x, y) for x, y in zip(a, c, strict=True))


def test_epochs_planned_ahead_in_a_thread_are_the_epochs_planned_in_place():
    """A thread plans epoch e + 1 while e trains; epoch e read twice (SWA's BatchNorm refresh
    reads an epoch again) and epochs out of order are the same batches as without it."""
    kw = {"pixels": True, "erasing": 0.5, "unk_prob": 0.3, "delete_prob": 0.3}
    ahead = _batches(**kw)[0]
    ahead.plan_ahead = True
    plain = _batches(**kw)[0]
    for epoch in (0, 0, 1, 2, 5, 3):
        got, expected = list(ahead.epoch(epoch)), list(plain.epoch(epoch))
        assert len(got) == len(expected)
        assert all(_equal(x, y) for x, y in zip(got, expected, strict=True)), epoch
    assert ahead._ahead[0] == 4  # planning the epoch after the last one read
    assert plain._ahead is None  # the CPU default: no thread


def test_static_shapes_pad_captions_to_a_few_lengths_and_keep_lengths_on_the_device():
    """Each batch's captions are padded to the first of 8, 16, 24, ... that holds its longest
    caption (the plan is wide enough for it); the ids and lengths are the exact batch's."""
    from icr.data.batches import padded_length

    assert [padded_length(n, 512) for n in (1, 8, 9, 17, 33, 49, 97)] == [8, 8, 16, 24, 48,
                                                                         64, 128]
    assert padded_length(30, 20) == 20 and padded_length(600, 1000) == 600
    static = _batches(delete_prob=0.2, static_shapes=True)[0]
    exact = _batches(delete_prob=0.2)[0]
    for s_batch, e_batch in zip(static.epoch(0), exact.epoch(0), strict=True):
        width = e_batch["tokens"].shape[1]
        assert s_batch["tokens"].shape[1] == padded_length(width, 512)
        assert torch.equal(s_batch["tokens"][:, :width], e_batch["tokens"])
        assert (s_batch["tokens"][:, width:] == 0).all()
        assert torch.equal(s_batch["lengths"], e_batch["lengths"])
        assert torch.equal(s_batch["clean_lengths"], e_batch["clean_lengths"])
        clean_width = e_batch["clean_tokens"].shape[1]
        assert s_batch["clean_tokens"].shape[1] == padded_length(clean_width, 512)
        assert torch.equal(s_batch["clean_tokens"][:, :clean_width], e_batch["clean_tokens"])


@pytest.mark.parametrize("pixels", [False, True])
def test_host_rows_and_the_prefetch_thread_give_the_resident_batches(pixels):
    kw = {"pixels": pixels, "erasing": 0.5 if pixels else 0.0, "unk_prob": 0.2,
          "delete_prob": 0.2}
    resident = list(_batches(**kw)[0].epoch(0))
    host, *_ = _batches(budget=0, targets="host", **kw)
    assert not host.store.resident
    for prefetch in (False, True):
        host.prefetch = prefetch
        got = list(host.epoch(0))
        assert len(got) == len(resident)
        assert all(_equal(x, y) for x, y in zip(got, resident, strict=True))


def test_pixels_are_normalised_and_erased_on_the_way():
    batches, array, *_ = _batches(pixels=True, erasing=1.0)
    batch = next(batches.epoch(0))
    assert batch["images"].dtype == torch.float32
    assert (batch["images"] == 0).flatten(1).any(1).all()  # every image has its box erased


def test_a_prefetch_thread_stops_with_an_epoch_left_early_and_hands_on_errors():
    batches, *_ = _batches(budget=0, prefetch=True)
    epoch = batches.epoch(0)
    next(epoch)
    epoch.close()  # the reader stops early (SWA's BatchNorm pass reads a few batches)
    assert not any(t.name == "icr-prefetch" for t in threading.enumerate())
    broken, *_ = _batches(budget=0, prefetch=True)

    def fail(*_):
        raise OSError("disk gone")

    broken.store.take = fail
    with pytest.raises(OSError, match="disk gone"):
        next(broken.epoch(0))


def test_caption_tables_are_cached_once_and_read_back_memory_mapped(tmp_path, vocab_input,
                                                                    wordpiece_input):
    from icr.data.pipeline import cached_table
    from icr.data.types import CaptionedImages

    split = CaptionedImages("train", ("a.jpg",), tuple(CAPTIONS), tuple(range(len(CAPTIONS))),
                            np.zeros(len(CAPTIONS), dtype=np.int64))
    for source in (vocab_input, wordpiece_input):
        fresh = source.table(CAPTIONS)
        first = cached_table(source, split, tmp_path)
        files = sorted((tmp_path / "captions").iterdir())
        again = cached_table(source, split, tmp_path)
        assert sorted((tmp_path / "captions").iterdir()) == files  # read, not written again
        for table in (first, again):
            assert torch.equal(table.pieces, fresh.pieces)
            assert torch.equal(table.piece_word, fresh.piece_word)
            assert torch.equal(table.num_words, fresh.num_words)
            assert (table.begin, table.end, table.unk, table.max_pieces) == (
                fresh.begin, fresh.end, fresh.unk, fresh.max_pieces)
            assert torch.equal(table.clean()[0], fresh.clean()[0])
    assert len(files) == 2  # one file per input kind
