#!/bin/bash
# The step-judging PRM of the fair chain models (docs/rescue.md "The step PRM of the fair chain models"), in chunks
# of at most ~15 minutes of CPU, each under the shared CPU lock; every step resumes where the last chunk stopped:
#   traces     -- the policy traces of configs/testbed/chain-fair-step-prm.yaml (train:prm-traces problems);
#   train      -- the fine-tune (Lightning, last.ckpt every 50 steps), export to runs/testbed-chain-fair-step-prm/export;
#   train-answers -- its answer fine-tune (configs/testbed/chain-fair-step-prm-answers.yaml), export to
#                 checkpoints/testbed-chain-fair-step-prm;
#   dev-traces -- held-out traces on the dev problems (8 per policy, one trace each) (every policy, one trace each);
#   samples    -- seed 1's fair chain LRM's own answers on 200 dev problems x k = 5 (full cache), as the answers'
#                 record reports/prm-chain-fair-s1-answers.json was made;
#   auroc      -- step and answer AUROC of the PRMs alone and in the product with the helper's likelihood
#                 (python -m eval.rescue.step_auroc), the record reports/prm-chain-fair-step-dev.json (the unchanged
#                 verifiers' scores kept from the record it replaces: --scores-from, --keep).
# Usage: scripts/run_step_prm.sh [--one-lock] STEP [STEP ...]   (a step that stops at its time limit is run again to
#   go on; --one-lock runs the steps in one 15-minute chunk under the lock, for short steps)
set -ex
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--one-lock" ]; then shift; exec flock /tmp/dynts-cpu.lock timeout 15m env STEP_PRM_LOCKED=1 "$0" "$@"; fi
export OMP_NUM_THREADS=2 MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=".venv/bin/python"
LOCK="flock /tmp/dynts-cpu.lock timeout 15m"; [ -n "${STEP_PRM_LOCKED:-}" ] && LOCK=""
CONFIG=configs/testbed/chain-fair-step-prm.yaml ANSWERS=configs/testbed/chain-fair-step-prm-answers.yaml
FAIR=checkpoints/testbed-chain-fair
LRM=$FAIR-s1-lrm SAMPLES=runs/rescue-fair-s1/dev-full-k5 DEV=runs/prm-traces/chain-fair-s1-dev
STEP_PRM=checkpoints/testbed-chain-fair-step-prm
for step in "$@"; do
  date
  case $step in
    traces) $LOCK $PY -m eval.rescue.prm_traces --config $CONFIG --max-minutes 13 --threads 2 ;;
    train) DYNTS_TRAIN_THREADS=2 $LOCK $PY -m dynts.cli testbed train --config $CONFIG --resume ;;
    train-answers) DYNTS_TRAIN_THREADS=2 $LOCK $PY -m dynts.cli testbed train --config $ANSWERS --resume ;;
    dev-traces) $LOCK $PY -m eval.rescue.prm_traces --config $CONFIG --namespace dev --out-dir $DEV --shards 1 \
                  --shard-problems 8 --k 1 --max-minutes 13 --threads 2 ;;
    samples) $LOCK $PY -m dynts.cli eval --model $LRM --benchmark testbed:n=200,family=chain,set=dev --method full --k 5 \
               --batch-size 100 --threads 2 --no-progress --run-dir $SAMPLES ;;
    auroc) $LOCK $PY -m eval.rescue.step_auroc --traces $DEV --samples $SAMPLES --tokenizer $LRM --threads 2 \
             --prm $STEP_PRM --prm "$STEP_PRM*likelihood:$FAIR-helper" \
             --prm $FAIR-prm --prm "$FAIR-prm*likelihood:$FAIR-helper" --prm likelihood:$FAIR-helper \
             --prm testbed-chain-prm --prm testbed-verifier:chain --answers-from reports/prm-chain-fair-s1-answers.json \
             --scores-from reports/prm-chain-fair-step-dev.json --keep $FAIR-prm --keep likelihood:$FAIR-helper \
             --keep testbed-chain-prm --keep testbed-verifier:chain --out reports/prm-chain-fair-step-dev.json ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
