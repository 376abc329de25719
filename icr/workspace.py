"""Where things live on disk: one workspace directory (docs/architecture.md, "Where things live on disk").

``<workspace>/data`` generated or linked datasets, ``cache`` latent targets, vocabularies, relevance
matrices and decoded images, ``mlflow.db`` the tracking store and ``mlartifacts`` its artifacts,
``ray`` Tune storage, ``locks`` one driver per study, ``runs`` the ``--debug`` runs, ``reports``.
The default is ``./workspace``; ``ICR_WORKSPACE`` or an explicit path choose another.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def resolve(cls, root: str | Path | None = None) -> Workspace:
        chosen = root or os.environ.get("ICR_WORKSPACE") or "workspace"
        return cls(Path(chosen).expanduser().resolve())

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def ray(self) -> Path:
        return self.root / "ray"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    @property
    def mlartifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for any other store."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(urllib.parse.unquote(tracking_uri.removeprefix("sqlite:///").split("?")[0]))
