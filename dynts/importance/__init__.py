"""Token importance labels for training the DynTS predictor, without ``T x T`` attention.

``answer`` is the DynTS paper's label (Eq. 6); ``future``, ``golden`` and ``counterfactual`` score what the
rest of the reasoning reads, not only the answer (:mod:`dynts.importance.labels`).
"""

from .answer import Importance, answer_importance, final_hidden_states
from .counterfactual import CounterfactualSettings, counterfactual_importance
from .future import FutureSettings, future_importance
from .golden import GoldenSettings, golden_importance
from .labels import LABELS, label_settings, sequence_importance, token_importance

__all__ = [
    "LABELS",
    "CounterfactualSettings",
    "FutureSettings",
    "GoldenSettings",
    "Importance",
    "answer_importance",
    "counterfactual_importance",
    "final_hidden_states",
    "future_importance",
    "golden_importance",
    "label_settings",
    "sequence_importance",
    "token_importance",
]
