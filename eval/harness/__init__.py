"""The accuracy harness: pass@1, tokens/s and peak KV of methods x budgets x benchmarks.

Benchmarks (:mod:`.benchmarks`), prompts (:mod:`.prompts`), method specs (:mod:`.methods`), the
validated run config (:mod:`.config`), the resumable runner (:mod:`.runner`), its reports
(:mod:`.report`), the ``dynts eval`` command (:mod:`.cli`), the demo (:mod:`.demo`, ``dynts demo``),
the testbed error breakdown (:mod:`.testbed_errors`) and the decode-cost measurement by position
(:mod:`.decode_bench`, its output :mod:`.decode_report`; ``scripts/bench_decode.py`` and ``scripts/gpu_check.py``).

May import ``dynts`` and ``data_pipeline``; never ``trainers``, :mod:`eval.analyses` or
:mod:`eval.rescue` (they build on this room, not the other way).
"""
