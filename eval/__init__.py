"""Evaluation of eviction methods, in four rooms, one per job:

* :mod:`eval.harness`  - the accuracy harness: benchmarks, prompts, method specs, ``dynts eval``,
  its reports and the demo (``dynts demo``).
* :mod:`eval.analyses` - the analyses of the paper's section 3 (Pareto retention, sparsity, POS by
  importance) over trace datasets, ``dynts analyze`` and the notebooks.
* :mod:`eval.rescue`   - the KV-Rescue bench (``dynts rescue``).
* :mod:`eval.perf`     - the performance benches (decode cost by position, the vLLM worker hooks'
  per-step cost, host-sync counting) that ``scripts/bench_*.py`` and ``scripts/gpu_check.py`` run.

Imports go one way: ``eval.analyses`` and ``eval.rescue`` may use ``eval.harness`` (benchmarks,
prompts), never each other, and ``eval.harness`` uses neither; ``eval.perf`` uses ``dynts`` only. All
build on ``dynts`` (and, but ``eval.perf``, on ``data_pipeline``); nothing in ``dynts`` imports ``eval``
(``dynts/cli.py`` dispatches lazily).
``tests/test_import_graph.py`` checks these rules.
"""
