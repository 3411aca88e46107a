"""The testbed's must-show numbers: accuracy, eviction sensitivity, attention ranking, PRM AUROC,
checkpoint load time and size, per task family (:data:`FAMILY_MODELS`). Results are data first
(``reports/testbed.json``, chain: ``reports/testbed-chain.json``), a table second.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from data_pipeline.testbed import task
from dynts.io import write_atomic
from trainers.testbed_eval import SAMPLING, load_testbed, score

Policy = tuple[str, str, dict[str, Any] | None]  # (label, method, method options)

POLICIES: tuple[Policy, ...] = (
    ("question+recent", "window", {"keep_question": True}),
    ("oracle", "testbed-oracle", None),
    ("oracle(step)", "testbed-oracle", {"keep_step": True}),
    ("oracle(token)", "testbed-oracle", {"keep_key": False}),
)
# The chain oracles (data_pipeline.testbed.oracle, family=chain: every written result until the asked
# step, then its dependency closure); the token oracle is copy-only.
CHAIN_POLICIES: tuple[Policy, ...] = (
    ("question+recent", "window", {"keep_question": True}),
    ("oracle", "testbed-oracle", {"family": "chain"}),
    ("oracle(step)", "testbed-oracle", {"family": "chain", "keep_step": True}),
)
# The kept-set shape check: question + recent + the asked step (9 tokens), the asked key and value,
# or the asked value token alone, at equal budgets (dynts eval's oracle presets). An LRM that reads
# every shape alike scores the step and value oracles within a few points of each other.
SHAPE_ORACLES = ("oracle-step", "oracle-value", "oracle-token")
CHAIN_SHAPE_ORACLES = ("chain-oracle-step", "chain-oracle-value")


@dataclass(frozen=True)
class FamilyModels:
    """What the report runs for one task family: bundled model names (``dynts.models.TESTBED``),
    the PRM's training config (its ``data.family`` and trace lengths), the default report path, the
    eviction policies and the ``dynts eval`` oracle presets of the kept-set shape check (the first
    one is the step oracle the others are compared with)."""

    lrm: str
    helper: str
    prm: str
    prm_config: str
    out: str
    policies: tuple[Policy, ...]
    shape_oracles: tuple[str, ...]

    @property
    def models(self) -> tuple[str, str, str]:
        return self.lrm, self.helper, self.prm


FAMILY_MODELS: dict[str, FamilyModels] = {
    "copy": FamilyModels("testbed", "testbed-helper", "testbed-prm", "configs/testbed/prm.yaml", "reports/testbed.json",
                         POLICIES, SHAPE_ORACLES),
    "chain": FamilyModels("testbed-chain", "testbed-chain-helper", "testbed-chain-prm", "configs/testbed/chain-prm.yaml",
                          "reports/testbed-chain.json", CHAIN_POLICIES, CHAIN_SHAPE_ORACLES),
}


def family_models(family: str) -> FamilyModels:
    """The :data:`FAMILY_MODELS` entry of ``family`` (ValueError naming the choices otherwise)."""
    if family not in FAMILY_MODELS:
        raise ValueError(f"family={family!r}: the testbed report knows {sorted(FAMILY_MODELS)}")
    return FAMILY_MODELS[family]


def require_checkpoint(family: str, name: str) -> Path:
    """The checkpoint directory of bundled ``name``; ValueError naming how to get it when it is
    missing (the family's PRM: the config to train, or ``--skip-prm``)."""
    from dynts.models import TESTBED, checkpoints_dir

    path = checkpoints_dir() / TESTBED[name]
    if not (path / "config.json").is_file():
        fm = family_models(family)
        how = "train it with `dynts testbed train --config CONFIG`"
        if name == fm.prm:
            how = (f"train it with `dynts testbed train --config {fm.prm_config}` (or leave the PRM out: "
                   f"dynts testbed report --family {family} --skip-prm, and add it later with --prm-only)")
        raise ValueError(f"{name!r} checkpoint missing at {path}; {how}")
    return path



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
    k: int = 1,
    eviction: dict[str, Any] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """Generate ``k`` traces per problem with ``dynts.generate`` under one eviction policy
    (``min_think``: ``</think>`` is banned for the first that many tokens). The texts come back
    problem-major (problem ``i``'s samples at ``i * k ... i * k + k - 1``); ``accuracy`` is pass@1, the
    mean over problems of each problem's mean over its samples, and ``records`` hold every sample's
    bits, its batch seed and its row in that batch (its random stream: distinct per sample). ``eviction``:
    further eviction keywords of ``dynts.generate`` (``predictor``, ``retention``)."""
    if k < 1:
        raise ValueError(f"k={k!r}: samples per problem must be >= 1")
    names = [p.name for p in problems]
    problems = [p for p in problems for _ in range(k)]
    seeds: list[int] = []
    rows: list[int] = []
    from transformers import LogitsProcessorList

    import data_pipeline.testbed.oracle  # noqa: F401  (registers "testbed-oracle")
    from dynts import generate
    from trainers.testbed_eval import BanUntil

    texts: list[str] = []
    seconds = 0.0
    for i in range(0, len(problems), batch_size):
        torch.manual_seed(seed + i)
        chats = [[{"role": "user", "content": p.question}] for p in problems[i : i + batch_size]]
        seeds += [seed + i] * len(chats)
        rows += list(range(len(chats)))
        kw: dict[str, Any] = {} if method == "full" else {"budget": budget, "local_window": local_window, **(eviction or {})}
        if min_think:
            kw["logits_processor"] = LogitsProcessorList([BanUntil(tokenizer.convert_tokens_to_ids(task.END_THINK), min_think, task.QUESTION_TOKENS)])
        out = generate(model, tokenizer, chats, method=method, method_options=options, max_new_tokens=max_new_tokens, **kw, **SAMPLING)
        texts += out.texts
        seconds += out.stats["seconds"]
    result = score(problems, texts, records=True)  # with the per-problem bits behind the numbers
    result["records"].update({"problems": names, "k": k, "seeds": seeds, "rows": rows})
    result.update({"k": k, "n_problems": len(names), "method": method, "options": options or {}, "min_think": min_think, "budget": budget, "local_window": local_window, "seconds": seconds})
    return texts, result


@torch.no_grad()
def attention_ranks(model: Any, tokenizer: Any, problems: Sequence[task.Problem], texts: Sequence[str]) -> dict[str, float]:
    """Answer-to-thinking attention (eager, summed over layers, heads and the answer rows
    ``</think> rK= v``): where does the best-ranked critical value token rank among thinking tokens?
    Critical: ``task.find_critical_positions`` of the problem's family (copy: the asked value;
    chain: also the values of its dependency closure)."""
    fractions: list[float] = []
    for p, text in zip(problems, texts):
        ans = task.parse_answer(text)
        words = list(p.tokens[: task.QUESTION_TOKENS]) + text.split()
        crit = task.find_critical_positions(words, asked=p.asked, family=p.family)
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
    training (trace lengths and family from the PRM config when it exists)."""
    import yaml

    from trainers.testbed_prm import PRMConfig, auroc, heldout, step_scores

    cfg = PRMConfig.from_dict(yaml.safe_load(Path(config).read_text())) if Path(config).is_file() else PRMConfig()
    scores, labels = step_scores(model, heldout(task.GATE, n, cfg))
    return {"auroc": auroc(scores, labels), "steps": len(labels), "wrong_steps": labels.count(0), "traces": n,
            "think_range": [cfg.data.min_think, cfg.data.max_think], "family": cfg.data.family}


def checkpoint_facts(name: str, family: str = "copy") -> dict[str, Any]:
    """Path, load time, size on disk and parameter count of bundled ``name``."""
    path = require_checkpoint(family, name)
    t0 = time.perf_counter()
    model, _ = load_testbed(name)
    seconds = time.perf_counter() - t0
    return {
        "path": str(path),
        "load_seconds": seconds,
        "size_bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file()),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def eviction(model: Any, tokenizer: Any, problems: Sequence[task.Problem], budget: int, local_window: int, seed: int,
             min_think: int = 0, full: dict[str, Any] | None = None, family: str = "copy", k: int = 1) -> dict[str, Any]:
    """Full cache vs question + recent vs the family's oracles (key + value, the whole asked step;
    copy also the value token alone), ``k`` samples per problem."""
    policies = {"full": full if full is not None else run_policy(model, tokenizer, problems, "full", seed=seed, min_think=min_think, k=k)[1]}
    for name, method, options in family_models(family).policies:
        policies[name] = run_policy(model, tokenizer, problems, method, options, budget=budget, local_window=local_window,
                                    seed=seed, min_think=min_think, k=k)[1]
    return {"budget": budget, "local_window": local_window, "min_think": min_think, "policies": policies}


def oracle_shapes(run_dir: str | Path, oracles: Sequence[str] = SHAPE_ORACLES) -> dict[str, Any]:
    """The oracles ``oracles`` (default :data:`SHAPE_ORACLES`; chain: :data:`CHAIN_SHAPE_ORACLES`)
    per budget, read from a finished ``dynts eval`` run (``results.json``): pass@1 and its standard
    error, mean tokens, loop rate, and per budget the points by which the others trail the step
    oracle ``oracles[0]``."""
    results = json.loads((Path(run_dir) / "results.json").read_text())
    cells = {(r["method"]["label"], r["budget"]): r for r in results if r["method"]["label"] in oracles}
    if not cells:
        raise ValueError(f"{run_dir} has no oracle cells; run dynts eval with --method {','.join(oracles)}")
    by_budget: dict[str, Any] = {}
    for budget in sorted({b for _, b in cells}):
        row = {name: {k: cells[(name, budget)].get(k) for k in ("pass@1", "pass@1_se", "mean_generated_tokens", "loop_rate", "truncated_rate")}
               for name in oracles if (name, budget) in cells}
        step = row.get(oracles[0], {}).get("pass@1")
        if step is not None:
            row["trails_step_points"] = {n: 100 * (step - v["pass@1"]) for n, v in row.items() if n != oracles[0]}
        by_budget[str(budget)] = row
    any_cell = next(iter(cells.values()))
    return {"run_dir": str(run_dir), "benchmark": any_cell["benchmark"], "local_window": any_cell["local_window"],
            "questions": any_cell["questions"], "budgets": by_budget}


def _threads() -> None:
    import os

    torch.set_num_threads(int(os.environ.get("DYNTS_THREADS", 1)))  # 1: the 2-core machine is shared


def _read(out: str | Path | None, family: str) -> tuple[Path, dict[str, Any]]:
    """An existing report of ``family`` (at the family's default path when ``out`` is None)."""
    path = Path(out if out is not None else family_models(family).out)
    result = json.loads(path.read_text())
    if result.get("family", "copy") != family:
        raise ValueError(f"{path} is the {result.get('family', 'copy')!r} family's report, not {family!r}; "
                         "pass the matching --family or another --out")
    return path, result


def _write(path: Path, result: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(result, indent=2, default=str))


def _problems(result: dict[str, Any], family: str) -> list[task.Problem]:
    """The problems an existing report ran on."""
    return task.problem_set(result["problem_set"], result["n_problems"], family=family)


def _prm(family: str, n: int) -> dict[str, Any]:
    """:func:`prm_auroc` of the family's PRM, with the trace lengths and family of its config."""
    from dynts.models import configs_dir

    fm = family_models(family)
    config = configs_dir() / Path(fm.prm_config).relative_to("configs")
    if not config.is_file():
        raise FileNotFoundError(f"{config} missing: the {family} PRM's held-out traces follow its config")
    prm, _ = load_testbed(fm.prm)
    return prm_auroc(prm, n, config)


def update_oracle_shapes(run_dir: str | Path, label: str, out: str | Path | None = None, family: str = "copy") -> dict[str, Any]:
    """Record :func:`oracle_shapes` of ``run_dir`` (the family's oracle presets) under
    ``oracle_shapes[label]`` of an existing report."""
    path, result = _read(out, family)
    result.setdefault("oracle_shapes", {})[label] = oracle_shapes(run_dir, family_models(family).shape_oracles)
    _write(path, result)
    return result


def helper_accuracy(problems: Sequence[task.Problem], seed: int = 0, family: str = "copy", k: int = 1) -> dict[str, Any]:
    """The family's helper's full-cache scores on ``problems`` (the report's ``accuracy.helper_full``)."""
    helper, tok = load_testbed(family_models(family).helper)
    return run_policy(helper, tok, problems, "full", seed=seed, k=k)[1]


def update_eviction(out: str | Path | None = None, min_think: int = 300, family: str = "copy") -> dict[str, Any]:
    """Recompute only the eviction sections of an existing report (same problems and budget)."""
    _threads()
    path, result = _read(out, family)
    problems = _problems(result, family)
    lrm, tok = load_testbed(family_models(family).lrm)
    ev = result["eviction"]
    full = ev["policies"]["full"]
    k = result.get("k", 1)
    result["eviction"] = eviction(lrm, tok, problems, ev["budget"], ev["local_window"], 0, full=full, family=family, k=k)
    result["eviction_min_think"] = eviction(lrm, tok, problems, ev["budget"], ev["local_window"], 0, min_think=min_think,
                                            family=family, k=k)
    _write(path, result)
    return result


def report(n: int = 200, budget: int | None = None, local_window: int = 64, out: str | Path | None = None,
           seed: int = 0, min_think: int = 300, family: str = "copy", skip_prm: bool = False, k: int = 1) -> dict[str, Any]:
    """Every number of the module docstring for ``family`` on ``n`` problems of its ``"test"`` set
    (``k`` samples per problem, pass@1 their mean; the attention ranks read each problem's first sample),
    written to ``out`` (default: the family's :attr:`FamilyModels.out`). ``skip_prm`` leaves the PRM
    out (add it later with :func:`update_prm`); a missing checkpoint raises before any generation."""
    fm = family_models(family)
    _threads()
    names = (fm.lrm, fm.helper) if skip_prm else fm.models
    path = Path(out if out is not None else fm.out)
    problems = task.problem_set("test", n, family=family)
    result: dict[str, Any] = {"family": family, "n_problems": n, "k": k, "problem_set": "test", "sampling": SAMPLING}
    result["checkpoints"] = {name: checkpoint_facts(name, family) for name in names}
    lrm, tok = load_testbed(fm.lrm)
    texts, full = run_policy(lrm, tok, problems, "full", seed=seed, k=k)
    result["accuracy"] = {"lrm_full": full, "helper_full": helper_accuracy(problems, seed, family, k)}
    if budget is None:
        budget = int(round(full["mean_thinking_tokens"] / 4))
    local_window = min(local_window, budget - task.QUESTION_TOKENS - 8)
    result["eviction"] = eviction(lrm, tok, problems, budget, local_window, seed, full=full, family=family, k=k)
    result["eviction_min_think"] = eviction(lrm, tok, problems, budget, local_window, seed, min_think=min_think, family=family, k=k)
    eager, _ = load_testbed(fm.lrm, attn_implementation="eager")
    result["attention"] = attention_ranks(eager, tok, problems, texts[::k])
    if not skip_prm:
        result["prm"] = _prm(family, n)
    if path.is_file():  # the kept-set shape check comes from eval runs (update_oracle_shapes): keep it
        previous = json.loads(path.read_text())
        if previous.get("family", "copy") == family:
            result["oracle_shapes"] = previous.get("oracle_shapes", {})
    _write(path, result)
    return result


def update_prm(out: str | Path | None = None, n: int = 200, family: str = "copy") -> dict[str, Any]:
    """Recompute only the PRM numbers (AUROC, load time, size) of an existing report."""
    path, result = _read(out, family)
    prm = family_models(family).prm
    result["checkpoints"][prm] = checkpoint_facts(prm, family)
    result["prm"] = _prm(family, n)
    _write(path, result)
    return result


def update_helper(out: str | Path | None = None, seed: int = 0, family: str = "copy") -> dict[str, Any]:
    """Recompute only the helper's numbers (full-cache accuracy, load time, size) of an existing
    report, on the same problems."""
    path, result = _read(out, family)
    helper = family_models(family).helper
    result["checkpoints"][helper] = checkpoint_facts(helper, family)
    result["accuracy"]["helper_full"] = helper_accuracy(_problems(result, family), seed, family)
    _write(path, result)
    return result


def table(result: dict[str, Any]) -> str:
    """A plain-text rendering of :func:`report`'s result."""
    family = result.get("family", "copy")
    lines = [f"testbed report, {family} family: {result['n_problems']} problems, sampling {result['sampling']}"]
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
            accs = " ".join(f"{name} {c['pass@1']:.3f}" for name, c in cells.items() if name != "trails_step_points")
            lines.append(f"oracles by kept-set shape ({label}), B={budget} W_l={shapes['local_window']}: {accs}")
    a = result["attention"]
    lines.append(f"attention: critical token in top 20% of thinking: {a['top20_fraction']:.3f} (first: {a['first_fraction']:.3f}, n={a['n']})")
    if "prm" in result:
        lines.append(f"PRM AUROC (correct vs corrupted steps): {result['prm']['auroc']:.4f} over {result['prm']['steps']} steps")
    else:
        lines.append(f"PRM: not measured (--skip-prm); add it with dynts testbed report --family {family} --prm-only")
    for name, c in result["checkpoints"].items():
        lines.append(f"{name:20} {c['parameters']:>9,d} params {c['size_bytes'] / 1e6:6.2f} MB  load {c['load_seconds']:.2f} s")
    return "\n".join(lines)
