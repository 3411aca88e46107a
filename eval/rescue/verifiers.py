"""The step scorers of ``dynts rescue``: what ``--prm NAME`` names.

* ``testbed-verifier[:family]`` -- :func:`testbed_step_verifier`, the exact step check of the testbed
  (the ideal process reward the trained testbed PRMs approximate; an upper-bound reference);
* ``likelihood:<model>`` -- a full-context causal LM as verifier (:class:`dynts.rescue.LikelihoodPRM`);
* ``A*B`` -- the product of two or more of these (:class:`dynts.rescue.ProductPRM`);
* anything else -- :func:`dynts.rescue.load_prm` (a trained PRM, e.g. ``testbed-prm-order``).

:func:`load_eval_prm` builds them; :data:`DEFAULT_VERIFIER` (a PRM alone, as in the paper) is the default of
``dynts rescue`` and of :class:`eval.rescue.config.RescueEvalConfig`; :func:`default_verifier` gives each testbed
family's PRM by its helper, :func:`product_verifier` the product with that helper's likelihood.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

__all__ = ["DEFAULT_VERIFIER", "FAMILY_VERIFIERS", "default_verifier", "load_eval_prm", "product_verifier", "testbed_step_verifier"]

# The verifier of KV-Rescue is a process reward model alone, as in the paper (Qwen2.5-Math-PRM-7B): the default of
# `dynts rescue` and of RescueEvalConfig is each family's PRM, keyed by the helper of that family.
# The product with the full-context helper's likelihood (dynts.rescue.scorer.ProductPRM, `--prm 'PRM*likelihood:HELPER'`,
# :func:`product_verifier`) stays an option; docs/rescue.md reports both ("The step PRM of the fair chain models").
DEFAULT_VERIFIER = "testbed-prm-order"
FAMILY_VERIFIERS = {"testbed-helper": DEFAULT_VERIFIER,
                    "testbed-chain-helper": "testbed-chain-prm",
                    "checkpoints/testbed-chain-fair-helper": "checkpoints/testbed-chain-fair-step-prm"}


def default_verifier(helper: str) -> str:
    """The PRM of ``helper``'s testbed family (:data:`FAMILY_VERIFIERS`), else :data:`DEFAULT_VERIFIER`."""
    return FAMILY_VERIFIERS.get(helper, DEFAULT_VERIFIER)


def product_verifier(helper: str) -> str:
    """The option beside the default: ``helper``'s family PRM times ``helper``'s own likelihood
    (``PRM*likelihood:HELPER``; the helper already holds the full context, so it costs no memory)."""
    return f"{default_verifier(helper)}*likelihood:{helper}"


def testbed_step_verifier(question: str, steps: Sequence[str], family: str = "copy") -> float:
    """An exact step checker for the testbed, usable as ``prm=`` (a :class:`~dynts.rescue.CallablePRM`):
    the *ideal* process reward the trained testbed PRM approximates, for an upper-bound reference.
    1.0 when :func:`data_pipeline.testbed.steps.check_step` passes the last step given the ones before it, else 0.0.
    """
    from data_pipeline.testbed.steps import check_step

    return float(check_step(question, steps, family))


def load_eval_prm(name: str, delimiter: str, trust_remote_code: bool = False, load_options: dict[str, Any] | None = None):
    """The step scorer named ``name``: ``"testbed-verifier"`` (exact step check; ``testbed-verifier:chain``
    for the chain family), ``"likelihood:<model>"``
    (a causal LM as verifier), ``"A*B"`` (the product of two or more of these:
    :class:`~dynts.rescue.ProductPRM`) or anything :func:`dynts.rescue.load_prm` takes; placed with the
    ``dtype``/``device`` of ``load_options``."""
    from dynts.rescue import CallablePRM, load_prm

    placement = {k: v for k, v in (load_options or {}).items() if k in ("dtype", "device") and v is not None}
    if "*" in name:  # a product of verifiers, e.g. testbed-prm-order*likelihood:testbed-helper
        from dynts.rescue import ProductPRM

        return ProductPRM([load_eval_prm(part, delimiter, trust_remote_code, load_options) for part in name.split("*")])
    if name.split(":")[0] == "testbed-verifier":  # testbed-verifier[:chain]: the exact step check of a family
        from data_pipeline.testbed import task

        family = task.check_family(name.split(":", 1)[1] if ":" in name else "copy", "--prm testbed-verifier:<family>")
        return CallablePRM(functools.partial(testbed_step_verifier, family=family))
    if name.startswith("likelihood:"):  # a causal LM as verifier, e.g. likelihood:testbed
        return load_prm(name.split(":", 1)[1], kind="likelihood", trust_remote_code=trust_remote_code, **placement)
    return load_prm(name, step_delimiter=delimiter, trust_remote_code=trust_remote_code, **placement)
