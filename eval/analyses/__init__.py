"""The analyses of the paper's section 3 (and B.2) over trace datasets: which thinking tokens matter.

Trace schema and builders (:mod:`.traces`), Pareto retention curves (:mod:`.pareto`), importance
sparsity (:mod:`.sparsity`), part of speech by importance (:mod:`.pos`), plots (:mod:`.plots`), the
``dynts analyze`` command (:mod:`.cli`) and the notebooks in ``notebooks/``.

May import ``dynts``, ``data_pipeline``, ``trainers`` (the testbed checkpoints' helpers) and
:mod:`eval.harness` (benchmarks); never :mod:`eval.rescue`.
"""
