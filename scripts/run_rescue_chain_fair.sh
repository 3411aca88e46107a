#!/bin/bash
# KV-Rescue on the fair chain models, dev only (docs/rescue.md "The fair chain models on dev"):
#   answers  -- the fair LRM's own answers on 200 dev problems x k = 5 (full cache; the run of
#               reports/chain-fair-dev-full-4400, regenerated with its samples), and each candidate verifier's
#               answer AUROC on them and on the fair PRM's synthetic gate answers (no training);
#   rescue   -- the DynTS base (the fair LRM, its predictor) at B = 72 (0.15 of the fair LRM's mean full
#               sequence on dev, the hard budget of the dev tables), N = 4 + 4, 100 dev problems, the verifier
#               chosen by the rule fixed before the answers are scored (eval.rescue.answers choose: the highest
#               dev-answer AUROC among the fair PRM, the fair helper's likelihood and their product, >= 0.8
#               required; else among the favouring chain PRM and its product with the helper), with the
#               helper-search and full-search controls; two single-threaded benches on the 2 cores.
# --seed N: the same on seed N's fair chain LRM and predictor (checkpoints/testbed-chain-fair-sN-{lrm,predictor},
#   scripts/run_fair_seeds.sh; the helper and the PRMs are the fair ones), B = the 0.15 budget of its dev table
#   (reports/chain-dev-fair-sN/results.json); outputs named -sN.
# Usage: scripts/run_rescue_chain_fair.sh [--seed N] [answers] [rescue]   (default: both; every step resumes)
set -ex
cd "$(dirname "$0")/.."
SEED=""; [ "${1:-}" = "--seed" ] && { SEED=${2:?--seed needs a number}; shift 2; }
export OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="nice -n 10 .venv/bin/python"
FAIR=checkpoints/testbed-chain-fair
if [ -n "$SEED" ]; then
  LRM=$FAIR-s$SEED-lrm PREDICTOR=$FAIR-s$SEED-predictor TAG=chain-fair-s$SEED SAMPLES=runs/rescue-fair-s$SEED/dev-full-k5
else
  LRM=$FAIR-lrm PREDICTOR=$FAIR-predictor TAG=chain-fair SAMPLES=runs/rescue-fair/dev-full-k5
fi
budget() {  # the rescue's B: 72 for the fair LRM, else the 0.15 budget of seed N's dev table
  [ -z "$SEED" ] && { echo 72; return; }
  local dev=reports/chain-dev-fair-s$SEED/results.json
  [ -f "$dev" ] || { echo "run_rescue_chain_fair.sh: $dev is missing (scripts/run_fair_seeds.sh dev-chain-s$SEED): its 0.15 budget is the rescue's" >&2; return 2; }
  .venv/bin/python -c 'import json, sys; print(min(c["budget"] for c in json.load(open(sys.argv[1])) if c.get("budget_fraction") == 0.15))' "$dev"
}
FIRST=($FAIR-prm likelihood:$FAIR-helper "$FAIR-prm*likelihood:$FAIR-helper")   # the fair models' own verifiers
THEN=(testbed-chain-prm "testbed-chain-prm*likelihood:$FAIR-helper")           # taken only if none of FIRST reads answers
VERIFIERS=()
for v in "${FIRST[@]}" "${THEN[@]}"; do VERIFIERS+=(--prm "$v"); done
VERIFIERS+=(--prm likelihood:$LRM --prm "$FAIR-prm*likelihood:$LRM" --prm testbed-verifier:chain)  # references
ANSWERS=reports/prm-$TAG-answers.json
RESCUE="$PY -m dynts.cli rescue bench --benchmark testbed:n=100,family=chain,set=dev --method dynts \
  --base $LRM --helper $FAIR-helper --predictor $PREDICTOR --budget BUDGET --n 4 \
  --local-window 16 --delimiter ; --loop-ngram 8 --loop-pattern 1,4,2 \
  --max-steps 96 --max-step-tokens 64 --degen-steps 24 --entropy-threshold 3.3 --compress-threshold 0.5 \
  --compress-window 100 --guard 12 --entropy-window 6 --temperature 0.6 --top-p 0.95 --top-k 20 --seed 0 --threads 1"
for step in ${*:-answers rescue}; do
  date
  case $step in
    answers)
      $PY -m dynts.cli eval --model $LRM --benchmark testbed:n=200,family=chain,set=dev --method full --k 5 \
        --batch-size 100 --threads 1 --no-progress --run-dir $SAMPLES   # == its dev table's full cell, with samples
      $PY -m eval.rescue.answers --samples $SAMPLES --tokenizer $LRM "${VERIFIERS[@]}" --out $ANSWERS &
      $PY -m eval.rescue.answers --gate-config configs/testbed/chain-fair-prm.yaml --gate 200 --tokenizer $LRM \
        "${VERIFIERS[@]}" --out reports/prm-$TAG-answers-gate.json
      wait ;;
    rescue)
      BUDGET=$(budget); RESCUE=${RESCUE/--budget BUDGET/--budget $BUDGET}; OUT=reports/rescue/dev-$TAG-B$BUDGET-N4
      CHOOSE=()
      for v in "${FIRST[@]}"; do CHOOSE+=(--first "$v"); done
      for v in "${THEN[@]}"; do CHOOSE+=(--then "$v"); done
      CHOSEN=$(.venv/bin/python -m eval.rescue.answers choose $ANSWERS "${CHOOSE[@]}")
      $RESCUE --prm "$CHOSEN" --settings full,helper,helper-search,full-search --out $OUT &
      $RESCUE --prm "$CHOSEN" --settings evict,bon,kvr --out $OUT
      wait
      $RESCUE --prm "$CHOSEN" --settings full,helper,evict,bon,kvr,helper-search,full-search --out $OUT  # cells on disk: writes results
      .venv/bin/python -m eval.rescue.table $OUT --from-records --write reports/rescue/table-dev-$TAG.md ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
