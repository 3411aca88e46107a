"""One table over several ``dynts rescue bench`` runs: per run and base method, the KV-Rescue comparison
(pass@1 of full cache, eviction-only best-of-N and KV-Rescue; the recovered fraction; base tokens vs
best-of-N; the detector's firing by signal; the loop rate of best-of-N and KV-Rescue).

``python -m eval.rescue.table reports/rescue/B32-N4 reports/rescue/B64-N4 ... [--method dynts] [--write FILE]``

The loop rate is the share of problems whose answer is wrong because the trajectory wrote a step key
a second time (the testbed's ``loops`` class, :func:`eval.harness.testbed_errors.count_errors`);
``–`` off the testbed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from dynts.io import write_atomic
from dynts.rescue.results import EXIT_SIGNALS

__all__ = ["budget_label", "markdown", "rows", "verifier_label"]


def budget_label(config: dict[str, Any]) -> str:
    """``B = 64`` (the physical bound) or ``paper B = 64 (+128)`` (score-selected + headroom)."""
    if config.get("paper_budget"):
        return f"paper B = {config['budget']} (+{config['headroom']})"
    return f"B = {config['budget']}"


def verifier_label(config: dict[str, Any]) -> str:
    """The PRM and whether the cross-step loop screen was on."""
    loop = (config.get("detector") or {}).get("loop")
    return f"{config['prm']}{' + loop screen' if loop else ''}"


def rows(run_dirs: Sequence[str | Path], methods: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One row per (run, base method) with a best-of-N and a KV-Rescue cell (only ``methods``, if given)."""
    out = []
    for run in run_dirs:
        summary = json.loads((Path(run) / "results.json").read_text())
        config = summary["config"]
        loops = {(d["setting"], d["method"]): d["loops"] / d["problems"] for d in summary.get("degeneration", [])}
        for method, r in summary.get("comparison", {}).items():
            if methods and method not in methods:
                continue
            out.append({"run": str(run), "budget": budget_label(config), "n": config["n"],
                        "problems": next(c["metrics"]["problems"] for c in summary["cells"] if c["method"] == method),
                        "verifier": verifier_label(config), "method": method, **r,
                        "loops_bon": loops.get(("bon", method)), "loops_kvr": loops.get(("kvr", method))})
    return out


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def markdown(table: Sequence[dict[str, Any]]) -> str:
    signals = "/".join(EXIT_SIGNALS)
    lines = [f"| budget | N | problems | verifier | base | A_full % | A_BoN % | A_KVR % | recovered | base tok BoN | base tok KVR | "
             f"base tokens vs BoN | firing {signals} % | loops BoN / KVR % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        rec = r.get("recovered_fraction")
        red = r.get("base_token_reduction")
        firing = " / ".join(_pct((r.get("firing_by_signal") or {}).get(k)) for k in EXIT_SIGNALS)
        lines.append(f"| {r['budget']} | {r['n']} + {r['n']} | {r['problems']} | {r['verifier']} | {r['method']} | "
                     f"{_pct(r.get('A_full'))} | {_pct(r['A_evict(bon)'])} | **{_pct(r['A_kvr'])}** | "
                     f"{'–' if rec is None else f'**{rec:.2f}**'} | {r['base_tokens_bon']:.1f} | {r['base_tokens_kvr']:.1f} | "
                     f"{'–' if red is None else f'{-100 * red:+.0f} %'} | {firing} | "
                     f"{_pct(r['loops_bon'])} / {_pct(r['loops_kvr'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one KV-Rescue comparison table over several rescue bench runs")
    p.add_argument("runs", nargs="+", help="run directories of dynts rescue bench (each with results.json)")
    p.add_argument("--method", default=None, help="only these base methods (comma-separated)")
    p.add_argument("--write", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    missing = [r for r in args.runs if not (Path(r) / "results.json").is_file()]
    if missing:
        raise SystemExit(f"no results.json in {missing}: run dynts rescue bench --out DIR first")
    text = markdown(rows(args.runs, args.method.split(",") if args.method else None))
    print(text, end="")
    if args.write:
        write_atomic(Path(args.write), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
