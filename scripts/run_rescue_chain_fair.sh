#!/bin/bash
# KV-Rescue on the fair chain models, dev only (docs/rescue.md "The fair chain models on dev"):
#   answers  -- the fair LRM's own answers on 200 dev problems x k = 5 (full cache; the run of
#               reports/chain-fair-dev-full-4400, regenerated with its samples), and each candidate verifier's
#               answer AUROC on them and on the fair PRM's synthetic gate answers (no training);
#   rescue   -- the DynTS base (the fair LRM, its predictor) at B = 72 (0.15 of the fair LRM's mean full
#               sequence on dev, the hard budget of the dev tables), N = 4 + 4, 100 dev problems, the verifier the
#               answers step chose (the highest dev-answer AUROC among the fair models' verifiers, >= 0.8 required),
#               with the helper-search and full-search controls; two single-threaded benches on the 2 cores.
# Usage: scripts/run_rescue_chain_fair.sh [answers] [rescue]   (default: both; every step resumes)
set -ex
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="nice -n 10 .venv/bin/python"
FAIR=checkpoints/testbed-chain-fair
SAMPLES=runs/rescue-fair/dev-full-k5
VERIFIERS=(--prm $FAIR-prm --prm likelihood:$FAIR-helper --prm "$FAIR-prm*likelihood:$FAIR-helper"
           --prm likelihood:$FAIR-lrm --prm "$FAIR-prm*likelihood:$FAIR-lrm"
           --prm testbed-chain-prm --prm "testbed-chain-prm*likelihood:$FAIR-helper" --prm testbed-verifier:chain)
CHOSEN="$FAIR-prm*likelihood:$FAIR-helper"   # the answers step's pick: reports/prm-chain-fair-answers.json
RESCUE="$PY -m dynts.cli rescue bench --benchmark testbed:n=100,family=chain,set=dev --method dynts \
  --base $FAIR-lrm --helper $FAIR-helper --predictor $FAIR-predictor --budget 72 --n 4 \
  --local-window 16 --delimiter ; --loop-ngram 8 --loop-pattern 1,4,2 \
  --max-steps 96 --max-step-tokens 64 --degen-steps 24 --entropy-threshold 3.3 --compress-threshold 0.5 \
  --compress-window 100 --guard 12 --entropy-window 6 --temperature 0.6 --top-p 0.95 --top-k 20 --seed 0 --threads 1"
OUT=reports/rescue/dev-chain-fair-B72-N4
for step in ${*:-answers rescue}; do
  date
  case $step in
    answers)
      $PY -m dynts.cli eval --model $FAIR-lrm --benchmark testbed:n=200,family=chain,set=dev --method full --k 5 \
        --batch-size 100 --threads 1 --no-progress --run-dir $SAMPLES   # == reports/chain-fair-dev-full-4400's records
      $PY -m eval.rescue.answers --samples $SAMPLES "${VERIFIERS[@]}" --out reports/prm-chain-fair-answers.json &
      $PY -m eval.rescue.answers --gate-config configs/testbed/chain-fair-prm.yaml --gate 200 "${VERIFIERS[@]}" \
        --out reports/prm-chain-fair-answers-gate.json
      wait ;;
    rescue)
      $RESCUE --prm "$CHOSEN" --settings full,helper,helper-search,full-search --out $OUT &
      $RESCUE --prm "$CHOSEN" --settings evict,bon,kvr --out $OUT
      wait
      $RESCUE --prm "$CHOSEN" --settings full,helper,evict,bon,kvr,helper-search,full-search --out $OUT  # cells on disk: writes results
      .venv/bin/python -m eval.rescue.table $OUT --from-records --write reports/rescue/table-dev-chain-fair.md ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
