"""What a caption means, and whether it is true of a scene.

A caption's meaning is a conjunction of clauses, stored as JSON-ready dicts so that ``scenes.json``
carries them verbatim. A *description* ``desc`` maps some of the attributes in
:data:`~icr.data.synthetic.world.ATTRIBUTES` to values; an object matches it when it has all of them.
The value of ``shape`` is a concept (:data:`~icr.data.synthetic.lexicon.SHAPE_CONCEPTS`): a shape, or
a hypernym ("polygon") that an object matches when its shape is one of the hypernym's.

===============  =================================================  ===============================
kind             fields                                             true of a scene when
===============  =================================================  ===============================
``exists``       ``desc``                                           some object matches ``desc``
``count``        ``desc``, ``n``                                    exactly ``n`` objects match
``relation``     ``rel``, ``a``, ``b`` (descs)                      objects x != y match ``a``, ``b``
                                                                    and ``rel`` holds for (x, y)
``background``   ``tone`` and/or ``hue``                            the background has that tone
                                                                    and hue
``total``        ``n``                                              the scene has exactly ``n`` objects
===============  =================================================  ===============================

:func:`holds` decides one scene with plain loops (the oracle); :class:`TruthTable` decides a meaning
against many scenes at once with NumPy (used for the CxC extended positives). Both rest on
:func:`~icr.data.synthetic.world.relation_holds`, the single definition of the spatial relations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from icr.data.synthetic.lexicon import SHAPE_CONCEPTS
from icr.data.synthetic.world import (
    ATTRIBUTES,
    RELATIONS,
    Scene,
    SceneObject,
    relation_holds,
    relation_of_offsets,
)

Desc = Mapping[str, str]
Clause = Mapping[str, object]
Meaning = Sequence[Clause]


BACKGROUND_FIELDS = ("tone", "hue")


def matches(obj: SceneObject, desc: Desc) -> bool:
    """Whether ``obj`` has every attribute value named in ``desc`` (a shape concept by extension)."""
    return all(obj.shape in SHAPE_CONCEPTS[value] if name == "shape" else obj.attribute(name) == value
               for name, value in desc.items())


def background_matches(scene: Scene, clause: Clause) -> bool:
    """Whether the background has the tone and hue a ``background`` clause names (either may be
    absent)."""
    bg = scene.background
    return all(getattr(bg, f) == clause[f] for f in BACKGROUND_FIELDS if f in clause)


def clause_holds(clause: Clause, scene: Scene) -> bool:
    """Whether one clause is true of ``scene`` (see the module table)."""
    kind = clause["kind"]
    objects = scene.objects
    if kind == "exists":
        return any(matches(o, clause["desc"]) for o in objects)
    if kind == "count":
        return sum(matches(o, clause["desc"]) for o in objects) == clause["n"]
    if kind == "relation":
        return any(
            i != j and matches(x, clause["a"]) and matches(y, clause["b"])
            and relation_holds(clause["rel"], x, y, scene.size)
            for i, x in enumerate(objects) for j, y in enumerate(objects)
        )
    if kind == "background":
        return background_matches(scene, clause)
    if kind == "total":
        return len(objects) == clause["n"]
    raise ValueError(f"unknown clause kind {kind!r}")


def holds(meaning: Meaning, scene: Scene) -> bool:
    """Whether every clause of ``meaning`` is true of ``scene``."""
    return all(clause_holds(c, scene) for c in meaning)


class TruthTable:
    """Decide meanings against a fixed list of scenes at once.

    Objects are laid out as ``(N, K)`` attribute-code arrays (``K`` = most objects in a scene,
    padded with -1) and the relations as ``(N, K, K)`` boolean arrays computed from the centres by
    the same definition as :func:`~icr.data.synthetic.world.relation_holds`, so one meaning costs a
    few vectorised operations whatever ``N``.
    """

    def __init__(self, scenes: Sequence[Scene]) -> None:
        n = len(scenes)
        k = max((len(s.objects) for s in scenes), default=1) or 1
        self._codes: dict[str, dict[str, int]] = {a: {} for a in ATTRIBUTES}
        self._attr = {a: np.full((n, k), -1, dtype=np.int32) for a in ATTRIBUTES}
        centres = np.full((n, k, 2), np.nan)
        self.num_objects = np.array([len(s.objects) for s in scenes], dtype=np.int64)
        self._background = {f: np.array([getattr(s.background, f) for s in scenes])
                            for f in BACKGROUND_FIELDS}
        for i, scene in enumerate(scenes):
            for p, obj in enumerate(scene.objects):
                for a in ATTRIBUTES:
                    self._attr[a][i, p] = self._code(a, obj.attribute(a))
                centres[i, p] = obj.cx, obj.cy
        size = scenes[0].size if scenes else 1
        if any(s.size != size for s in scenes):
            raise ValueError("a TruthTable needs scenes of one image size")
        dx = centres[:, None, :, 0] - centres[:, :, None, 0]  # (N, K, K): [i, p, q] = q.cx - p.cx
        dy = centres[:, None, :, 1] - centres[:, :, None, 1]
        distinct = ~np.eye(k, dtype=bool)[None]  # an object is in no relation with itself
        with np.errstate(invalid="ignore"):  # NaN offsets of padding compare False
            self._rel = {r: relation_of_offsets(r, dx, dy, size) & distinct for r in RELATIONS}
        self._shape = (n, k)

    def _code(self, attribute: str, value: str) -> int:
        return self._codes[attribute].setdefault(value, len(self._codes[attribute]))

    def _match(self, desc: Desc) -> np.ndarray:
        out = self._attr["shape"] >= 0  # (N, K) real objects
        for name, value in desc.items():
            if name == "shape":
                codes = [self._codes["shape"][s] for s in SHAPE_CONCEPTS[value]
                         if s in self._codes["shape"]]
                out = out & np.isin(self._attr["shape"], codes)
            else:
                code = self._codes[name].get(value, -2)  # -2: a value no scene has
                out = out & (self._attr[name] == code)
        return out

    def clause(self, clause: Clause) -> np.ndarray:
        """``(N,)`` bool: the scenes of which ``clause`` is true."""
        kind = clause["kind"]
        if kind == "exists":
            return self._match(clause["desc"]).any(axis=1)
        if kind == "count":
            return self._match(clause["desc"]).sum(axis=1) == clause["n"]
        if kind == "relation":
            a = self._match(clause["a"])[:, :, None]  # (N, K, 1)
            b = self._match(clause["b"])[:, None, :]  # (N, 1, K)
            return (a & b & self._rel[clause["rel"]]).any(axis=(1, 2))
        if kind == "background":
            out = np.ones(self._shape[0], dtype=bool)
            for f in BACKGROUND_FIELDS:
                if f in clause:
                    out &= self._background[f] == clause[f]
            return out
        if kind == "total":
            return self.num_objects == clause["n"]
        raise ValueError(f"unknown clause kind {kind!r}")

    def holds(self, meaning: Meaning) -> np.ndarray:
        """``(N,)`` bool: the scenes of which every clause of ``meaning`` is true."""
        out = np.ones(self._shape[0], dtype=bool)
        for c in meaning:
            out &= self.clause(c)
        return out
