"""Evaluation of eviction methods: benchmarks, grading, the ``dynts eval`` harness and the demo.

Builds on ``dynts`` (generation), ``data_pipeline`` (the testbed task) and ``trainers``; nothing in
``dynts`` imports it (``dynts/cli.py`` dispatches into :mod:`eval.cli` lazily).
"""
