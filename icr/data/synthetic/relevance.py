"""Semantic (SPICE-like) nDCG relevance for the shapes world, computed from caption meanings.

SPICE (Anderson et al., ECCV 2016, section 3) parses a candidate caption and the reference captions
into scene graphs, splits each graph into a set of tuples (objects, object-attribute pairs,
object-relation-object triples), and scores the candidate by the F1 of its tuples against the union
of the references' tuples, tuples matching when equal up to WordNet synonyms. The shapes world needs
no parser: the generator stores every caption's meaning (:mod:`.semantics`), written in canonical
values, so synonyms ("box"/"square", "big"/"large", "with stripes"/"striped", "A left of B"/"B right
of A") already coincide there. A hypernym ("polygon") is its own head, as in SPICE, where WordNet
synonyms match but hypernyms do not. :func:`meaning_tuples` turns a meaning into these tuples:

=================================================  =============================================
tuple                                              from
=================================================  =============================================
``("object", shape)``                              a description naming the shape
``("attribute", head, name, value)``               each colour, size, texture, hpos, vpos of a
                                                   description; ``head`` is its shape, and the
                                                   tuple is also emitted with ``head = "object"``
``("count", "colour=red,shape=circle", n)``        a ``count`` clause (its whole description)
``("relation", rel, head_a, head_b)``              a ``relation`` clause, in canonical direction
                                                   (``right_of`` -> ``left_of``, ``below`` ->
                                                   ``above`` with the arguments swapped;
                                                   ``next_to`` with sorted arguments); each shape
                                                   head is also emitted as ``"object"``
``("background", field, value)``                   a ``background`` clause: one tuple for its
                                                   tone, one for its hue
``("total", n)``                                   a ``total`` clause
=================================================  =============================================

As in SPICE, a more specific description keeps the tuples of a less specific one ("a large red
circle" has those of "a red circle", plus one). Unlike SPICE, a shape head also yields the generic
head ``object`` ("a red circle" has the tuple of "a red shape"): the grammar's generic nouns (shape,
object, figure) describe the same objects without their shape, and a caption true of an image should
share its tuples with the image's captions. The bare ``("object", "object")`` is never emitted (it
is true of every image). Counts are not generalised: "two red circles" does not entail "two red
objects". Tuples are sets: a repeated proposition counts once.

Entry ``(i, j)`` of the ``(N_cap, N_img)`` matrix (:func:`caption_relevance`) is the F1 of query
caption ``i``'s tuples ``Q`` against the union ``R`` of image ``j``'s caption tuples::

    P = |Q & R| / |Q|,   R_ = |Q & R| / |R|,   F1 = 2 P R_ / (P + R_) = 2 |Q & R| / (|Q| + |R|)

The query stays among its own image's references and its own entry is *not* set to 1.0: it is
``2 |Q| / (|Q| + |R|)`` (precision 1). This follows TERN's SPICE relevance (``compute_relevance.py``
of mesnico/TERN stores SPICE's ``All`` F-score for every image, its own included); the 1.0 of the
ROUGE-L protocol comes out of ROUGE-L's max over references naturally, and is not transferred here.

Shapes: the matrices are float32 in [0, 1]; rows follow the query order, columns the image order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence, Set

import numpy as np
from scipy import sparse

from icr.data.synthetic.semantics import Clause, Desc, Meaning

GENERIC = "object"  # the head of a description that names no shape
# a relation and its converse share one tuple: (rel, a, b) is stored as (CANONICAL[rel], b, a)
CANONICAL = {"right_of": "left_of", "below": "above"}
SYMMETRIC = frozenset({"next_to"})

Proposition = tuple[str, ...]


def _heads(desc: Desc) -> tuple[str, ...]:
    """The head nouns a description supports: its shape (if any) and the generic head."""
    return (desc["shape"], GENERIC) if "shape" in desc else (GENERIC,)


def desc_tuples(desc: Desc) -> set[Proposition]:
    """Object and attribute tuples of one description (see the module table)."""
    out: set[Proposition] = set()
    if "shape" in desc:
        out.add(("object", desc["shape"]))
    for name, value in desc.items():
        if name != "shape":
            out.update(("attribute", head, name, value) for head in _heads(desc))
    return out


def _relation_tuples(clause: Clause) -> set[Proposition]:
    rel, a, b = clause["rel"], clause["a"], clause["b"]
    if rel in CANONICAL:
        rel, a, b = CANONICAL[rel], b, a
    out = set()
    for ha, hb in itertools.product(_heads(a), _heads(b)):
        if rel in SYMMETRIC:
            ha, hb = sorted((ha, hb))
        out.add(("relation", rel, ha, hb))
    return out | desc_tuples(a) | desc_tuples(b)


def clause_tuples(clause: Clause) -> set[Proposition]:
    """The tuples of one clause (see the module table)."""
    kind = clause["kind"]
    if kind == "exists":
        return desc_tuples(clause["desc"])
    if kind == "count":
        desc = clause["desc"]
        key = ",".join(f"{name}={desc[name]}" for name in sorted(desc))
        return desc_tuples(desc) | {("count", key, str(clause["n"]))}
    if kind == "relation":
        return _relation_tuples(clause)
    if kind == "background":
        return {("background", f, str(clause[f])) for f in ("tone", "hue") if f in clause}
    if kind == "total":
        return {("total", str(clause["n"]))}
    raise ValueError(f"unknown clause kind {kind!r}")


def meaning_tuples(meaning: Meaning) -> frozenset[Proposition]:
    """The set of tuples of a caption's meaning: the union over its clauses."""
    return frozenset().union(*(clause_tuples(c) for c in meaning))


def tuple_f1(queries: Sequence[Set], references: Sequence[Set]) -> np.ndarray:
    """F1 of every query tuple set against every reference tuple set, vectorised.

    ``F1 = 2 |Q & R| / (|Q| + |R|)`` (SPICE's F-score, section 3 of Anderson et al. 2016); 0 when
    both sets are empty. The overlaps come from one sparse product of 0/1 incidence matrices.

    Shapes:
        returns ``(len(queries), len(references))`` float32.
    """
    ids: dict[object, int] = {}
    q_rows = [[ids.setdefault(t, len(ids)) for t in s] for s in queries]
    r_rows = [[ids.setdefault(t, len(ids)) for t in s] for s in references]
    q, r = _incidence(q_rows, len(ids)), _incidence(r_rows, len(ids))  # (N_q, T), (N_r, T)
    overlap = (q @ r.T).toarray().astype(np.float64)  # (N_q, N_r) integer counts
    q_size = np.array([len(row) for row in q_rows], dtype=np.float64)[:, None]  # (N_q, 1)
    r_size = np.array([len(row) for row in r_rows], dtype=np.float64)[None, :]  # (1, N_r)
    total = q_size + r_size  # (N_q, N_r)
    f1 = np.divide(2 * overlap, total, out=np.zeros_like(overlap), where=total > 0)
    return f1.astype(np.float32)


def _incidence(rows: list[list[int]], width: int) -> sparse.csr_matrix:
    """``(len(rows), width)`` 0/1 CSR matrix with ones at each row's (distinct) column ids."""
    indptr = np.cumsum([0] + [len(row) for row in rows])
    indices = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=indptr[-1])
    data = np.ones(len(indices), dtype=np.float32)
    return sparse.csr_matrix((data, indices, indptr), shape=(len(rows), max(width, 1)))


def caption_relevance(
    query_meanings: Sequence[Meaning], image_meanings: Sequence[Sequence[Meaning]]
) -> np.ndarray:
    """Semantic relevance of every query caption to every image, against the images' captions.

    Args:
        query_meanings: the ``N_cap`` query captions' meanings (the rows, in evaluation order).
        image_meanings: per image (the columns, in evaluation order), its captions' meanings.

    Returns:
        ``(N_cap, N_img)`` float32 F1 scores in [0, 1] (see the module docstring).
    """
    queries = [meaning_tuples(m) for m in query_meanings]
    references = [frozenset().union(*map(meaning_tuples, ms)) for ms in image_meanings]
    return tuple_f1(queries, references)

