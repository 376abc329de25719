"""How the dashboard, the logs and the status lines name a trial.

``trial 8e58e_00000 [lagrangian eta=0.1]``: Tune's trial id and what the trial trains, its
condition and the values that tell it apart (:class:`~studies.trials.TrialSpec`). The actors
of the trials carry it as their Repr in Ray's dashboard
(:func:`studies.frameworks.tune.labelled_trainable`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from studies.trials import KEY


def trial_label(trial_id: str, config: Mapping[str, Any]) -> str:
    """``trial <id> [<condition> key=value ...]`` for a trial whose Tune config is ``config``:
    its condition and its values (dotted keys, 4 significant digits)."""
    spec = config.get(KEY)
    if spec is None:
        return f"trial {trial_id}"
    values = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in spec.values.items())
    return f"trial {trial_id} [{' '.join(filter(None, [spec.condition, values]))}]"
