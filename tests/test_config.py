"""The flat vocabulary: round trips, parsing and one-line errors naming the key."""

import dataclasses

import pytest

from icr.config import ExperimentConfig, from_flat, key_specs, parse_overrides, to_flat
from icr.errors import ConfigError


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
        ({"loss.name": "hinge"}, "loss.name is one of infonce, triplet, triplet_all"),
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


def test_config_choices_match_registries():
    from icr.losses import LOSSES
    from icr.models.image import IMAGE_ENCODERS
    from icr.objectives import OBJECTIVES

    specs = key_specs()
    assert set(specs["loss.name"].choices) == set(LOSSES.names())
    assert set(specs["image.encoder"].choices) == set(IMAGE_ENCODERS.names())
    assert set(specs["objective.name"].choices) == set(OBJECTIVES.names())
