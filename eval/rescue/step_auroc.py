"""Step and answer AUROC of ``--prm`` verifiers on ``dev``: does a verifier judge the steps KV-Rescue proposes?

KV-Rescue commits, at every step, the candidate its verifier scores highest, so the verifier has to tell right
steps from wrong ones among the candidates both policies write. This scores any verifier ``dynts rescue --prm``
takes (:func:`eval.rescue.verifiers.load_eval_prm`, ``A*B`` products included) on two held-out sets:

* **steps** (``--traces DIR``): policy traces on ``dev`` problems written by ``python -m eval.rescue.prm_traces --namespace dev``
  (:mod:`trainers.testbed_prm_traces`: the evicted base under every base evictor and budget, the base and the helper
  at full cache), each labelled step asked as the search asks it (a :class:`~dynts.rescue.StepRequest`: the committed
  steps split at the delimiter, the step as the candidate; an answer step with EOS), labelled by the testbed's oracle;
* **answers** (``--samples RUN_DIR``): the real answers of a ``dynts eval`` run (the LRM at full cache on ``dev``), as
  :func:`eval.rescue.answers.answer_requests_from_samples` reads them (labelled by the exact grader).

AUROC with a bootstrap 95 % interval over problems (:func:`eval.rescue.answers.grouped_auroc`). The record keeps every
score, label and problem, so :func:`step_table` recomputes the table from it (``tests/test_docs_tables.py``):

``python -m eval.rescue.step_auroc --traces runs/prm-traces/chain-fair-s1-dev --samples runs/rescue-fair-s1/dev-full-k5
--tokenizer checkpoints/testbed-chain-fair-s1-lrm --prm A --prm 'A*likelihood:H' ... --out reports/prm-....json``;
``python -m eval.rescue.step_auroc table FILE`` prints the table.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["kept_scores", "main", "reused_scores", "step_requests_from_traces", "step_table"]


def step_requests_from_traces(trace_dir: str | Path, tokenizer: Any, delimiter: str = ";") -> tuple[list[Any], list[int], list[str], dict[str, Any]]:
    """Every labelled step of the trace rows under ``trace_dir`` as a step request, its oracle label, its problem
    (for the bootstrap) and counts: ``(requests, labels, groups, info)``. A thinking step's candidate runs from the
    previous ``;`` to its own; the answer's (after ``</think>``) ends with EOS in place of the PRM's ``;``."""
    from data_pipeline.testbed import task
    from dynts.rescue import StepRequest
    from eval.rescue.answers import delimiter_test, split_steps
    from trainers.testbed_prm_traces import IGNORE, load_trace_rows

    is_delimiter = delimiter_test(tokenizer, delimiter)
    rows = load_trace_rows(trace_dir)
    requests, labels, groups, kinds = [], [], [], []
    by_policy: dict[str, list[int]] = {}
    for row in rows:
        ids = tokenizer.convert_tokens_to_ids(row["tokens"])
        prompt = task.QUESTION_TOKENS
        question = " ".join(row["tokens"][1 : prompt - 1])
        previous = prompt
        for j, label in enumerate(row["labels"]):
            if label == IGNORE:
                continue
            committed, _ = split_steps(ids[prompt:previous], is_delimiter)
            candidate = ids[previous : j + 1]
            answer = task.END_THINK in row["tokens"][previous : j + 1]
            if answer:
                candidate = candidate[:-1] + [tokenizer.eos_token_id]
            requests.append(StepRequest(question=question, prompt_ids=ids[:prompt], steps=committed, candidate=candidate,
                                        tokenizer=tokenizer))
            labels.append(int(label))
            groups.append(row["problem"])
            kinds.append("answer" if answer else "step")
            by_policy.setdefault(row["policy"], []).append(int(label))
            previous = j + 1
    info = {"trace_dir": str(trace_dir), "traces": len(rows), "problems": len(set(groups)), "steps": len(labels),
            "wrong": labels.count(0), "answers": kinds.count("answer"),
            "by_policy": {p: {"steps": len(v), "wrong": v.count(0)} for p, v in sorted(by_policy.items())}}
    return requests, labels, groups, info


def reused_scores(record: str | Path, labels: Sequence[int], groups: Sequence[str]) -> dict[str, list[float]]:
    """The per-verifier answer scores of an :mod:`eval.rescue.answers` record, refused unless its labels and problems
    are ``labels`` and ``groups`` item for item (the same samples, read the same way)."""
    doc = json.loads(Path(record).read_text())
    saved = doc["samples"]["scores"]
    if saved["labels"] != list(labels) or saved["groups"] != list(groups):
        raise SystemExit(f"step_auroc: --answers-from {record} holds other answers than --samples (labels or problems differ)")
    return {v: saved[v] for v in doc["verifiers"] if "*" not in v}


def kept_scores(record: str | Path, name: str, keep: Sequence[str], labels: Sequence[int], groups: Sequence[str]) -> dict[str, list[float]]:
    """The ``name`` set's (``steps`` / ``answers``) scores of the verifiers ``keep`` in an earlier step_auroc record,
    refused unless that set's labels and problems are ``labels`` and ``groups`` item for item, or a verifier is missing."""
    saved = json.loads(Path(record).read_text())[name]["scores"]
    if saved["labels"] != list(labels) or saved["groups"] != list(groups):
        raise SystemExit(f"step_auroc: --scores-from {record} holds other {name} than this run (labels or problems differ)")
    missing = [v for v in keep if v not in saved]
    if missing:
        raise SystemExit(f"step_auroc: --scores-from {record} has no {name} scores of {missing}")
    return {v: saved[v] for v in keep}


def _recomputed(scored: dict[str, Any], verifier: str, resamples: int) -> dict[str, Any]:
    from eval.rescue.answers import grouped_auroc

    s = scored["scores"]
    return grouped_auroc(s[verifier], s["labels"], s["groups"], resamples)


def step_table(doc: dict[str, Any]) -> str:
    """The markdown table of a record: per verifier, its dev step AUROC and dev answer AUROC with 95 % CIs, each
    recomputed from the record's scores (``0.912 [0.890, 0.931]``)."""
    from eval.rescue.answers import auroc_text

    steps, answers = doc["steps"], doc["answers"]
    rows = [f"| verifier | dev steps AUROC [95 % CI] ({steps['info']['steps']:,}, {steps['info']['wrong']:,} wrong) "
            f"| dev answers AUROC [95 % CI] ({answers['info']['answers']:,}, {answers['info']['wrong']} wrong) |", "|---|---|---|"]
    for v in doc["verifiers"]:
        rows.append(f"| `{v}` | {auroc_text(_recomputed(steps, v, doc['bootstrap']))} | "
                    f"{auroc_text(_recomputed(answers, v, doc['bootstrap']))} |")
    return "\n".join(rows)


def table_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.rescue.step_auroc table", description=step_table.__doc__)
    p.add_argument("record", help="a JSON file written by python -m eval.rescue.step_auroc ... --out FILE")
    args = p.parse_args(argv)
    print(step_table(json.loads(Path(args.record).read_text())))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["table"]:
        return table_main(argv[1:])
    import torch

    from dynts.models import load_tokenizer
    from eval.rescue.answers import answer_requests_from_samples, auroc_text, grouped_auroc, score_verifiers

    p = argparse.ArgumentParser(prog="python -m eval.rescue.step_auroc",
                                description="step and answer AUROC of dynts rescue verifiers on dev traces and dev answers")
    p.add_argument("--prm", action="append", required=True, help="a verifier as dynts rescue --prm names it (repeat)")
    p.add_argument("--traces", required=True, help="held-out policy traces (python -m eval.rescue.prm_traces --namespace dev --out-dir DIR)")
    p.add_argument("--samples", required=True, help="a dynts eval run directory on dev whose samples/ holds the answers")
    p.add_argument("--cell", default=None, help="the samples cell to read, when the run has several")
    p.add_argument("--family", default="chain", help="the testbed family of the grader")
    p.add_argument("--tokenizer", default="checkpoints/testbed-chain-fair-lrm", help="the policy's tokenizer (a model dir)")
    p.add_argument("--delimiter", default=";")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples over problems for the 95 %% interval")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--answers-from", default=None,
                   help="an eval.rescue.answers record of the same --samples (the same labels and problems): the answers' scores "
                        "of the verifiers it holds are taken from it, not scored again")
    p.add_argument("--scores-from", default=None,
                   help="an earlier step_auroc record of the same --traces and --samples: the scores of the --keep verifiers "
                        "(unchanged checkpoints) are taken from it, not scored again")
    p.add_argument("--keep", action="append", default=[], help="a verifier (a factor) whose --scores-from scores are reused (repeat)")
    p.add_argument("--out", required=True, help="write the JSON record here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.tokenizer)
    sets = {"steps": step_requests_from_traces(args.traces, tokenizer, args.delimiter),
            "answers": answer_requests_from_samples(args.samples, tokenizer, args.delimiter, args.cell, args.family)}
    if bool(args.scores_from) != bool(args.keep):
        raise SystemExit("step_auroc: --scores-from and --keep go together")
    if not all(g.startswith("dev:") for g in sets["steps"][2]):
        raise SystemExit(f"step_auroc: --traces {args.traces} holds problems outside dev (python -m eval.rescue.prm_traces --namespace dev)")
    if "set=dev" not in sets["answers"][3]["benchmark"].split(","):
        raise SystemExit(f"step_auroc: --samples {args.samples} is not a dev run ({sets['answers'][3]['benchmark']})")
    out: dict[str, Any] = {"command": "python -m eval.rescue.step_auroc " + " ".join(shlex.quote(a) for a in argv),
                           "verifiers": list(args.prm), "bootstrap": args.bootstrap}
    from dynts.io import write_atomic

    partial = Path(str(args.out) + ".partial")  # each scored set, so a run stopped at its time limit resumes
    done = json.loads(partial.read_text()) if partial.exists() else {}
    for name, (requests, labels, groups, info) in sets.items():
        print(f"{name}: {json.dumps({k: v for k, v in info.items() if k != 'by_policy'})}")
        saved = done.get(name, {})
        if done.get("verifiers") == out["verifiers"] and saved.get("scores", {}).get("labels") == labels \
                and saved["scores"].get("groups") == groups:
            out[name] = saved
            print(f"  {name}: scores from {partial} (a stopped run of the same verifiers)")
            continue
        known = reused_scores(args.answers_from, labels, groups) if name == "answers" and args.answers_from else {}
        if known:
            info["scores_from"] = {"record": args.answers_from, "verifiers": sorted(known)}
        if args.scores_from and args.keep:
            kept = kept_scores(args.scores_from, name, args.keep, labels, groups)
            known.update(kept)
            info["kept_from"] = {"record": args.scores_from, "verifiers": sorted(kept)}
        scores = score_verifiers(args.prm, requests, args.delimiter, known=known)
        out[name] = {"info": info, "auroc": {v: grouped_auroc(s, labels, groups, args.bootstrap) for v, s in scores.items()},
                     "scores": {"labels": labels, "groups": groups, **{v: [round(x, 6) for x in s] for v, s in scores.items()}}}
        for v, r in out[name]["auroc"].items():
            print(f"  {v:70s} AUROC {auroc_text(r)}")
        write_atomic(partial, json.dumps({"verifiers": out["verifiers"], **{k: out[k] for k in sets if k in out}}))
    write_atomic(Path(args.out), json.dumps(out, indent=1))
    partial.unlink(missing_ok=True)
    print(step_table(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
