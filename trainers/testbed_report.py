"""The testbed's must-show numbers: accuracy, eviction sensitivity, attention ranking, PRM AUROC,
checkpoint load time and size. Results are data first (``reports/testbed.json``), a table second.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from data_pipeline.testbed import task
from dynts.io import write_atomic
from trainers.testbed_eval import CHECKPOINTS, SAMPLING, load_testbed, score



def run_policy(
    model: Any,
    tokenizer: Any,
    problems: Sequence[task.Problem],
    method: str,
    options: dict[str, Any] | None = None,
    budget: int | None = None,
    local_window: int | None = None,
    seed: int = 0,
    batch_size: int = 50,
    max_new_tokens: int = 1100,
    min_think: int = 0,
) -> tuple[list[str], dict[str, Any]]:
    """Generate every problem's trace with ``dynts.generate`` under one eviction policy
    (``min_think``: ``</think>`` is banned for the first that many tokens)."""
    from transformers import LogitsProcessorList

    import data_pipeline.testbed.oracle  # noqa: F401  (registers "testbed-oracle")
    from dynts import generate
    from trainers.testbed_eval import BanUntil

    texts: list[str] = []
    seconds = 0.0
    for i in range(0, len(problems), batch_size):
        torch.manual_seed(seed + i)
        chats = [[{"role": "user", "content": p.question}] for p in problems[i : i + batch_size]]
        kw: dict[str, Any] = {} if method == "full" else {"budget": budget, "local_window": local_window}
        if min_think:
            kw["logits_processor"] = LogitsProcessorList([BanUntil(tokenizer.convert_tokens_to_ids(task.END_THINK), min_think, task.QUESTION_TOKENS)])
        out = generate(model, tokenizer, chats, method=method, method_options=options, max_new_tokens=max_new_tokens, **kw, **SAMPLING)
        texts += out.texts
        seconds += out.stats["seconds"]
    result = score(problems, texts)
    result.update({"method": method, "options": options or {}, "min_think": min_think, "budget": budget, "local_window": local_window, "seconds": seconds})
    return texts, result


@torch.no_grad()
def attention_ranks(model: Any, tokenizer: Any, problems: Sequence[task.Problem], texts: Sequence[str]) -> dict[str, float]:
    """Answer-to-thinking attention (eager, summed over layers, heads and the answer rows
    ``</think> rK= v``): where does the critical value token rank among thinking tokens?"""
    fractions: list[float] = []
    for p, text in zip(problems, texts):
        ans = task.parse_answer(text)
        words = list(p.tokens[: task.QUESTION_TOKENS]) + text.split()
        crit = task.find_critical_positions(words, asked=p.asked)
        if ans is None or not crit:
            continue
        end = words.index(task.END_THINK)
        words = words[: end + 3]
        ids = torch.tensor([[task.VOCAB.index(w) for w in words]])
        att = model(input_ids=ids, output_attentions=True).attentions
        mass = torch.stack([a[0] for a in att]).sum(dim=(0, 1))[end:].sum(0)  # [T]
        thinking = mass[task.QUESTION_TOKENS : end]
        best = min(int((thinking > mass[c]).sum()) for c in crit)
        fractions.append(best / len(thinking))
    n = len(fractions)
    return {
        "n": n,
        "top20_fraction": sum(f < 0.2 for f in fractions) / max(1, n),
        "first_fraction": sum(f == 0 for f in fractions) / max(1, n),
        "mean_rank_fraction": statistics.mean(fractions) if fractions else float("nan"),
    }


def prm_auroc(model: Any, n: int = 200, config: str | Path = "configs/testbed/prm.yaml") -> dict[str, Any]:
    """AUROC of correct vs corrupted steps on held-out reference traces of the gate set (``task.GATE``), corrupted as in
    training (trace lengths from the PRM config when it exists)."""
    import yaml

    from trainers.testbed_prm import PRMConfig, auroc, heldout, step_scores

    cfg = PRMConfig.from_dict(yaml.safe_load(Path(config).read_text())) if Path(config).is_file() else PRMConfig()
    scores, labels = step_scores(model, heldout(task.GATE, n, cfg))
    return {"auroc": auroc(scores, labels), "steps": len(labels), "wrong_steps": labels.count(0), "traces": n,
            "think_range": [cfg.data.min_think, cfg.data.max_think]}


def checkpoint_facts(name: str) -> dict[str, Any]:
    from dynts.models import checkpoints_dir

    path = checkpoints_dir() / CHECKPOINTS[name]
    t0 = time.perf_counter()
    model, _ = load_testbed(name)
    seconds = time.perf_counter() - t0
    return {
        "path": str(path),
        "load_seconds": seconds,
        "size_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


POLICIES = (
    ("question+recent", "window", {"keep_question": True}),
    ("oracle", "testbed-oracle", None),
    ("oracle(step)", "testbed-oracle", {"keep_step": True}),
    ("oracle(token)", "testbed-oracle", {"keep_key": False}),
)
# The kept-set shape check: question + recent + the asked step (9 tokens), the asked key and value,
# or the asked value token alone, at equal budgets (dynts eval's oracle presets). An LRM that reads
# every shape alike scores the step and value oracles within a few points of each other.
SHAPE_ORACLES = ("oracle-step", "oracle-value", "oracle-token")


def eviction(model: Any, tokenizer: Any, problems: Sequence[task.Problem], budget: int, local_window: int, seed: int,
             min_think: int = 0, full: dict[str, Any] | None = None) -> dict[str, Any]:
    """Full cache vs question + recent vs the oracle (key + value, or the whole asked step)."""
    policies = {"full": full if full is not None else run_policy(model, tokenizer, problems, "full", seed=seed, min_think=min_think)[1]}
    for name, method, options in POLICIES:
        policies[name] = run_policy(model, tokenizer, problems, method, options, budget=budget, local_window=local_window,
                                    seed=seed, min_think=min_think)[1]
    return {"budget": budget, "local_window": local_window, "min_think": min_think, "policies": policies}


def oracle_shapes(run_dir: str | Path) -> dict[str, Any]:
    """The three oracles of :data:`SHAPE_ORACLES` per budget, read from a finished ``dynts eval`` run
    (``results.json``): pass@1 and its standard error, mean tokens, loop rate, and per budget the
    points by which the value and token oracles trail the step oracle."""
    results = json.loads((Path(run_dir) / "results.json").read_text())
    cells = {(r["method"]["label"], r["budget"]): r for r in results if r["method"]["label"] in SHAPE_ORACLES}
    if not cells:
        raise ValueError(f"{run_dir} has no oracle cells; run dynts eval with --method {','.join(SHAPE_ORACLES)}")
    by_budget: dict[str, Any] = {}
    for budget in sorted({b for _, b in cells}):
        row = {name: {k: cells[(name, budget)].get(k) for k in ("pass@1", "pass@1_se", "mean_generated_tokens", "loop_rate", "truncated_rate")}
               for name in SHAPE_ORACLES if (name, budget) in cells}
        step = row.get("oracle-step", {}).get("pass@1")
        if step is not None:
            row["trails_step_points"] = {n: 100 * (step - v["pass@1"]) for n, v in row.items() if n != "oracle-step"}
        by_budget[str(budget)] = row
    any_cell = next(iter(cells.values()))
    return {"run_dir": str(run_dir), "benchmark": any_cell["benchmark"], "local_window": any_cell["local_window"],
            "questions": any_cell["questions"], "budgets": by_budget}


def update_oracle_shapes(run_dir: str | Path, label: str, out: str | Path = "reports/testbed.json") -> dict[str, Any]:
    """Record :func:`oracle_shapes` of ``run_dir`` under ``oracle_shapes[label]`` of an existing report."""
    path = Path(out)
    result = json.loads(path.read_text())
    result.setdefault("oracle_shapes", {})[label] = oracle_shapes(run_dir)
    _write(path, result)
    return result


def _write(path: Path, result: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(result, indent=2, default=str))


def helper_accuracy(problems: Sequence[task.Problem], seed: int = 0) -> dict[str, Any]:
    """The helper's full-cache scores on ``problems`` (the report's ``accuracy.helper_full``)."""
    helper, tok = load_testbed("testbed-helper")
    return run_policy(helper, tok, problems, "full", seed=seed)[1]


def update_eviction(out: str | Path = "reports/testbed.json", min_think: int = 300) -> dict[str, Any]:
    """Recompute only the eviction sections of an existing report (same problems and budget)."""
    import os

    torch.set_num_threads(int(os.environ.get("DYNTS_THREADS", 1)))
    path = Path(out)
    result = json.loads(path.read_text())
    problems = task.problem_set(result["problem_set"], result["n_problems"])
    lrm, tok = load_testbed("testbed")
    ev = result["eviction"]
    full = ev["policies"]["full"]
    result["eviction"] = eviction(lrm, tok, problems, ev["budget"], ev["local_window"], 0, full=full)
    result["eviction_min_think"] = eviction(lrm, tok, problems, ev["budget"], ev["local_window"], 0, min_think=min_think)
    _write(path, result)
    return result


def report(n: int = 200, budget: int | None = None, local_window: int = 64, out: str | Path = "reports/testbed.json",
           seed: int = 0, min_think: int = 300) -> dict[str, Any]:
    import os

    torch.set_num_threads(int(os.environ.get("DYNTS_THREADS", 1)))  # 1: the 2-core machine is shared
    problems = task.problem_set("test", n)
    result: dict[str, Any] = {"n_problems": n, "problem_set": "test", "sampling": SAMPLING}
    result["checkpoints"] = {name: checkpoint_facts(name) for name in CHECKPOINTS}
    lrm, tok = load_testbed("testbed")
    texts, full = run_policy(lrm, tok, problems, "full", seed=seed)
    result["accuracy"] = {"lrm_full": full, "helper_full": helper_accuracy(problems, seed)}
    if budget is None:
        budget = int(round(full["mean_thinking_tokens"] / 4))
    local_window = min(local_window, budget - task.QUESTION_TOKENS - 8)
    result["eviction"] = eviction(lrm, tok, problems, budget, local_window, seed, full=full)
    result["eviction_min_think"] = eviction(lrm, tok, problems, budget, local_window, seed, min_think=min_think)
    eager, _ = load_testbed("testbed", attn_implementation="eager")
    result["attention"] = attention_ranks(eager, tok, problems, texts)
    prm, _ = load_testbed("testbed-prm")
    result["prm"] = prm_auroc(prm, n)
    if Path(out).is_file():  # the kept-set shape check comes from eval runs (update_oracle_shapes): keep it
        result["oracle_shapes"] = json.loads(Path(out).read_text()).get("oracle_shapes", {})
    _write(Path(out), result)
    return result


def update_prm(out: str | Path = "reports/testbed.json", n: int = 200) -> dict[str, Any]:
    """Recompute only the PRM numbers (AUROC, load time, size) of an existing report."""
    path = Path(out)
    result = json.loads(path.read_text())
    result["checkpoints"]["testbed-prm"] = checkpoint_facts("testbed-prm")
    prm, _ = load_testbed("testbed-prm")
    result["prm"] = prm_auroc(prm, n)
    _write(path, result)
    return result


def update_helper(out: str | Path = "reports/testbed.json", seed: int = 0) -> dict[str, Any]:
    """Recompute only the helper's numbers (full-cache accuracy, load time, size) of an existing
    report, on the same problems."""
    path = Path(out)
    result = json.loads(path.read_text())
    result["checkpoints"]["testbed-helper"] = checkpoint_facts("testbed-helper")
    problems = task.problem_set(result["problem_set"], result["n_problems"])
    result["accuracy"]["helper_full"] = helper_accuracy(problems, seed)
    _write(path, result)
    return result


def table(result: dict[str, Any]) -> str:
    """A plain-text rendering of :func:`report`'s result."""
    lines = [f"testbed report: {result['n_problems']} problems, sampling {result['sampling']}"]
    acc = result["accuracy"]
    lines.append(f"{'model / policy':40} {'acc':>6} {'parse':>6} {'think':>6} {'lookup':>6} {'copy':>6} {'arith':>6}")
    rows = [("lrm full", acc["lrm_full"]), ("helper full", acc["helper_full"])]
    for key in ("eviction", "eviction_min_think"):
        ev = result.get(key)
        if ev:
            ban = f" ban</think><{ev['min_think']}" if ev.get("min_think") else ""
            rows += [(f"lrm {k} B={ev['budget']}{ban}", v) for k, v in ev["policies"].items() if k != "full" or ban]
    for name, r in rows:
        lines.append(f"{name:40} {r['accuracy']:6.3f} {r['parse_rate']:6.3f} {r['mean_thinking_tokens']:6.0f} "
                     f"{r['retrieval']:6.3f} {r['operand_copy']:6.3f} {r['step_arithmetic']:6.3f}")
    for label, shapes in result.get("oracle_shapes", {}).items():
        for budget, cells in shapes["budgets"].items():
            accs = " ".join(f"{name} {cells[name]['pass@1']:.3f}" for name in SHAPE_ORACLES if name in cells)
            lines.append(f"oracles by kept-set shape ({label}), B={budget} W_l={shapes['local_window']}: {accs}")
    a = result["attention"]
    lines.append(f"attention: critical token in top 20% of thinking: {a['top20_fraction']:.3f} (first: {a['first_fraction']:.3f}, n={a['n']})")
    lines.append(f"PRM AUROC (correct vs corrupted steps): {result['prm']['auroc']:.4f} over {result['prm']['steps']} steps")
    for name, c in result["checkpoints"].items():
        lines.append(f"{name:16} {c['parameters']:>9,d} params {c['size_bytes'] / 1e6:6.2f} MB  load {c['load_seconds']:.2f} s")
    return "\n".join(lines)
