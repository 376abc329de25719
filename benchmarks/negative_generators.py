"""How often each negative-caption generator's substitutes are really false of the image.

    python benchmarks/negative_generators.py [--workspace DIR] [--preset default]
        [--negatives 5] [--candidates 30 15 10 5]

``L_lang`` of the phrase-grounding paper (Gupta et al., ECCV 2020, Sec. 2.4) assumes that a caption
with one noun replaced is false of its image. On the embedded benchmark every substituted training
caption can be judged against the image's scene (:mod:`icr.grounding.quality`). This prints, for
the ``random`` generator and for the ``context`` generator at several candidate pools (the LM's
top ``--candidates`` nouns re-ranked by p(s'|masked) / (q(s'|unmasked) + 1e-6); a pool equal to
``--negatives`` is the LM's top nouns without re-ranking), the share of substituted captions that
are true negatives, false negatives and unjudged, and the share whose substitute is a word of the
same kind as the masked one (a shape noun for a shape noun, a colour for a colour, ...): the
substitutes that keep the caption's grammar, i.e. that preserve its context.

All settings use the same masked nouns (seed 0), the same cached masked-LM head and the grounding
study's ``--negatives`` (5). Nothing here is timed.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from icr.config import GroundingConfig  # noqa: E402
from icr.data.synthetic import ensure_benchmark  # noqa: E402
from icr.data.synthetic.lexicon import lexicon  # noqa: E402
from icr.grounding.data import load_shapes_grounding  # noqa: E402
from icr.grounding.negatives import NegativeCaptions, negative_captions, noun_positions  # noqa: E402
from icr.grounding.quality import VERDICTS, load_shapes_truth, negative_quality  # noqa: E402
from icr.workspace import Workspace  # noqa: E402

# Kinds of word that can stand for each other in a caption of the shapes grammar.
_NOUN_KINDS = {"shape", "generic"}


def same_kind_share(negatives: NegativeCaptions) -> float:
    """The share of substitutes of the same kind as the word they replace (the lexicon's kinds;
    shape nouns and generic nouns count as one kind; words outside the lexicon never match)."""
    lex = lexicon()

    def kind(word: str) -> str | None:
        found = lex.get(word)
        if found is None:
            return None
        return "noun" if found[0] in _NOUN_KINDS else found[0]

    counts: Counter[bool] = Counter()
    for index, word, substitutes in zip(negatives.word_index, negatives.true_words,
                                        negatives.substitutes, strict=True):
        if index < 0:
            continue
        old = kind(word)
        counts.update(old is not None and kind(s) == old for s in substitutes)
    total = sum(counts.values())
    return counts[True] / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", help="workspace folder (default ./workspace or ICR_WORKSPACE)")
    parser.add_argument("--preset", default="default", help="benchmark preset (default)")
    parser.add_argument("--negatives", type=int, default=5, help="substitutes per caption (5)")
    parser.add_argument("--candidates", type=int, nargs="+", default=[30, 15, 10, 5],
                        help="candidate pools of the context generator (30 15 10 5)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    workspace = Workspace.resolve(args.workspace)
    root = ensure_benchmark(workspace.data / f"shapes-{args.preset}-0", args.preset, 0)
    truth = load_shapes_truth(root, "train")
    captions = list(load_shapes_grounding(root, "train", select_words=False).captions)
    positions = noun_positions(captions)
    cache = workspace.cache / "grounding"
    settings = [("random", "random", args.negatives)] + [
        (f"context, {c} candidates" + (" (no re-ranking)" if c <= args.negatives else ""),
         "context", max(c, args.negatives)) for c in args.candidates]
    rows = []
    for label, generator, candidates in settings:
        section = GroundingConfig(negatives=generator, num_negatives=args.negatives,
                                  mlm_candidates=candidates)
        made = negative_captions(section, captions, positions, cache,
                                 show_progress=not args.quiet)
        verdicts = negative_quality(truth, {"g": made})
        rows.append((label, *(verdicts[f"g_{v}"] for v in VERDICTS), same_kind_share(made),
                     int(verdicts["g_substitutes"])))
    print(f"negative_generators: {root.name}, {len(captions)} training captions, "
          f"{args.negatives} substitutes each")
    print("| generator | true negative | false negative | unjudged | same kind | substitutes |")
    print("| :--- | ---: | ---: | ---: | ---: | ---: |")
    for label, tn, fn, unknown, same, total in rows:
        print(f"| {label} | {tn:.3f} | {fn:.3f} | {unknown:.3f} | {same:.3f} | {total} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
