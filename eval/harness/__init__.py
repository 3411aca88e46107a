"""The accuracy harness: pass@1, tokens/s and peak KV of methods x budgets x benchmarks.

Benchmarks (:mod:`.benchmarks`), prompts (:mod:`.prompts`), method specs (:mod:`.methods`), the
validated run config (:mod:`.config`), the resumable runner (:mod:`.runner`), its reports
(:mod:`.report`, :mod:`.records`), the paired tables (:mod:`.compare`, :mod:`.stats`), the loop rule
(:mod:`.loops`), the ``dynts eval`` command (:mod:`.cli`), the demo (:mod:`.demo`, ``dynts demo``) and the
testbed error breakdown (:mod:`.testbed_errors`). The performance benches are :mod:`eval.perf`.

May import ``dynts`` and ``data_pipeline``; never ``trainers``, :mod:`eval.analyses`, :mod:`eval.rescue` or
:mod:`eval.perf` (they build on this room or beside it, not under it).
"""
