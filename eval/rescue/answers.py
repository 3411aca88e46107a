"""Answer AUROC of ``--prm`` verifiers: how well a step scorer tells right answer steps from wrong ones.

KV-Rescue commits, at the answer, the candidate its verifier scores highest, so a verifier that reads
answers near chance leaves the answer to luck whatever the search proposes. This measures any verifier
``dynts rescue --prm`` takes (:func:`eval.rescue.verifiers.load_eval_prm`: a trained PRM directory,
``likelihood:<model>``, ``testbed-verifier:chain``, ``A*B`` products) on two sets of answer steps,
each scored as the search would ask it (a :class:`~dynts.rescue.StepRequest`: the question, the
committed steps split at the delimiter, the answer step as the candidate):

* **samples** (``--samples RUN_DIR``): the real answers of a ``dynts eval`` run directory (its
  ``samples/<cell>.jsonl``, e.g. the LRM with its full cache on ``set=dev`` problems). The candidate is
  everything after the last ``;`` before ``</think>`` (filler, ``</think> rK= v``) plus EOS, as the model
  wrote it; the label is the exact grader (:func:`data_pipeline.testbed.task.check_answer`) on the
  sample's text. Samples that never close the thinking have no answer step and are left out (counted).
* **gate** (``--gate-config CONFIG --gate N``): the synthetic held-out answers of a PRM's training
  config (:func:`trainers.testbed_prm.heldout` on the ``gate`` set: reference traces, corrupted and
  answered as in training), labelled as the PRM's gate labels them; the answer's closing ``;`` is the
  model's EOS here, as in the LRM's own answers.

A product ``A*B`` is scored as :class:`~dynts.rescue.ProductPRM` scores it (each factor on the same
requests, multiplied); each factor is scored once and shared by every product that names it.
AUROC is :func:`trainers.testbed_prm.auroc`; its 95 % interval is a bootstrap over problems (a
problem's ``k`` samples are resampled together).

``python -m eval.rescue.answers --samples runs/rescue-fair/dev-full-k5 --gate-config
configs/testbed/chain-fair-prm.yaml --gate 200 --prm checkpoints/testbed-chain-fair-prm --prm
likelihood:checkpoints/testbed-chain-fair-helper ... --out reports/prm-chain-fair-answers.json``

The verifier a rescue uses is then chosen by a rule fixed before the answers are scored
(:func:`choose_verifier`; ``python -m eval.rescue.answers choose FILE --first A --first B --then C``):
the highest real-answer AUROC among ``--first``, if it reaches the bar (0.8), else among ``--then``.
``python -m eval.rescue.answers table FILE --gate GATE_FILE`` prints the AUROC table docs/rescue.md shows.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["answer_requests_from_samples", "answers_table", "auroc_text", "choose_verifier", "delimiter_test", "gate_answer_requests", "grouped_auroc", "main", "score_verifiers", "weighted_aurocs",
           "split_steps"]


def split_steps(ids: Sequence[int], is_delimiter) -> tuple[list[list[int]], list[int]]:
    """``(steps, tail)``: ``ids`` cut after every token for which ``is_delimiter(token)`` holds (a step
    ends at its first delimiter token, as the search cuts candidates), and what follows the last one."""
    steps, current = [], []
    for t in ids:
        current.append(t)
        if is_delimiter(t):
            steps.append(current)
            current = []
    return steps, current


def delimiter_test(tokenizer: Any, delimiter: str):
    """``token_id -> bool``: whether the token's text contains ``delimiter`` (as the search cuts steps)."""
    vocab = tokenizer.get_vocab()
    ids = {i for tok, i in vocab.items() if delimiter in tokenizer.convert_tokens_to_string([tok])}
    if not ids:
        raise ValueError(f"delimiter={delimiter!r}: no token of the tokenizer contains it")
    return ids.__contains__


def answer_requests_from_samples(run_dir: str | Path, tokenizer: Any, delimiter: str = ";", cell: str | None = None,
                                 family: str = "chain") -> tuple[list[Any], list[int], list[str], dict[str, Any]]:
    """The answer steps of a ``dynts eval`` run directory's samples as step requests, their exact labels,
    the problem id of each (for the bootstrap) and counts: ``(requests, labels, groups, info)``."""
    from data_pipeline.testbed import task
    from dynts.rescue import StepRequest
    from eval.harness.benchmarks import load_benchmark
    from eval.harness.prompts import encode_prompts, user_message

    run = Path(run_dir)
    files = sorted((run / "samples").glob("*.jsonl"))
    if cell is not None:
        files = [f for f in files if f.stem == cell]
    if len(files) != 1:
        raise ValueError(f"{run}/samples holds {[f.stem for f in files]}: give the one cell to read (--cell KEY)")
    results = json.loads((run / "results.json").read_text())
    spec = next(r["benchmark"] for r in results if r["key"] == files[0].stem)
    bench = load_benchmark(spec)
    examples = {e.id: e for e in bench.examples}
    prompts = dict(zip(examples, encode_prompts(tokenizer, [user_message(e, bench) for e in bench.examples])))
    is_delimiter = delimiter_test(tokenizer, delimiter)
    end_think = tokenizer.convert_tokens_to_ids(task.END_THINK)
    eos = tokenizer.eos_token_id
    requests, labels, groups = [], [], []
    info = {"run_dir": str(run), "cell": files[0].stem, "benchmark": spec, "samples": 0, "no_answer_step": 0,
            "grader_disagrees_with_sample": 0}
    for line in files[0].read_text().splitlines():
        s = json.loads(line)
        info["samples"] += 1
        ex = examples[s["id"]]
        ids = tokenizer.encode(s["text"], add_special_tokens=False)
        if tokenizer.decode(ids, skip_special_tokens=False).split() != s["text"].split():
            raise ValueError(f"sample {s['id']}/{s['sample']}: its text does not re-tokenise to itself")
        if end_think not in ids:
            info["no_answer_step"] += 1
            continue
        close = ids.index(end_think)
        steps, tail = split_steps(ids[:close], is_delimiter)
        candidate = tail + ids[close:] + [eos]
        right = task.check_answer(ex.question, s["text"], family)
        info["grader_disagrees_with_sample"] += int(right != bool(s["correct"]))
        requests.append(StepRequest(question=ex.question, prompt_ids=prompts[ex.id], steps=steps, candidate=candidate,
                                    tokenizer=tokenizer))
        labels.append(int(right))
        groups.append(s["id"])
    info.update(answers=len(labels), wrong=labels.count(0))
    return requests, labels, groups, info


def gate_answer_requests(config: str | Path, n: int, tokenizer: Any, delimiter: str = ";") -> tuple[list[Any], list[int], list[str], dict[str, Any]]:
    """The synthetic held-out answers of a PRM training config (``task.GATE``, ``n`` problems, corrupted
    and answered as :func:`trainers.testbed_prm.heldout` does), as step requests with the gate's labels."""
    import yaml

    from data_pipeline.testbed import task
    from dynts.rescue import StepRequest
    from trainers.testbed_lm import TOKEN_ID
    from trainers.testbed_prm import IGNORE, PRMConfig, heldout

    cfg = PRMConfig.from_dict(yaml.safe_load(Path(config).read_text()))
    if cfg.answer_prob <= 0:
        raise ValueError(f"{config}: answer_prob is 0, so its gate rows carry no answers")
    is_delimiter = delimiter_test(tokenizer, delimiter)
    requests, labels, groups = [], [], []
    rows = heldout(task.GATE, n, cfg)
    for index, (toks, labs) in enumerate(rows):
        if task.END_THINK not in toks:
            continue
        close = toks.index(task.END_THINK)
        ids = [TOKEN_ID[t] for t in toks]
        steps, tail = split_steps(ids[task.QUESTION_TOKENS : close], is_delimiter)
        candidate = tail + ids[close:-1] + [tokenizer.eos_token_id]  # "</think> rK= v ;" -> "</think> rK= v <eos>"
        requests.append(StepRequest(question=" ".join(toks[: task.QUESTION_TOKENS]), prompt_ids=ids[: task.QUESTION_TOKENS],
                                    steps=steps, candidate=candidate, tokenizer=tokenizer))
        labels.append(labs[-1])
        assert labs[-1] != IGNORE
        groups.append(str(index))
    info = {"config": str(config), "problems": n, "family": cfg.data.family, "min_think": cfg.data.min_think,
            "max_think": cfg.data.max_think, "corrupt_prob": cfg.corrupt_prob, "answer_prob": cfg.answer_prob,
            "answers": len(labels), "wrong": labels.count(0)}
    return requests, labels, groups, info


def score_verifiers(names: Sequence[str], requests: Sequence[Any], delimiter: str = ";", log=print,
                    known: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Each verifier's scores of ``requests``: ``A*B`` as :class:`~dynts.rescue.ProductPRM` (the product of
    its factors' scores), each factor loaded by :func:`eval.rescue.verifiers.load_eval_prm` and scored once
    (a factor in ``known`` takes those scores of the same requests instead)."""
    from eval.rescue.verifiers import load_eval_prm

    factors: dict[str, list[float]] = {k: list(v) for k, v in (known or {}).items() if len(v) == len(requests)}
    out = {}
    for name in names:
        for part in name.split("*"):
            if part not in factors:
                start = time.perf_counter()
                factors[part] = [float(x) for x in load_eval_prm(part, delimiter).score(list(requests))]
                log(f"scored {len(requests)} answers with {part} ({time.perf_counter() - start:.0f} s)")
        scores = [1.0] * len(requests)
        for part in name.split("*"):
            scores = [a * b for a, b in zip(scores, factors[part])]
        out[name] = scores
    return out


def weighted_aurocs(scores: Sequence[float], labels: Sequence[int], member: "torch.Tensor", counts: "torch.Tensor") -> "torch.Tensor":
    """AUROC of ``scores`` for ``labels`` in each of ``R`` resamples of groups, tied scores counted half (the
    Mann-Whitney statistic): item ``i`` belongs to group ``member[i]`` and resample ``r`` draws group ``g``
    ``counts[r, g]`` times. Every resample at once through the ``[G, G]`` matrix of positive-negative pairs
    between groups. ``[R]`` float64, NaN where a resample draws one class only."""
    import torch

    s = torch.as_tensor(list(scores), dtype=torch.float64)
    y = torch.as_tensor(list(labels), dtype=torch.bool)
    c = counts.to(torch.float64)
    G = c.shape[1]
    values, index = torch.unique(s, return_inverse=True)  # ascending distinct scores; index: each item's
    negatives = torch.zeros(len(values), G, dtype=torch.float64)
    negatives.index_put_((index[~y], member[~y]), torch.ones(int((~y).sum()), dtype=torch.float64), accumulate=True)
    below = negatives.cumsum(0) - negatives  # per distinct score: each group's negatives strictly below it
    per_positive = below[index[y]] + 0.5 * negatives[index[y]]  # [positives, G]: pairs won (ties half)
    pairs = torch.zeros(G, G, dtype=torch.float64).index_add_(0, member[y], per_positive)  # [positive group, negative group]
    wins = torch.einsum("rg,gh,rh->r", c, pairs, c)
    n_pos = torch.zeros(G, dtype=torch.float64).index_add_(0, member[y], torch.ones(int(y.sum()), dtype=torch.float64))
    n_neg = torch.zeros(G, dtype=torch.float64).index_add_(0, member[~y], torch.ones(int((~y).sum()), dtype=torch.float64))
    total = (c @ n_pos) * (c @ n_neg)
    return torch.where(total > 0, wins / total.clamp(min=1e-300), torch.full_like(total, float("nan")))


def grouped_auroc(scores: Sequence[float], labels: Sequence[int], groups: Sequence[str], resamples: int = 1000,
                  seed: int = 0) -> dict[str, Any]:
    """AUROC (:func:`trainers.testbed_prm.auroc`) and its bootstrap 95 % interval over groups (problems): each
    resample draws the groups with replacement (``random.Random(seed)``) and scores every item of a drawn group
    (:func:`weighted_aurocs`, all resamples at once)."""
    import torch

    from trainers.testbed_prm import auroc

    by: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by.setdefault(g, []).append(i)
    keys = list(by)
    slot = {k: j for j, k in enumerate(keys)}
    member = torch.tensor([slot[g] for g in groups], dtype=torch.long)
    rng = random.Random(seed)
    counts = torch.zeros(resamples, len(keys), dtype=torch.float64)
    for r in range(resamples):
        for k in rng.choices(keys, k=len(keys)):
            counts[r, slot[k]] += 1
    values = weighted_aurocs(scores, labels, member, counts) if resamples else torch.zeros(0)
    draws = sorted(v for v in values.tolist() if v == v)  # not NaN (one class missing)
    ci = [draws[int(0.025 * (len(draws) - 1))], draws[int(0.975 * (len(draws) - 1))]] if draws else None
    return {"auroc": auroc(scores, labels), "ci95": ci, "answers": len(labels), "wrong": list(labels).count(0)}


def auroc_text(result: dict[str, Any]) -> str:
    """A :func:`grouped_auroc` result as ``0.894 [0.862, 0.927]``."""
    return f"{result['auroc']:.3f} [{result['ci95'][0]:.3f}, {result['ci95'][1]:.3f}]"


def choose_verifier(doc: dict[str, Any], first: Sequence[str], then: Sequence[str] = (), bar: float = 0.8) -> str:
    """The verifier of ``doc`` (a :func:`main` ``--samples`` result) with the highest real-answer AUROC among
    ``first`` if it reaches ``bar``, else among ``then`` (ties: the earlier named). Raises ``ValueError``
    naming the best reading when none reaches ``bar``, or a verifier ``doc`` did not score."""
    if "samples" not in doc:
        raise ValueError("the answers file has no real answers (run it with --samples RUN_DIR)")
    scored = doc["samples"]["auroc"]
    missing = [v for v in [*first, *then] if v not in scored]
    if missing:
        raise ValueError(f"verifier {missing[0]!r} was not scored in this file (scored: {', '.join(scored)})")
    for group in (first, then):
        if not group:
            continue
        best = max(group, key=lambda v: scored[v]["auroc"])  # the first named of a tie
        if scored[best]["auroc"] >= bar:
            return best
    top = max([*first, *then], key=lambda v: scored[v]["auroc"])
    raise ValueError(f"no verifier reads answers at AUROC >= {bar}: the best is {top!r} at {scored[top]['auroc']:.3f}")


def choose_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.rescue.answers choose", description=choose_verifier.__doc__)
    p.add_argument("answers", help="a JSON file written by python -m eval.rescue.answers --samples ... --out FILE")
    p.add_argument("--first", action="append", required=True, help="a verifier of the first group (repeat)")
    p.add_argument("--then", action="append", default=[], help="a verifier taken only if no --first one reaches the bar (repeat)")
    p.add_argument("--bar", type=float, default=0.8, help="the AUROC a chosen verifier needs (default 0.8)")
    args = p.parse_args(argv)
    try:
        path = Path(args.answers)
        if not path.is_file():
            raise ValueError(f"{path} does not exist: score the verifiers first (python -m eval.rescue.answers --samples ...)")
        print(choose_verifier(json.loads(path.read_text()), args.first, args.then, args.bar))
    except ValueError as err:
        print(f"answers choose: error: {err}", file=sys.stderr)
        return 2
    return 0


def answers_table(doc: dict[str, Any], gate: dict[str, Any] | None = None) -> str:
    """A markdown table of ``doc``'s real-answer AUROC per verifier (with ``gate``: a second file's gate
    AUROC beside it), each ``0.894 [0.862, 0.927]``, in the order the verifiers were given."""
    real = doc["samples"]
    head = f"| verifier | dev answers AUROC [95 % CI] ({real['info']['answers']:,}, {real['info']['wrong']} wrong) |"
    rule = "|---|---|"
    if gate is not None:
        head += f" gate answers AUROC [95 % CI] ({gate['gate']['info']['answers']:,}, {gate['gate']['info']['wrong']} wrong) |"
        rule += "---|"
    rows = [head, rule]
    for v in doc["verifiers"]:
        row = f"| `{v}` | {auroc_text(real['auroc'][v])} |"
        if gate is not None:
            row += f" {auroc_text(gate['gate']['auroc'][v])} |" if v in gate["gate"]["auroc"] else " – |"
        rows.append(row)
    return "\n".join(rows)


def table_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.rescue.answers table", description=answers_table.__doc__)
    p.add_argument("answers", help="a JSON file written with --samples")
    p.add_argument("--gate", default=None, help="a JSON file written with --gate-config (its AUROC beside)")
    args = p.parse_args(argv)
    gate = json.loads(Path(args.gate).read_text()) if args.gate else None
    print(answers_table(json.loads(Path(args.answers).read_text()), gate))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["choose"]:
        return choose_main(argv[1:])
    if argv[:1] == ["table"]:
        return table_main(argv[1:])
    import torch

    from dynts.models import load_tokenizer

    p = argparse.ArgumentParser(prog="python -m eval.rescue.answers",
                                description="answer AUROC of dynts rescue verifiers on real (--samples) and synthetic (--gate) answers")
    p.add_argument("--prm", action="append", required=True, help="a verifier as dynts rescue --prm names it (repeat)")
    p.add_argument("--samples", default=None, help="a dynts eval run directory whose samples/ holds the answers")
    p.add_argument("--cell", default=None, help="the samples cell to read, when the run has several")
    p.add_argument("--family", default="chain", help="the testbed family of the grader")
    p.add_argument("--gate-config", default=None, help="a PRM training config: its held-out gate answers")
    p.add_argument("--gate", type=int, default=200, help="gate problems")
    p.add_argument("--tokenizer", default="checkpoints/testbed-chain-fair-lrm", help="the policy's tokenizer (a model dir)")
    p.add_argument("--delimiter", default=";")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples over problems for the 95 %% interval")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    if not args.samples and not args.gate_config:
        p.error("give --samples RUN_DIR and/or --gate-config CONFIG")
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.tokenizer)
    sets = {}
    if args.samples:
        sets["samples"] = answer_requests_from_samples(args.samples, tokenizer, args.delimiter, args.cell, args.family)
    if args.gate_config:
        sets["gate"] = gate_answer_requests(args.gate_config, args.gate, tokenizer, args.delimiter)
    out: dict[str, Any] = {"command": "python -m eval.rescue.answers " + " ".join(shlex.quote(a) for a in argv),
                           "verifiers": list(args.prm)}
    for name, (requests, labels, groups, info) in sets.items():
        print(f"{name}: {json.dumps(info)}")
        scores = score_verifiers(args.prm, requests, args.delimiter)
        out[name] = {"info": info, "auroc": {v: grouped_auroc(s, labels, groups, args.bootstrap) for v, s in scores.items()}}
        for v, r in out[name]["auroc"].items():
            print(f"  {v:70s} AUROC {auroc_text(r)}  ({r['answers']} answers, {r['wrong']} wrong)")
        out[name]["scores"] = {"labels": labels, "groups": groups, **{v: [round(x, 6) for x in s] for v, s in scores.items()}}
    if args.out:
        from dynts.io import write_atomic

        write_atomic(Path(args.out), json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
