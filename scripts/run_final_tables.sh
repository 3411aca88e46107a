#!/bin/bash
# The final tables (docs/evaluation.md "Problem sets": `final`, read once), after the tuning and the seeds
# (scripts/run_fair_seeds.sh): the seed-1 fair LRMs with their predictors on the final-only `final` problems,
# chain n = 500 and copy n = 200, k = 5, the token budgets their seed-1 dev tables gave (0.15 / 0.25 / 0.35 of
# the dev mean full sequence), W_l 32, retention 0.4 (a tuned method: its tuned retention, and its tuned W_l as a
# share of the tuning's budget, local_window_share=, W_l scaling with each budget). Methods: full; DynTS's tuned winner; each baseline's tuned
# winners (its overall one and its best token-level and per-head cells, with the question protected and
# without: subsets best, token+q, head+q, token, head; duplicates run once); SepLLM's tuned winner
# (reports/tuning/<family>-fair-sepllm); window, streamingllm, sepllm and the random control untuned; the family's oracles. One table is one `dynts eval --final` run (one core each, the two
# families side by side).
#
# Refused unless every choice is made and committed first: the tunings complete and committed
# (reports/tuning/{chain,copy}-fair{,-sepllm}/choices.json), the seed-1 LRMs and predictors committed, the seed-1 dev
# tables present (their budgets). The first run of a table reads `final` once (its ledger line in
# reports/final-ledger.jsonl); a run that a stop killed resumes its run dir with `--reread` naming the run it
# continues (the ledger records why; no cell is recomputed). The ledger admits a final read only from a committed
# tree (its line records the commit) and freezes a table's methods at its first read: a continued run may not add
# one. Each finished cell is on the run's ledger line as it finishes. A table outlasts a working session and runs/ is not
# committed: `scripts/run_final_tables.sh carry`, before the machine goes, copies each unfinished table's finished
# cells (run.json, cells/, records/; not the samples' texts) to reports/final-<family>/carried/, to commit; a
# table whose run dir is absent starts from them (with --reread, as any continued run), and they are deleted once
# the table is written.
# --workers N: the table's cells run on N processes side by side (one core each; eval.harness.workers: the same
# samples as one process, which either resumes), for a table that has the machine to itself.
# Usage: scripts/run_final_tables.sh [--dry-run] [--workers N] [chain] [copy]   (default: both, side by side)
#        scripts/run_final_tables.sh carry
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${DRY:-}" ] && [ "${1:-}" != "--dry-run" ]; then  # a dry run is asked for by its flag only: a run reads final
  echo "run_final_tables.sh: DRY=$DRY in the environment does not make a dry run (every run reads the final set, a line in" \
       "reports/final-ledger.jsonl): pass --dry-run, or unset DRY to run the tables" >&2
  exit 2
fi
DRY=""; [ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
WORKERS=1
if [ "${1:-}" = "--workers" ]; then
  [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "run_final_tables.sh: --workers takes a count >= 1, e.g. --workers 2; got '${2:-}'" >&2; exit 2; }
  WORKERS=$2; shift 2
fi
export OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="nice -n 19 .venv/bin/python"
SUBSETS=best,token+q,head+q,token,head
UNTUNED=window,streamingllm,sepllm,random

fail() { echo "run_final_tables.sh: $*" >&2; exit 2; }
committed() {  # $1: a path that must be in git with no change
  git ls-files --error-unmatch "$1" >/dev/null 2>&1 && git diff --quiet HEAD -- "$1" || fail "$1 is not committed: commit every choice before the final read"
}

table() {  # $1 family
  local family=$1 bench model pred tuning dev oracles run
  case $family in
    chain) bench="testbed:n=500,family=chain,set=final"; model=checkpoints/testbed-chain-fair-s1-lrm
           pred=checkpoints/testbed-chain-fair-s1-predictor; tuning=reports/tuning/chain-fair; dev=reports/chain-dev-fair-s1
           oracles=chain-oracle-step,chain-oracle-value ;;
    copy)  bench="testbed:n=200,set=final"; model=checkpoints/testbed-fair-scratch-s1-lrm
           pred=checkpoints/testbed-fair-scratch-s1-predictor; tuning=reports/tuning/copy-fair; dev=reports/copy-dev-fair-scratch-s1
           oracles=oracle-step,oracle-value ;;
    *) fail "unknown table $family (chain, copy)" ;;
  esac
  run=runs/final-$family
  for need in "$tuning/choices.json" "$tuning-sepllm/choices.json" "$model/model.safetensors" "$pred/predictor.safetensors"; do
    [ -f "$need" ] || fail "$need is missing: run scripts/run_fair_seeds.sh first (docs/testbed.md \"Seeds\")"
    committed "$need"
  done
  [ -f "$dev/results.json" ] || fail "$dev/results.json is missing (step dev-s1): its budgets are the final tables'"
  local budgets specs dynts tuned
  budgets=$(.venv/bin/python -c 'import json, sys; print(",".join(str(b) for b in sorted({c["budget"] for c in json.load(open(sys.argv[1])) if c.get("budget") is not None})))' "$dev/results.json")
  specs=".venv/bin/python -m eval.harness.tuning specs $tuning/choices.json $tuning-sepllm/choices.json --local-window 32 --retention 0.4 --window-shares"
  dynts=$($specs --methods dynts); tuned=$($specs --subsets "$SUBSETS")
  local reread=()
  if [ -f "reports/final-$family/carried/run.json" ]; then  # a table a stop carried over: refills an absent run dir
    if [ -n "$DRY" ]; then echo "would restore $run from reports/final-$family/carried"
    else $PY -m eval.harness.carried restore "reports/final-$family/carried" "$run"; fi
  fi
  if [ -f "$run/run.json" ]; then  # a run started here and was stopped (with or without finished cells): continue it, and say so
    reread=(--reread "resume $run, stopped before its last cell (its cells are kept; none is recomputed; its methods are the list the ledger froze at the table's first read)")
  fi
  local cmd=($PY -m dynts.cli eval --final "${reread[@]}" --benchmark "$bench" --model "$model" --predictor "$pred"
             --method "full,$dynts,$tuned,$UNTUNED,$oracles" --budget "$budgets" --k 5 --local-window 32 --retention 0.4
             --batch-size 100 --threads 1 --workers "$WORKERS" --no-progress --run-dir "$run")
  if [ -n "$DRY" ]; then printf '%q ' "${cmd[@]}"; echo; return; fi
  echo "$(date -u +%FT%TZ) final $family: ${cmd[*]}"
  "${cmd[@]}"
  mkdir -p reports/final-$family/records
  $PY -m eval.harness.compare "$run" --against "$dynts" --write > reports/final-$family/compare.md
  $PY -m eval.harness.compare "$run" --against "$dynts" --wide > reports/final-$family/wide.md
  cp "$run"/records/*.json reports/final-$family/records/
  cp "$run"/results.md "$run"/results.json reports/final-$family/
  rm -rf "reports/final-$family/carried"
  echo "$(date -u +%FT%TZ) done final $family -> reports/final-$family"
}

carry() {  # each unfinished table's finished cells -> reports/final-<family>/carried/ (to commit)
  local family msg
  for family in chain copy; do
    [ -f "runs/final-$family/run.json" ] && [ ! -f "reports/final-$family/results.json" ] || continue
    msg=$($PY -m eval.harness.carried save "runs/final-$family" "reports/final-$family/carried")
    echo "carry runs/final-$family: $msg (commit it)"
  done
}

[ "${1:-}" = "carry" ] && { carry; exit 0; }
families=${*:-chain copy}
if [ -n "$DRY" ]; then for f in $families; do table "$f"; done; exit 0; fi
pids=()
for f in $families; do table "$f" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
