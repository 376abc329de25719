"""The flat vocabulary: round trips, parsing and one-line errors naming the key."""

import dataclasses

import pytest

from icr.config import (
    ExperimentConfig,
    from_flat,
    key_specs,
    parse_overrides,
    to_flat,
    used_keys,
)
from icr.errors import ConfigError
from icr.models.image import IMAGE_ENCODERS


def test_defaults_round_trip_exactly():
    config = ExperimentConfig()
    assert from_flat(to_flat(config)) == config


def test_every_field_has_help_and_default():
    for key, spec in key_specs().items():
        assert spec.help, key
        assert isinstance(spec.default, spec.type), key


def test_overrides_parse_from_strings_and_round_trip():
    config = from_flat({"loss.tau": "0.07", "train.swa": "false", "train.batch_size": "64",
                        "objective.name": "lagrangian"})
    assert config.loss.tau == 0.07 and config.train.swa is False and config.train.batch_size == 64
    assert from_flat(to_flat(config)) == config
    assert config.objective.name == "lagrangian"


def test_typed_values_from_yaml_or_ray():
    config = from_flat({"objective.eta": 0.1, "train.warmup_epochs": 2.0})
    assert config.objective.eta == 0.1 and config.train.warmup_epochs == 2


def test_base_is_respected():
    base = from_flat({"loss.name": "triplet"})
    assert from_flat({"loss.margin": 0.1}, base).loss.name == "triplet"


@pytest.mark.parametrize(
    ("flat", "fragment"),
    [
        ({"loss.tua": 0.1}, "unknown config key 'loss.tua'; did you mean loss.tau"),
        ({"loss.name": "hinge"}, "is not allowed; loss.name is one of "),
        ({"eval.analyses": "probe,tsne"}, "eval.analyses is a comma-separated list of "),
        ({"loss.tau": "hot"}, "loss.tau is a number"),
        ({"loss.tau": -1}, "out of range"),
        ({"train.swa": "maybe"}, "train.swa is true or false"),
        ({"train.batch_size": 3.5}, "train.batch_size is an integer"),
        ({"objective.eta": float("nan")}, "objective.eta"),
    ],
)
def test_bad_input_names_the_key(flat, fragment):
    with pytest.raises(ConfigError) as err:
        from_flat(flat)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_parse_overrides():
    assert parse_overrides(["a.b=1", " c.d = x=y "]) == {"a.b": "1", "c.d": "x=y"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["loss.tau"])


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ExperimentConfig().loss.tau = 1.0  # type: ignore[misc]


def test_registry_keys_take_their_names_from_the_registry():
    from icr.losses import LOSSES

    assert key_specs()["loss.name"].choices == tuple(LOSSES.names())
    assert from_flat({"eval.analyses": " probe , "}).eval.analyses == "probe"


@pytest.mark.parametrize(
    ("flat", "present", "absent"),
    [
        ({"loss.name": "triplet"}, {"loss.margin"}, {"loss.tau", "objective.eta"}),
        ({"loss.name": "infonce"}, {"loss.tau"}, {"loss.margin"}),
        ({"objective.name": "lagrangian", "decoder.name": "ltd"},
         {"objective.eta", "objective.lambda_lr", "decoder.target_model", "decoder.hidden_dim"},
         {"objective.beta", "decoder.word_dim"}),
        ({"objective.name": "dual", "decoder.name": "itd"},
         {"objective.beta", "decoder.word_dim"}, {"decoder.target_model", "objective.eta"}),
        ({"image.encoder": "resnet18"}, {"image.pretrained"}, {"image.hidden_dim"}),
        ({"image.encoder": "regions"}, {"image.hidden_dim", "image.output_dim"}, set()),
    ],
)
def test_used_keys_follow_the_chosen_components(flat, present, absent):
    used = set(used_keys(from_flat(flat)))
    assert present <= used and not (absent & used)
    assert {"train.seed", "loss.name", "objective.name", "eval.analyses"} <= used


@pytest.mark.parametrize(
    ("generator", "absent"),
    [("context", set()), ("random", {"grounding.mlm_candidates", "grounding.mlm_path"}),
     ("none", {"grounding.num_negatives", "grounding.mlm_candidates", "grounding.mlm_path"})],
)
def test_the_negative_generators_options_are_used_by_the_generators_that_read_them(generator,
                                                                                   absent):
    # Their registry is tied to grounding.*: a generator's options are the fields it takes.
    negatives = {"grounding.num_negatives", "grounding.mlm_candidates", "grounding.mlm_path"}
    used = set(used_keys(from_flat({"task.name": "grounding", "grounding.negatives": generator})))
    assert negatives - absent <= used and not (absent & used)
    assert {"grounding.word_model", "grounding.lang_weight", "train.seed"} <= used


def test_every_registry_reads_only_known_keys():
    from icr.registry import resolve

    specs = key_specs()
    sections = {key.split(".")[0] for key in specs}
    for spec in specs.values():
        if spec.registry is None:
            continue
        registry = resolve(spec.registry)
        for name in registry.names():
            for key in registry.reads(name):
                known = key[:-2] in sections if key.endswith(".*") else key in specs
                assert known, f"{spec.key}={name} reads unknown key {key}"


def test_paths_the_configuration_uses_must_exist(tmp_path):
    from icr.config import check_paths

    check_paths(from_flat({}))  # bundled names and '' need no file
    check_paths(from_flat({"text.glove": str(tmp_path)}))
    with pytest.raises(ConfigError, match="text.glove=/nope: no such file or folder"):
        check_paths(from_flat({"text.glove": "/nope"}))
    # A path the configuration does not use is not checked: no LTD decoder, no target model.
    check_paths(from_flat({"decoder.target_model": "/nope"}))
    with pytest.raises(ConfigError, match="decoder.target_model"):
        check_paths(from_flat({"decoder.target_model": "/nope", "decoder.name": "ltd"}))


@pytest.mark.parametrize("encoder", IMAGE_ENCODERS.names())
def test_image_keys_used_per_encoder(encoder):
    """A run records the image keys its encoder reads, key by key: an encoder of precomputed
    regions has no backbone to freeze and no pixels to erase, so its runs carry neither
    ``image.frozen`` nor ``image.random_erasing``; its builder's options name the rest."""
    pixels = IMAGE_ENCODERS.meta(encoder)["input"] == "pixels"
    flat = {"image.encoder": encoder, "data.features": "pixels" if pixels else "regions"}
    used = {k for k in used_keys(from_flat(flat)) if k.startswith("image.")}
    options = {f"image.{p}" for p in IMAGE_ENCODERS.options(encoder)}
    pixel_keys = {"image.frozen", "image.random_erasing"}
    assert used == {"image.encoder"} | options | (pixel_keys if pixels else set())


# --------------------------------------------------------------- what a tensor can hold


def test_the_float32_bound_is_torchs():
    import torch

    from icr.config import FLOAT32_MAX, INT64_MAX, INT64_MIN

    assert torch.finfo(torch.float32).max == FLOAT32_MAX
    assert (torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max) == (INT64_MIN, INT64_MAX)


def test_every_number_key_is_bounded_by_what_its_tensor_holds():
    from icr.config import FLOAT32_MAX, INT64_MAX, INT64_MIN

    for key, spec in key_specs().items():
        if spec.type is float:
            assert -FLOAT32_MAX <= spec.low <= spec.high <= FLOAT32_MAX, key
        elif spec.type is int:
            assert INT64_MIN <= spec.low <= spec.high <= INT64_MAX, key


@pytest.mark.parametrize("key", [k for k, s in key_specs().items() if s.type is float])
def test_a_float_beyond_float32_is_refused_naming_the_key(key):
    import torch

    with pytest.raises(ConfigError, match=rf"^{key}='1e39' is out of range; {key} is a number"):
        from_flat({key: "1e39"})
    spec = key_specs()[key]
    if spec.high > 1e38:  # the largest value the message prints is accepted, and torch holds it
        printed = float(spec.describe().split(", ")[1].split("]")[0])
        value = getattr(getattr(from_flat({key: printed}), key.split(".")[0]), key.split(".")[1])
        assert torch.tensor(value, dtype=torch.float32).isfinite()


def test_the_lagrangian_multiplier_at_the_largest_accepted_bound_builds_and_steps():
    # 1e39 made every trial fail inside its first step: torch cannot put it into a float32.
    import torch

    from icr.objectives import build_objective

    high = key_specs()["objective.lambda_max"].high
    config = from_flat({"objective.name": "lagrangian", "objective.lambda_max": high,
                        "objective.lambda_init": high})
    objective = build_objective(config.objective)
    objective(torch.tensor(1.0), torch.tensor(0.1))
    objective.step()  # the projection into [0, lambda_max]: what overflowed with 1e39
    assert objective.lambda_value <= high


def test_an_integer_beyond_int64_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^train.seed='9223372036854775808' is out of range"):
        from_flat({"train.seed": str(2**63)})


def test_the_cli_refuses_a_value_float32_cannot_hold_with_one_line_and_exit_2(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    workspace = tmp_path / "ws"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}
    result = subprocess.run(
        [sys.executable, "-m", "studies.run", "ltd_bound", "--set", "objective.lambda_max=1e39",
         "objective.lambda_init=1e39", "--workspace", str(workspace), "--no-dashboard"],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: objective.lambda_max='1e39' is out of "
                                                   "range"), lines
    assert "float32" in lines[0] and "Traceback" not in result.stderr
    assert not workspace.exists()  # refused before anything was written
