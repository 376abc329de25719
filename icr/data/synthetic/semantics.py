"""What a caption means, and whether it is true of a scene.

A caption's meaning is a conjunction of clauses, stored as JSON-ready dicts so that ``scenes.json``
carries them verbatim. A *description* ``desc`` maps some of the attributes in
:data:`~icr.data.synthetic.world.ATTRIBUTES` to values; an object matches it when it has all of them.

===============  =================================================  ===============================
kind             fields                                             true of a scene when
===============  =================================================  ===============================
``exists``       ``desc``                                           some object matches ``desc``
``count``        ``desc``, ``n``                                    exactly ``n`` objects match
``relation``     ``rel``, ``a``, ``b`` (descs)                      objects x != y match ``a``, ``b``
                                                                    and ``rel`` holds for (x, y)
``background``   ``tone``                                           the background has that tone
``total``        ``n``                                              the scene has exactly ``n`` objects
===============  =================================================  ===============================

:func:`holds` decides one scene with plain loops (the oracle); :class:`TruthTable` decides a meaning
against many scenes at once with NumPy (used for the CxC extended positives). Both rest on
:func:`~icr.data.synthetic.world.relation_holds`, the single definition of the spatial relations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from icr.data.synthetic.world import ATTRIBUTES, RELATIONS, Scene, SceneObject, relation_holds

Desc = Mapping[str, str]
Clause = Mapping[str, object]
Meaning = Sequence[Clause]


def matches(obj: SceneObject, desc: Desc) -> bool:
    """Whether ``obj`` has every attribute value named in ``desc``."""
    return all(obj.attribute(name) == value for name, value in desc.items())


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
        return scene.background.tone == clause["tone"]
    if kind == "total":
        return len(objects) == clause["n"]
    raise ValueError(f"unknown clause kind {kind!r}")


def holds(meaning: Meaning, scene: Scene) -> bool:
    """Whether every clause of ``meaning`` is true of ``scene``."""
    return all(clause_holds(c, scene) for c in meaning)


class TruthTable:
    """Decide meanings against a fixed list of scenes at once.

    Objects are laid out as ``(N, K)`` attribute-code arrays (``K`` = most objects in a scene,
    padded with -1) and the relations as ``(N, K, K)`` boolean arrays, so one meaning costs a few
    vectorised operations whatever ``N``.
    """

    def __init__(self, scenes: Sequence[Scene]) -> None:
        n = len(scenes)
        k = max((len(s.objects) for s in scenes), default=1) or 1
        self._codes: dict[str, dict[str, int]] = {a: {} for a in ATTRIBUTES}
        self._attr = {a: np.full((n, k), -1, dtype=np.int32) for a in ATTRIBUTES}
        self._rel = {r: np.zeros((n, k, k), dtype=bool) for r in RELATIONS}
        self.num_objects = np.array([len(s.objects) for s in scenes], dtype=np.int64)
        self._tone = np.array([s.background.tone for s in scenes])
        for i, scene in enumerate(scenes):
            for p, obj in enumerate(scene.objects):
                for a in ATTRIBUTES:
                    self._attr[a][i, p] = self._code(a, obj.attribute(a))
                for q, other in enumerate(scene.objects):
                    if p != q:
                        for r in RELATIONS:
                            self._rel[r][i, p, q] = relation_holds(r, obj, other, scene.size)
        self._shape = (n, k)

    def _code(self, attribute: str, value: str) -> int:
        return self._codes[attribute].setdefault(value, len(self._codes[attribute]))

    def _match(self, desc: Desc) -> np.ndarray:
        out = self._attr["shape"] >= 0  # (N, K) real objects
        for name, value in desc.items():
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
            return self._tone == clause["tone"]
        if kind == "total":
            return self.num_objects == clause["n"]
        raise ValueError(f"unknown clause kind {kind!r}")

    def holds(self, meaning: Meaning) -> np.ndarray:
        """``(N,)`` bool: the scenes of which every clause of ``meaning`` is true."""
        out = np.ones(self._shape[0], dtype=bool)
        for c in meaning:
            out &= self.clause(c)
        return out
