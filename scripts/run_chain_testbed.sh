#!/bin/bash
# The chain family's first measurements (docs/testbed.md, "The chain family"), one command
# per number, each under the machine's CPU lock (other jobs may run between).
#   scripts/run_chain_testbed.sh [STEP...]   steps: lrm helper prm predictor full budget96 (default: all, in this order)
# Training resumes from the run's last checkpoint, so a step cut by a time limit continues on a rerun.
set -ex
cd "$(dirname "$0")/.."
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-.venv/bin/python}
LOCK="flock /tmp/dynts-cpu.lock"
BENCH=testbed:n=200,family=chain,set=dev
EVAL="$PY -m dynts.cli eval --benchmark $BENCH --k 1 --batch-size 100 --threads 1 --no-progress"
pair() { $LOCK bash -c "$1 & a=\$!; $2 & b=\$!; wait \$a; x=\$?; wait \$b; exit \$((x || \$?))"; }  # two single-threaded jobs on the 2 cores
for step in ${*:-lrm helper prm predictor full budget96}; do
  date
  case $step in
    lrm)     $LOCK $PY -m dynts.cli testbed train --config configs/testbed/chain-lrm.yaml --resume        # -> runs/testbed-chain-lrm/export
             $LOCK $PY -m dynts.cli testbed train --config configs/testbed/chain-lrm-drill.yaml --resume ;;  # -> checkpoints/testbed-chain-lrm
    helper)  $LOCK $PY -m dynts.cli testbed train --config configs/testbed/chain-helper.yaml --resume ;;  # -> checkpoints/testbed-chain-helper
    prm)     # the chain PRM (~25 min) and its AUROC on gate traces (training-style and step-order negatives)
             $LOCK $PY -m dynts.cli testbed train --config configs/testbed/chain-prm.yaml --resume  # -> checkpoints/testbed-chain-prm
             $LOCK $PY -m trainers.testbed_prm checkpoints/testbed-chain-prm --family chain --n 200 > reports/prm-chain.json ;;
    predictor)  # traces -> importance -> training -> checkpoints/testbed-chain-predictor
      $LOCK $PY -m dynts.cli pipeline --config configs/predictor/testbed-chain.pipeline.yaml ;;
    full)    # full-cache accuracy of the chain LRM and its helper
      pair "$EVAL --model testbed-chain --method full --run-dir runs/eval-chain-full" \
           "$EVAL --model testbed-chain-helper --method full --run-dir runs/eval-chain-helper-full" ;;
    budget96)  # every method, its +q variant, the random control and the chain oracles at B = 96 (W_l = 32, as the copy table)
      pair "$EVAL --model testbed-chain --predictor checkpoints/testbed-chain-predictor --method full,dynts,window,streamingllm,sepllm,h2o,h2o+q --budget 96 --local-window 32 --retention 0.4 --run-dir runs/eval-chain-b96" \
           "$EVAL --model testbed-chain --method snapkv,snapkv+q,rkv,rkv+q,random,chain-oracle-step,chain-oracle-value --budget 96 --local-window 32 --retention 0.4 --run-dir runs/eval-chain-b96-b"
      $PY -m eval.harness.compare runs/eval-chain-b96 runs/eval-chain-b96-b --write ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
