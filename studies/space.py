"""Search-space files: dotted config keys -> domains or fixed values (declarative, no code).

Format (``search_spaces/<study>.yaml``)::

    space:                      # searched (or fixed) in every condition
      loss.tau: {loguniform: [0.02, 0.2]}
      train.batch_size: 128     # a plain value is fixed
    conditions:                 # searched only in the named condition
      lagrangian:
        objective.eta: {uniform: [0.05, 0.3]}

Domains: ``{choice: [a, b, ...]}``, ``{grid: [a, b, ...]}`` (every value trained once, see
:class:`Domain`), ``{uniform: [low, high]}``, ``{loguniform: [low, high]}``
(low > 0) and ``{int: [low, high]}`` (both ends included). Every key and value is validated
against the config vocabulary (:func:`icr.config.key_specs`); an error names the file and the key.
This module knows nothing of Ray: :class:`ConditionalSpace` turns a condition's domains into an
Optuna define-by-run space that samples only the keys a trial's configuration uses.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from icr.config import Scalar, from_flat, key_specs, parse_value, used_keys
from icr.errors import ConfigError

KINDS = ("choice", "grid", "uniform", "loguniform", "int")
_TOP_LEVEL = ("space", "conditions", "description")


@dataclass(frozen=True)
class Domain:
    """A searched key: ``kind`` is one of :data:`KINDS`; ``values`` the choices or (low, high).

    ``grid`` is a choice whose every value is trained once (a paper's grid, e.g. LTD's eta in
    {0.05, ..., 0.3}): a condition whose domains are all grids runs their product, every point
    once, with Optuna's GridSampler (:func:`grid_points`)."""

    key: str
    kind: str
    values: tuple[Scalar, ...]

    def describe(self) -> str:
        if self.kind in ("choice", "grid"):
            return f"{self.kind} of {', '.join(map(str, self.values))}"
        return f"{self.kind} [{self.values[0]}, {self.values[1]}]"

    def midpoint(self) -> Scalar:
        """A representative value (used by --debug when the key is not set)."""
        if self.kind == "choice":
            return self.values[0]
        if self.kind == "grid":
            return self.values[len(self.values) // 2]
        low, high = self.values
        if self.kind == "loguniform":
            return float((low * high) ** 0.5)
        if self.kind == "int":
            return int((low + high) // 2)
        return float((low + high) / 2)


@dataclass(frozen=True)
class Section:
    """The fixed values and the domains of one part of a space file."""

    fixed: dict[str, Scalar] = field(default_factory=dict)
    domains: dict[str, Domain] = field(default_factory=dict)


@dataclass(frozen=True)
class SearchSpace:
    path: Path
    common: Section
    per_condition: dict[str, Section]

    def for_condition(self, condition: str) -> Section:
        """Fixed values and domains of ``condition``: the common part, then its own part."""
        own = self.per_condition.get(condition, Section())
        return Section({**self.common.fixed, **own.fixed}, {**self.common.domains, **own.domains})


def load_space(path: Path | str, conditions: tuple[str, ...] | None = None) -> SearchSpace:
    """Parse and validate a space file; ConfigError naming the file and the key otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"search-space file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    if not isinstance(raw, dict) or set(raw) - set(_TOP_LEVEL):
        raise ConfigError(f"{path}: expected a mapping with the keys {', '.join(_TOP_LEVEL)}")
    common = _section(path, "space", raw.get("space") or {})
    by_condition = raw.get("conditions") or {}
    if not isinstance(by_condition, dict):
        raise ConfigError(f"{path}: 'conditions' must map condition names to keys")
    per_condition = {}
    for name, body in by_condition.items():
        if conditions is not None and name not in conditions:
            raise ConfigError(
                f"{path}: unknown condition {name!r}; the study's conditions: {', '.join(conditions)}"
            )
        per_condition[str(name)] = _section(path, f"conditions.{name}", body or {})
    return SearchSpace(path, common, per_condition)


def _section(path: Path, where: str, body: Any) -> Section:
    if not isinstance(body, dict):
        raise ConfigError(f"{path}: '{where}' must map dotted config keys to values or domains")
    fixed: dict[str, Scalar] = {}
    domains: dict[str, Domain] = {}
    for key, value in body.items():
        try:
            if isinstance(value, dict):
                domains[key] = parse_domain(key, value)
            elif isinstance(value, list):
                raise ConfigError(f"{key}: a list is not a domain; write {{choice: {value}}}")
            else:
                fixed[key] = parse_value(key, value)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {where}: {exc}") from None
    return Section(fixed, domains)


def parse_domain(key: str, spec: Mapping[str, Any]) -> Domain:
    """One ``{kind: args}`` mapping -> a validated Domain (ConfigError names the key)."""
    specs = key_specs()
    if key not in specs:
        parse_value(key, None)  # raises the "unknown config key ... did you mean" error
    if len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ConfigError(f"{key}: a domain is one of {{{': ..., '.join(KINDS)}: ...}}, got {dict(spec)}")
    kind, args = next(iter(spec.items()))
    if not isinstance(args, list) or not args:
        raise ConfigError(f"{key}: {kind} needs a list, e.g. {{{kind}: [low, high]}}")
    if kind in ("choice", "grid"):
        values = tuple(parse_value(key, v) for v in args)
        if kind == "grid" and len(set(values)) != len(values):
            raise ConfigError(f"{key}: a grid lists each value once, got {args}")
        return Domain(key, kind, values)
    if len(args) != 2:
        raise ConfigError(f"{key}: {kind} needs exactly [low, high], got {args}")
    kspec = specs[key]
    wanted = int if kind == "int" else float
    if kspec.type is not wanted:
        raise ConfigError(f"{key}: {kind} does not fit a key that is {kspec.describe()}")
    low, high = (parse_value(key, v) for v in args)
    if kind == "int" and not all(isinstance(v, int) and not isinstance(v, bool) for v in args):
        raise ConfigError(f"{key}: int needs integer bounds, got {args}")
    if not low < high:
        raise ConfigError(f"{key}: {kind} needs low < high, got {args}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{key}: loguniform needs low > 0, got {args}")
    return Domain(key, kind, (low, high))


@dataclass(frozen=True)
class ConditionalSpace:
    """A condition's domains as an Optuna define-by-run space that samples only the keys the
    trial's configuration uses.

    Component choices (keys whose values are registry names, e.g. ``loss.name``) are sampled
    first; every other domain is sampled only when the configuration chosen so far uses its key
    (:func:`icr.config.used_keys`): a trial that draws ``loss.name=triplet`` draws ``loss.margin``
    and no ``loss.tau``, so it records no ``loss.tau`` and the searcher learns nothing false about
    it. Which keys each combination of component choices uses is worked out once, when the space
    is made (on the driver); Optuna calls the space once per trial, and then it only samples.
    """

    base: Mapping[str, Any]  # the condition's flat overrides
    domains: tuple[Domain, ...]
    order: tuple[Domain, ...] = field(init=False)  # component choices first
    components: frozenset[str] = field(init=False)  # the keys that choose a component
    # component choices drawn so far -> the keys the configuration then uses
    used: Mapping[tuple[tuple[str, Any], ...], frozenset[str]] = field(init=False)

    def __post_init__(self) -> None:
        specs = key_specs()
        order = tuple(sorted(self.domains, key=lambda d: specs[d.key].registry is None))
        components = [d for d in order if specs[d.key].registry is not None]
        used: dict[tuple[tuple[str, Any], ...], frozenset[str]] = {}

        def visit(i: int, drawn: dict[str, Any]) -> None:
            # the keys used once the components before i are drawn as in ``drawn``
            keys = used[tuple(drawn.items())] = frozenset(used_keys(from_flat({**self.base, **drawn})))
            if i == len(components):
                return
            domain = components[i]
            if domain.key not in keys:  # not drawn by this configuration
                visit(i + 1, drawn)
                return
            for value in domain.values:
                visit(i + 1, {**drawn, domain.key: value})

        visit(0, {})
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "components", frozenset(d.key for d in components))
        object.__setattr__(self, "used", used)

    def __call__(self, trial: Any) -> None:
        drawn: dict[str, Any] = {}  # the component choices drawn so far
        for domain in self.order:
            if domain.key not in self.used[tuple(drawn.items())]:
                continue
            value = suggest(trial, domain)
            if domain.key in self.components:
                drawn[domain.key] = value


def suggest(trial: Any, domain: Domain) -> Any:
    """One value of a space-file domain from an Optuna trial."""
    if domain.kind in ("choice", "grid"):
        return trial.suggest_categorical(domain.key, list(domain.values))
    low, high = domain.values
    if domain.kind == "int":
        return trial.suggest_int(domain.key, low, high)  # both ends included, as in the file
    return trial.suggest_float(domain.key, low, high, log=domain.kind == "loguniform")


def grid_points(domains: Mapping[str, Domain]) -> dict[str, list[Scalar]] | None:
    """The grid of a condition whose searched keys are all ``grid`` domains (Optuna's
    GridSampler's search space), or ``None`` when any key is sampled otherwise."""
    if not domains or any(d.kind != "grid" for d in domains.values()):
        return None
    return {key: list(d.values) for key, d in domains.items()}


def grid_size(domains: Mapping[str, Domain]) -> int | None:
    """How many points :func:`grid_points` has (``None``: not a grid)."""
    grid = grid_points(domains)
    return None if grid is None else math.prod(len(v) for v in grid.values())
