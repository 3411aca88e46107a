"""The time plans of a lending's two GPU commands: ``scripts/gpu_check.py`` (its sections and decode combinations,
most informative first, with estimates) and ``python -m eval.perf.vllm_gpu_bundle`` (:func:`.vllm_gpu_bundle.bundle_steps`),
each alone inside one call and both inside one 15-minute lending (docs/performance.md, "GPU checks in one lending").
Imports neither torch nor dynts: ``gpu_check.py --dry-run --plan`` prints them anywhere."""

from __future__ import annotations

from .time_plan import DEFAULT_BUDGET_S, Step, format_plan, time_plan

__all__ = ["COMMANDS", "DECODE", "LENDING_SPLIT", "combo_name", "gpu_steps", "lending_plans", "plan", "print_plans"]

STATS_METHODS = ["h2o", "snapkv", "rkv"]  # the attention-statistics methods: one compiled combination
RUN = "the 2026-12-04 H200 run"  # reports/gpu-runs/2026-12-04: the timings the estimates start from

# The decode combinations in run order, each with its estimate (positions L = 8k / 16k / 32k): batch 1 is cheap, a
# compiled combination pays ~100 s of compilation for 28 layers, batch 16 at 32k ~1 min of full-cache prefill.
DECODE = [  # (compile, batch, budget, methods or None, estimate_s, basis)
    (False, 1, 4096, None, 25, f"17 s on {RUN}, plus an untimed step per lane"),
    (True, 1, 4096, None, 120, f"114 s on {RUN}, mostly compiling"),
    (False, 16, 4096, None, 85, f"80 s on {RUN}"),
    (True, 16, 4096, None, 185, f"181 s on {RUN} (its combos.json)"),
    (True, 1, 4096, STATS_METHODS, 240, "never timed: three compiled lanes, guessed at 80 s each"),
    (False, 1, 2048, None, 30, f"26 s on {RUN}"),
    (False, 16, 2048, None, 85, "as eager batch 16 at B = 4096"),
    (True, 1, 2048, None, 120, "as compiled batch 1 at B = 4096"),
    (True, 16, 2048, None, 185, "as compiled batch 16 at B = 4096"),
]
DRY_DECODE = [(False, 1, 64), (False, 2, 64), (True, 1, 64, STATS_METHODS), (True, 1, 64)]  # every code path once


def combo_name(combo: dict) -> str:
    return (f"decode {'compiled' if combo['compile'] else 'eager'} batch {combo['batch']} B={combo['budget']}"
            + (f" ({', '.join(combo['methods'])})" if "methods" in combo else ""))


def plan(dry_run: bool) -> list[dict]:
    """The decode combinations in run order (:data:`DECODE`; a dry run: every code path once at tiny shapes). A
    combination with ``methods`` runs those instead of ``--methods``: the attention-statistics methods, compiled."""
    if dry_run:
        return [dict(compile=c, batch=b, budget=budget, positions=[256, 512], **({"methods": m[0]} if m else {}))
                for c, b, budget, *m in DRY_DECODE]
    return [dict(compile=c, batch=b, budget=budget, positions=[8192, 16384, 32768], estimate_s=estimate, basis=basis,
                 **({"methods": methods} if methods else {}))
            for c, b, budget, methods, estimate, basis in DECODE]


def gpu_steps() -> list[Step]:
    """This command's plan on the GPU, most informative first: the kernels and the vLLM worker hooks (new code,
    never timed on a GPU), the exactness checks, then the speed sections (decode and serving, timed before)."""
    decode = [Step(combo_name(c), c["estimate_s"], c["basis"], cap_s=1.5 * c["estimate_s"]) for c in plan(False)]
    return [
        Step("setup", 20, f"imports, versions, CUDA start: ~14 s outside the sections on {RUN}"),
        Step("kernels", 25, f"7 s on {RUN}; now also the warm-up compiles and keep-top at 16k / 64k", cap_s=90),
        Step("vllm", 75, f"16 s on {RUN} with the V1 hooks alone; now V1 and V2 (each timed <= 30 s) and the graph "
                         "check", cap_s=150),
        Step("logits", 12, f"9 s on {RUN}", cap_s=60),
        Step("tests", 60, f"54 s on {RUN} (pytest -m cuda)", cap_s=120),
        Step("serve_graphs", 10, f"3 s on {RUN}", cap_s=90),
        Step("model", 15, "a random-init 7B in bf16 made on the GPU: a guess", cap_s=120),
        decode[0], decode[1],
        Step("serve", 75, f"100 s on {RUN} for stock and StreamingLLM at 16 requests; now 8 requests and DynTS "
                          "beside", cap_s=190),
        decode[2],
        Step("attention_stats", 3, f"1 s on {RUN}", cap_s=30),
        *decode[3:],
    ]


COMMANDS = {  # the two prepared commands of a lending
    "gpu_check": "PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 scripts/gpu_check.py --out $OUT --budget-s {budget:.0f}",
    "vllm_gpu_bundle": "PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 -m eval.perf.vllm_gpu_bundle --out $OUT "
                       "--budget-s {budget:.0f}",
}
LENDING_S = 900.0  # device time of a lending, all calls together
START_S, CALL_S = 120.0, 30.0  # a machine's start ("a minute or more"); each call's transfers and Python start
LENDING_SPLIT = {"gpu_check": 380.0, "vllm_gpu_bundle": 340.0}  # 900 - 120 - 2 * 30 - 60 of margin


def lending_plans(budget_s: float = DEFAULT_BUDGET_S) -> dict:
    """Both commands' time plans: alone (each at ``budget_s``, at most 540 s: one call) and in one 15-minute lending
    (:data:`LENDING_SPLIT`: after the machine's start and each call's overhead, what the two share)."""
    from .vllm_gpu_bundle import bundle_steps

    steps = {"gpu_check": gpu_steps(), "vllm_gpu_bundle": bundle_steps()}
    return {
        "commands": {name: COMMANDS[name].format(budget=budget_s) for name in steps},
        "alone": {name: time_plan(s, budget_s) for name, s in steps.items()},
        "lending": {"lending_s": LENDING_S, "start_s": START_S, "per_call_s": CALL_S,
                    "commands": {name: COMMANDS[name].format(budget=LENDING_SPLIT[name]) for name in steps},
                    "plans": {name: time_plan(s, LENDING_SPLIT[name]) for name, s in steps.items()}},
    }


def print_plans(plans: dict) -> None:
    for name, command in plans["commands"].items():
        print(f"\n$ {command}\n{format_plan(name, plans['alone'][name])}")
    lending = plans["lending"]
    print(f"\nIn one {lending['lending_s']:.0f} s lending (start ~{lending['start_s']:.0f} s, ~{lending['per_call_s']:.0f} s "
          "per call):")
    for name, command in lending["commands"].items():
        print(f"\n$ {command}\n{format_plan(name, lending['plans'][name])}")
