"""The accuracy harness: pass@1, tokens/s and peak KV of methods x budgets x benchmarks.

Benchmarks (:mod:`.benchmarks`), prompts (:mod:`.prompts`), method specs (:mod:`.methods`), the
validated run config (:mod:`.config`), its cells (:mod:`.plan`, run by :mod:`.cell_run`), the resumable runner
(:mod:`.runner`, on worker processes: :mod:`.workers`), its reports
(:mod:`.report`, :mod:`.records`), the paired tables (:mod:`.compare`, :mod:`.stats`), the loop rule
(:mod:`.loops`), the ``dynts eval`` command (:mod:`.cli`), the demo (:mod:`.demo`, ``dynts demo``), the
testbed error breakdown (:mod:`.testbed_errors`), settings tuned on dev (:mod:`.tuning`, :mod:`.tuning_grid`),
the ledger of final reads (:mod:`.ledger`), runs carried between machines (:mod:`.carried`) and the per-seed
verdicts and models (:mod:`.seeds`, :mod:`.seed_models`). The performance benches are :mod:`eval.perf`.

May import ``dynts`` and ``data_pipeline``; never ``trainers``, :mod:`eval.analyses`, :mod:`eval.rescue` or
:mod:`eval.perf` (they build on this room or beside it, not under it).
"""
