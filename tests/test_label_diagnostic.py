"""The label diagnostic's metrics and tables on constructed scores (the run itself: reports/label-diagnostic)."""

from __future__ import annotations

import torch

from eval.analyses.label_diagnostic import FUTURE_VARIANTS, LABEL_ORDER, table, trace_metrics, variant_name, variants_table


def test_recalls_count_the_top_k_of_the_thinking_span_only():
    truth = torch.tensor([9.0, 9.0, 5.0, 4.0, 3.0, 0.0, 0.0, 9.0])  # positions 0-1 question, 7 answer: outside 2..6
    label = torch.tensor([0.0, 0.0, 1.0, 0.0, 3.0, 2.0, 0.0, 0.0])
    got = trace_metrics(label, truth, critical=[2, 6], first=2, stop=7, k=2)
    assert got == {"cf": 0.0, "closure": 0.0}  # the label's top 2 = {4, 5}, the truth's in the span {2, 3}
    got = trace_metrics(label, truth, critical=[4, 6], first=2, stop=7, k=3)
    assert got == {"cf": 2 / 3, "closure": 0.5}  # {4, 5, 2} vs {2, 3, 4}; closure {4, 6}: 4 found


def test_tables_average_traces_per_label_seed_and_family():
    def run(family, seed, value):
        rows = [{"cf": value, "closure": 1.0}, {"cf": value / 2, "closure": 0.0}]
        forms = {f"{n} {variant_name(v)}": rows for v in FUTURE_VARIANTS for n in ("future", "golden")}
        return {"family": family, "seed": seed, "k": 24, "n": 2, "mean_length": 300.0,
                "labels": {name: rows for name in LABEL_ORDER}, "variants": forms}

    record = {"runs": [run("copy", 1, 0.4), run("chain", 2, 0.8), run("chain", 1, 0.2)]}
    lines = table(record).splitlines()
    assert lines[0] == "| label (recall@24 %: cf / closure) | chain s1 | chain s2 | copy s1 |"
    assert lines[2] == "| answer | 15 / 50 | 60 / 50 | 30 / 50 |"
    assert lines[-1] == "| *traces, mean tokens* | 2, 300 | 2, 300 | 2, 300 |"
    forms = variants_table(record).splitlines()
    assert forms[0] == "| label and future form | chain | copy |" and len(forms) == 2 + 2 * len(FUTURE_VARIANTS)
    assert forms[2].endswith("| 38 / 50 | 30 / 50 |")  # chain: the mean of its seeds' means (15, 60)
