"""What a trained task offers the analyses that run on it: typed capabilities, declared up front.

A task registers the capabilities it provides (``@TASKS.register("retrieval", provides=(...))``)
and hands them out after training (``Task.capabilities()``); a dataset registers those that come
with its files (``@DATASETS.register("shapes", provides=(Scenes, ImageFiles))``) and its source
hands them out (``DatasetSource.capabilities()``). An analysis registers the task kind it runs on
and the capabilities it needs (``@ANALYSES.register("cocos", task="retrieval", needs=(Embeddings,
RetrievalInputs))``) and reads them, typed, from its :class:`TaskContext`:
``context.get(Embeddings).embed("train")``. Nothing is probed with ``hasattr``:
:func:`icr.train.analyses.check_analyses` matches the declarations from the config alone when a
study is planned, so an analysis that cannot run on a condition is a one-line error before
anything starts.

This module knows no task: the capabilities here are what any model or dataset of a kind can offer
(embeddings, attention, ground truth, image files). A capability that carries one task's own data
lives beside that task (:class:`icr.train.retrieval_data.RetrievalInputs`,
:class:`icr.grounding.train.GroundingInputs`), so a new task adds its own without editing this one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from icr.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

    from icr.config import ExperimentConfig


class Capability:
    """Something a task or a dataset offers to analyses; ``about`` names it in messages."""

    about: ClassVar[str]


C = TypeVar("C", bound=Capability)


class Embedder(Protocol):
    def __call__(self, split: str) -> tuple[Tensor, Tensor]:
        """Image ``(N_img, D)`` and caption ``(N_cap, D)`` embeddings of ``split``."""
        ...


# ---------------------------------------------------------------- what trained models provide


@dataclass(frozen=True)
class Embeddings(Capability):
    """A retrieval model's embeddings of a split with the task's current weights (after training:
    the best-validation ones), L2-normalised."""

    about: ClassVar[str] = "a retrieval model's embeddings"
    embed: Embedder


@dataclass(frozen=True)
class InitialEmbeddings(Capability):
    """The same model at its initialisation, rebuilt from the run's seed exactly as ``fit`` built
    it (a reference for probes): ``build()`` gives its :class:`Embedder`."""

    about: ClassVar[str] = "the retrieval model at its initialisation"
    build: Callable[[], Embedder]


@dataclass(frozen=True)
class Attention(Capability):
    """A grounding model's attention of each word-feature position over its caption's own image:
    ``attention(split)`` is ``(C, P, R)``."""

    about: ClassVar[str] = "a grounding model's word-region attention"
    attention: Callable[[str], Tensor]


# ----------------------------------------------------------------------- what datasets provide


@dataclass(frozen=True)
class Scenes(Capability):
    """The embedded benchmark's ground truth (``scenes.json`` in ``root``): every image's scene,
    every caption's meaning, the grammar's captions."""

    about: ClassVar[str] = "the embedded benchmark's ground truth, scenes.json"
    root: Path


@dataclass(frozen=True)
class ImageFiles(Capability):
    """The dataset's image files, named by image id (file stem), in ``folder``."""

    about: ClassVar[str] = "the image files"
    folder: Path


# ---------------------------------------------------------------------------- the context


@dataclass(frozen=True)
class TaskContext:
    """What one trained task offers an analysis: its kind (``task.name``), its config and its
    capabilities, one per type.

    Args:
        kind: the task's registered name.
        config: the run's configuration.
        capabilities: what the task and its dataset provide (``Task.capabilities()``).
        analysis: the analysis this context was made for (:meth:`only`), for messages.
        needs: what that analysis declared; ``None``: unrestricted.
    """

    kind: str
    config: ExperimentConfig
    capabilities: Mapping[type[Capability], Capability] = field(default_factory=dict)
    analysis: str = ""
    needs: frozenset[type[Capability]] | None = None

    @classmethod
    def of(cls, kind: str, config: ExperimentConfig,
           capabilities: Iterable[Capability]) -> TaskContext:
        return cls(kind, config, {type(c): c for c in capabilities})

    def only(self, analysis: str, needs: Iterable[type[Capability]]) -> TaskContext:
        """The context of ``analysis``, which can read only the capabilities it declared."""
        return replace(self, analysis=analysis, needs=frozenset(needs))

    def get(self, capability: type[C]) -> C:
        """The capability of type ``capability``.

        Raises:
            TypeError: the analysis reads a capability it did not declare in its ``needs`` (a bug).
            ConfigError: this run lacks it (e.g. a shapes folder without scenes.json); the message
                names the analysis and what it needs.
        """
        if self.needs is not None and capability not in self.needs:
            raise TypeError(f"analysis {self.analysis!r} reads {capability.__name__} without "
                            "declaring it: add it to needs= in its registration")
        found = self.capabilities.get(capability)
        if isinstance(found, capability):
            return found
        raise ConfigError(f"eval.analyses={self.analysis or '?'} needs {capability.__name__} "
                          f"({capability.about}), which this {self.kind} run's task and data "
                          f"lack; give data that has it, or drop "
                          f"{self.analysis or 'the analysis'}")
