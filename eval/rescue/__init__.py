"""The KV-Rescue bench: an evicted base model, a full-context helper and a PRM vs. best-of-N.

The comparison's config and its cells' keys (:mod:`.config`), the cell runner (:mod:`.bench`), the step
scorers (:mod:`.verifiers`), the tables, one run's ``results.md`` and one over runs (:mod:`.table`),
detector calibration (:mod:`.calibrate`), the oracle choice between the evicted base and the helper
(:mod:`.oracle_choice`, paper Fig. 1a) and the ``dynts rescue {bench,generate,calibrate}`` command
(:mod:`.cli`). The method itself lives in
:mod:`dynts.rescue`.

May import ``dynts``, ``data_pipeline``, ``trainers`` (the testbed PRM) and :mod:`eval.harness`
(benchmarks, prompts, run fingerprints); never :mod:`eval.analyses`.
"""
