"""A tiny name -> builder registry.

Registries are filled at import time with a decorator; an unknown name raises a
:class:`~icr.errors.ConfigError` listing the valid names, and registering a name twice raises.

A registry may be tied to a package: listing or looking up its names first imports every module of
that package, so a new component is one new module with its ``@REGISTRY.register(...)`` line and
nothing else. A registry may also be tied to a config section: :meth:`Registry.build` fills the
builder's keyword parameters that are fields of that section from the section, and
:meth:`Registry.reads` names them as dotted keys. Which config keys a configuration uses is derived
from that (:func:`icr.config.used_keys`): ``loss.tau`` is used by a trial whose ``loss.name`` reads
it, not by a triplet trial.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from icr.errors import ConfigError

T = TypeVar("T", bound=Callable)


class Registry(Generic[T]):
    """Maps names to builders (functions or classes).

    Args:
        kind: what is registered, for messages ("contrastive loss").
        section: the config section whose fields the builders take as keyword arguments: its
            dataclass (``LossConfig``: the section ``loss`` of ``ExperimentConfig``). The
            registry reads its fields; it never imports the config module.
        package: dotted package(s) whose modules are imported before names are looked up.
        requires: what every registration must declare beyond its builder (``meta`` keys, e.g.
            ``("task", "needs")`` for an analysis).
    """

    def __init__(
        self, kind: str, *, section: type | None = None,
        package: str | tuple[str, ...] | None = None, requires: tuple[str, ...] = (),
    ) -> None:
        self.kind = kind
        self.section_type = section
        self.section = section_name(section) if section is not None else None
        self._fields = {f.name for f in dataclasses.fields(section)} if section else set()
        self.packages = (package,) if isinstance(package, str) else tuple(package or ())
        self.requires = requires
        self._items: dict[str, T] = {}
        self._extra_reads: dict[str, tuple[str, ...]] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._discovered = not self.packages

    def register(self, name: str, *, reads: tuple[str, ...] = (), **meta: Any) -> Callable[[T], T]:
        """Decorator registering ``fn`` under ``name``.

        ``reads`` names dotted config keys the component depends on beyond its builder's
        parameters (e.g. ``text.glove`` for a caption encoder whose word vectors the data pipeline
        loads). ``meta`` holds what others must know before building it (e.g. ``input="regions"``
        for an image encoder that reads region features): :meth:`meta`.
        """

        missing = [key for key in self.requires if key not in meta]
        if missing:
            raise TypeError(f"{self.kind} {name!r} must be registered with {', '.join(missing)}=")

        def decorator(fn: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            self._extra_reads[name] = tuple(reads)
            self._meta[name] = dict(meta)
            return fn

        return decorator

    def meta(self, name: str) -> dict[str, Any]:
        """What ``name`` was registered with beyond its builder (see :meth:`register`)."""
        self.get(name)
        return self._meta[name]

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        for name in self.packages:
            for module, _ in package_modules(name):
                importlib.import_module(module)

    def get(self, name: str) -> T:
        self._discover()
        try:
            return self._items[name]
        except KeyError:
            valid = ", ".join(sorted(self._items))
            raise ConfigError(f"unknown {self.kind} {name!r}; valid: {valid}") from None

    def names(self) -> list[str]:
        self._discover()
        return sorted(self._items)

    def options(self, name: str) -> list[str]:
        """The builder's keyword parameters that are fields of the registry's config section."""
        params = inspect.signature(self.get(name)).parameters
        return [p for p in params if p in self._fields]

    def reads(self, name: str) -> tuple[str, ...]:
        """Dotted config keys the component ``name`` depends on."""
        own = tuple(f"{self.section}.{p}" for p in self.options(name))
        return own + self._extra_reads[name]

    def bind(self, name: str, /, **options: Any) -> Callable:
        """The builder of ``name`` with ``options`` bound (``functools.partial``).

        Raises:
            ConfigError: ``name`` is unknown, or the builder takes no option of that name
                (the message lists the ones it takes).
        """
        builder = self.get(name)
        accepted = list(inspect.signature(builder).parameters)
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ConfigError(f"{self.kind} {name!r} takes no option {unknown[0]!r}; its "
                              f"options: {', '.join(accepted) or 'none'}")
        return functools.partial(builder, **options)

    def section_options(self, name: str, section: Any) -> dict[str, Any]:
        """The options of ``name`` as ``section`` sets them: the values of its builder's
        parameters that are fields of the section (:meth:`options`)."""
        return {p: getattr(section, p) for p in self.options(name)}

    def arguments(self, name: str, section: Any = None, /, **offered: Any) -> dict[str, Any]:
        """What the builder of ``name`` takes of a config section and of ``offered``: its
        options from ``section`` and the offered values its signature names (an offered value
        wins over a section field of the same name). For builders that take different things
        (one generator wants a masked LM, another a seed): each gets what it names."""
        accepted = inspect.signature(self.get(name)).parameters
        options = self.section_options(name, section) if section is not None else {}
        return options | {k: v for k, v in offered.items() if k in accepted}

    def build(self, name: str, section: Any = None, /, **context: Any) -> Any:
        """Call the builder of ``name`` with its options from ``section`` and the ``context``.

        ``context`` supplies what the config does not hold (sizes of the data, the vocabulary);
        it takes precedence over a section field of the same name.
        """
        builder = self.get(name)
        accepted = inspect.signature(builder).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
        unknown = sorted(k for k in context if k not in accepted and not takes_any)
        if unknown:
            raise TypeError(f"{self.kind} {name!r} takes no argument {unknown[0]!r}")
        options = self.section_options(name, section) if section is not None else {}
        return builder(**(options | context))

    def __contains__(self, name: object) -> bool:
        self._discover()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._discover()
        return len(self._items)


def section_name(section: type) -> str:
    """The name of a config section from its dataclass: ``LossConfig`` -> ``loss`` (the fields
    of ``ExperimentConfig`` are named so; a test holds every registry to it)."""
    return section.__name__.removesuffix("Config").lower()


def package_modules(package: str) -> list[tuple[str, Path]]:
    """The modules and subpackages of ``package`` but its private ones (``_name``), by name:
    (dotted name, source file). The one package scan: a registry imports them all, the study
    catalog those whose source declares a study."""
    found = []
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__),
                       key=lambda m: m.name):
        if not info.name.startswith("_"):
            folder = Path(info.module_finder.path)
            source = folder / info.name / "__init__.py" if info.ispkg else folder / f"{info.name}.py"
            found.append((f"{package}.{info.name}", source))
    return found


def resolve(path: str) -> Registry:
    """The registry at ``"package.module:NAME"`` (imported on first use)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
