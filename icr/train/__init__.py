"""Training: ``fit`` (the seam to the platform), the tasks it trains, checkpoints, evaluation.

- :mod:`icr.train.seam`: :class:`EpochReport`, the one record per epoch that crosses to the
  platform (with :class:`StepModes`: how its steps ran), and :class:`FitResult`;
- :mod:`icr.train.loop`: ``fit`` and ``load_trained``, for every task;
- :mod:`icr.train.tasks`: the task protocol and registry (retrieval here, grounding in
  :mod:`icr.grounding`);
- :mod:`icr.train.retrieval`: the retrieval training state and its steps;
- :mod:`icr.train.checkpoint`: atomic checkpoint folders loaded with ``weights_only=True``;
- :mod:`icr.train.evaluation`: embedding and scoring a split;
- :mod:`icr.train.recipe`: the learning-rate schedule and the SWA snapshot steps.
"""

from icr.train.checkpoint import find_checkpoint
from icr.train.loop import fit, load_run, load_trained, resolve_device
from icr.train.seam import EpochReport, FitResult, Reporter, StepModes

__all__ = ["EpochReport", "FitResult", "Reporter", "StepModes", "find_checkpoint", "fit", "load_run",
           "load_trained", "resolve_device"]
