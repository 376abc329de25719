"""Weakly supervised phrase grounding (Gupta et al., "Contrastive Learning for Weakly Supervised
Phrase Grounding", ECCV 2020).

- :mod:`icr.grounding.words`: part-of-speech tags, the selected content words of each caption, and
  their contextual word-piece features from a frozen BERT-architecture encoder (cached on disk);
- :mod:`icr.grounding.data`: :class:`~icr.grounding.data.GroundingSplit`, regions and boxes per
  image, phrases and ground-truth boxes per caption (Flickr30K Entities format);
- :mod:`icr.grounding.model`, :mod:`icr.grounding.losses`: the word-region attention and the two
  contrastive losses;
- :mod:`icr.grounding.quality`: whether the negative captions of a generator are really false of
  their image, judged on the embedded benchmark's ground truth.

The evaluation (Recall@k, pointing accuracy) is :mod:`icr.metrics.grounding`.
"""
