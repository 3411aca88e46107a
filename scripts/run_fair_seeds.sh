#!/bin/bash
# Three seeds of the fair LRMs with R-KV's kept-set shape in the training mixture (issue #52, items 3-4), one
# resumable queue. Per seed N (configs/testbed/chain-lrm-fair-sN.yaml, configs/testbed/lrm-fair-scratch-sN.yaml):
#   train-sN: the fair chain LRM, its predictor, the fair copy LRM (from scratch), its predictor, in that order;
#   dev-sN:   the dev table of each: 200 dev problems x k = 5, every method, budgets 0.15 / 0.25 / 0.35 of that
#             LRM's own mean full sequence (scripts/run_testbed_regime.sh chain-fair-dev's fair side, parametrised
#             by seed; copy: the same methods with the copy oracles) -> reports/{chain-dev-fair,copy-dev-fair-scratch}-sN/.
# Usage: scripts/run_fair_seeds.sh [STEP...]   (default: train-s1 train-s2 train-s3 dev-s1 dev-s2 dev-s3)
# Start it so that it outlives the session:  setsid nohup bash scripts/run_fair_seeds.sh > runs/fair-seeds.out 2>&1 &
# Rerun the same command after a kill: an exported LRM (its run's train_result.json and weights) or predictor is
# skipped, a started training resumes from its run's last.ckpt (--resume), a dev table whose report exists is
# skipped and a started one resumes in its run dir (dynts eval skips the cells it has). Everything goes to
# runs/fair-seeds.log. One thread per job, nice -n 19, no CPU lock (it runs for a day beside other jobs):
# before each training it waits while another training or predictor pipeline runs on the machine, and only one
# copy of this queue runs at a time (/tmp/dynts-fair-seeds.lock).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
LOG=runs/fair-seeds.log
echo "run_fair_seeds.sh: logging to $LOG"
exec >>"$LOG" 2>&1
exec 9>/tmp/dynts-fair-seeds.lock
if ! flock -n 9; then echo "$(date -u +%FT%TZ) another run_fair_seeds.sh holds /tmp/dynts-fair-seeds.lock; not starting"; exit 1; fi
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 DYNTS_TRAIN_THREADS=1 DYNTS_THREADS=1
PY="nice -n 19 .venv/bin/python"
# as scripts/run_testbed_regime.sh: W_l = 32, retention 0.4, k = 5, the budgets as shares of the full cache's mean sequence
FRACTIONS=0.15,0.25,0.35
RANK_METHODS=full,dynts,random,h2o+q,snapkv+q,rkv+q,h2o,snapkv,rkv
CHAIN_METHODS="$RANK_METHODS,window,streamingllm,sepllm,chain-oracle-step,chain-oracle-value"  # chain-fair-dev's "every method"
COPY_METHODS="$RANK_METHODS,window,streamingllm,sepllm,oracle-step,oracle-value"
K5="--k 5 --local-window 32 --retention 0.4 --batch-size 100 --threads 1 --no-progress --budget-fraction $FRACTIONS"

log() { echo "$(date -u +%FT%TZ) [fair-seeds] $*"; }
trap 'log "FAILED (exit $?) at line $LINENO: $BASH_COMMAND; rerun scripts/run_fair_seeds.sh to continue"' ERR

wait_for_others() {  # one training at a time on this machine: wait while someone else's runs
  while pgrep -f "testbed train|dynts.cli pipeline|trainers.testbed |train-predictor fit" >/dev/null; do
    log "another training runs ($(pgrep -af 'testbed train|dynts.cli pipeline|trainers.testbed |train-predictor fit' | head -1 | cut -c1-120)); waiting 5 min"
    sleep 300
  done
}

yaml_get() { .venv/bin/python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }

train_lrm() {  # $1: configs/testbed/X.yaml
  local cfg=$1 run export
  run=$(yaml_get "$cfg" run_dir); export=$(yaml_get "$cfg" export_dir)
  if [ -f "$run/train_result.json" ] && [ -f "$export/model.safetensors" ]; then
    log "skip $cfg: exported to $export ($run/train_result.json)"; return
  fi
  wait_for_others
  local resume=""; [ -d "$run" ] && resume="--resume"
  log "train $cfg $resume -> $export"
  $PY -m dynts.cli testbed train --config "$cfg" $resume
  log "done $cfg: $(tr -d '\n ' < "$run/train_result.json" | cut -c1-400)"
}

train_predictor() {  # $1: configs/predictor/X.pipeline.yaml (dynts pipeline skips the stages it has done)
  local cfg=$1 export
  export=$(yaml_get "$cfg" export_dir)
  if [ -f "$export/predictor.safetensors" ]; then log "skip $cfg: exported to $export"; return; fi
  wait_for_others
  log "pipeline $cfg -> $export"
  $PY -m dynts.cli pipeline --config "$cfg"
  log "done $cfg"
}

dev_table() {  # $1 name (report dir), $2 benchmark, $3 model, $4 predictor, $5 methods
  local name=$1 bench=$2 model=$3 pred=$4 methods=$5
  if [ -f "reports/$name/results.json" ]; then log "skip dev table $name: reports/$name exists"; return; fi
  for need in "$model/model.safetensors" "$pred/predictor.safetensors"; do
    [ -f "$need" ] || { log "dev table $name needs $need: run its train step first"; return 1; }
  done
  log "dev table $name: $bench, $model, $pred"
  $PY -m dynts.cli eval --benchmark "$bench" $K5 --model "$model" --predictor "$pred" --method "$methods" --run-dir "runs/$name"
  mkdir -p "reports/$name/records"
  $PY -m eval.harness.compare "runs/$name" --write > "reports/$name/compare.md"
  $PY -m eval.harness.compare "runs/$name" --wide > "reports/$name/wide.md"
  cp runs/"$name"/records/*.json "reports/$name/records/"
  cp runs/"$name"/results.md "reports/$name/"
  cp runs/"$name"/results.json "reports/$name/"  # last: its presence marks the table done
  log "done dev table $name"
}

steps=${*:-train-s1 train-s2 train-s3 dev-s1 dev-s2 dev-s3}
log "start: $steps (pid $$)"
for step in $steps; do
  s=${step##*-s}
  case $step in
    train-s[0-9]*)
      train_lrm "configs/testbed/chain-lrm-fair-s$s.yaml"                          # -> checkpoints/testbed-chain-fair-s$s-lrm
      train_predictor "configs/predictor/testbed-chain-fair-s$s.pipeline.yaml"     # -> checkpoints/testbed-chain-fair-s$s-predictor
      train_lrm "configs/testbed/lrm-fair-scratch-s$s.yaml"                        # -> checkpoints/testbed-fair-scratch-s$s-lrm
      train_predictor "configs/predictor/testbed-fair-scratch-s$s.pipeline.yaml" ;; # -> checkpoints/testbed-fair-scratch-s$s-predictor
    dev-s[0-9]*)
      dev_table "chain-dev-fair-s$s" "testbed:n=200,family=chain,set=dev" "checkpoints/testbed-chain-fair-s$s-lrm" \
        "checkpoints/testbed-chain-fair-s$s-predictor" "$CHAIN_METHODS"
      dev_table "copy-dev-fair-scratch-s$s" "testbed:n=200,set=dev" "checkpoints/testbed-fair-scratch-s$s-lrm" \
        "checkpoints/testbed-fair-scratch-s$s-predictor" "$COPY_METHODS" ;;
    *) log "unknown step $step (train-sN, dev-sN)"; exit 2 ;;
  esac
done
log "finished: $steps"
