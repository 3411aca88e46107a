#!/bin/bash
# Tuning on dev and three seeds of the fair LRMs with R-KV's kept-set shape in the training mixture (issue #52,
# items 2-4), one resumable queue. Steps:
#   tune-chain, tune-copy: scripts/tune_baselines.py --resume on configs/tuning/{chain,copy}-fair.yaml (the committed
#             fair LRMs) -> reports/tuning/{chain,copy}-fair/ (choices.json: every method's tuned settings);
#   train-sN: the fair chain LRM of seed N, its predictor, the fair copy LRM (from scratch), its predictor, in that order
#             (configs/testbed/chain-lrm-fair-sN.yaml, configs/testbed/lrm-fair-scratch-sN.yaml);
#   dev-sN:   the dev table of each: 200 dev problems x k = 5, budgets 0.15 / 0.25 / 0.35 of that LRM's own mean full
#             sequence, W_l 32, retention 0.4; the methods: full, random, window, streamingllm, sepllm and the family's
#             oracles untuned, and the tuned ones from reports/tuning/<family>-fair/choices.json: DynTS's winner and each
#             baseline's winners in $TUNED_SUBSETS (each with its own W_l / retention where tuning moved them); a dev
#             table is refused until its family's tuning is complete -> reports/{chain-dev-fair,copy-dev-fair-scratch}-sN/.
# Usage: scripts/run_fair_seeds.sh [--dry-run] [STEP...]
#        (default: tune-chain tune-copy train-s1 train-s2 train-s3 dev-s1 dev-s2 dev-s3)
# --dry-run: print what each step would run (and the tuned method lists) on stdout; runs, waits for and locks nothing.
# Start it so that it outlives the session:  setsid nohup bash scripts/run_fair_seeds.sh > runs/fair-seeds.out 2>&1 &
# Rerun the same command after a kill: a complete tuning, an exported LRM (its run's train_result.json and weights)
# or predictor is skipped, a started tuning or training resumes (--resume), a dev table whose report exists is
# skipped and a started one resumes in its run dir (dynts eval skips the cells it has). Everything goes to
# runs/fair-seeds.log. One thread per job, nice -n 19, no CPU lock (it runs for a day beside other jobs): before each
# tuning and each training it waits while another training, predictor pipeline or tuning runs on the machine, and
# only one copy of this queue runs at a time (/tmp/dynts-fair-seeds.lock: a second copy waits for the first; its jobs
# do not inherit the lock, so a job left running by a killed queue no longer holds it).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
LOG=runs/fair-seeds.log
DRY=""; [ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
if [ -z "$DRY" ]; then
  echo "run_fair_seeds.sh: logging to $LOG"
  exec >>"$LOG" 2>&1
  exec 9>/tmp/dynts-fair-seeds.lock
  if ! flock -n 9; then
    echo "$(date -u +%FT%TZ) [fair-seeds] /tmp/dynts-fair-seeds.lock is held (another queue, or a job a killed queue left running); waiting for it"
    flock 9
  fi
fi
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 DYNTS_TRAIN_THREADS=1 DYNTS_THREADS=1
PY="nice -n 19 .venv/bin/python"
# as scripts/run_testbed_regime.sh: W_l = 32, retention 0.4, k = 5, the budgets as shares of the full cache's mean sequence
FRACTIONS=0.15,0.25,0.35
# tuned (reports/tuning/<family>-fair/choices.json): each baseline's winner among token-level and per-head cells with
# the question protected (the ranked forms) and among token-level ones without (the plain form); DynTS (no per_head)
# its overall winner
TUNED_SUBSETS=token+q,head+q,token
UNTUNED=random,window,streamingllm,sepllm
CHAIN_UNTUNED="$UNTUNED,chain-oracle-step,chain-oracle-value"
COPY_UNTUNED="$UNTUNED,oracle-step,oracle-value"
TUNING=${FAIR_SEEDS_TUNING:-reports/tuning}  # where the tunings go (another directory only to try the script with --dry-run)
K5="--k 5 --local-window 32 --retention 0.4 --batch-size 100 --threads 1 --no-progress --budget-fraction $FRACTIONS"

log() { echo "$(date -u +%FT%TZ) [fair-seeds] $*"; }
trap 'log "FAILED (exit $?) at line $LINENO: $BASH_COMMAND; rerun scripts/run_fair_seeds.sh to continue"' ERR

run() {  # a job: without the queue's lock (fd 9); --dry-run prints it instead
  if [ -n "$DRY" ]; then log "dry-run: $*"; else "$@" 9>&-; fi
}

HEAVY="testbed train|dynts.cli pipeline|trainers.testbed |train-predictor fit|scripts/tune_baselines.py"
wait_for_others() {  # one heavy job at a time on this machine: wait while another training or tuning runs
  while pgrep -f "$HEAVY" >/dev/null; do
    if [ -n "$DRY" ]; then log "dry-run: would wait for $(pgrep -af "$HEAVY" | head -1 | cut -c1-120)"; return; fi
    log "another training or tuning runs ($(pgrep -af "$HEAVY" | head -1 | cut -c1-120)); waiting 5 min"
    sleep 300
  done
}

tuning_complete() {  # $1: a tuning's report dir
  [ -f "$1/choices.json" ] && .venv/bin/python -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1])).get("complete"))' "$1/choices.json"
}

tune() {  # $1: configs/tuning/X.yaml -> reports/tuning/X (resumes a started one)
  local grid=$1 out
  out=$TUNING/$(basename "$grid" .yaml)
  if tuning_complete "$out"; then log "skip tune $grid: $out/choices.json is complete"; return; fi
  wait_for_others
  log "tune $grid -> $out"
  run $PY scripts/tune_baselines.py --grid "$grid" --out "$out" --resume
  [ -n "$DRY" ] && return
  tuning_complete "$out" || { log "tune $grid: $out/choices.json is not complete after the run"; return 1; }
  log "done tune $grid: $(.venv/bin/python -m eval.harness.tuning specs "$out/choices.json" --subsets "$TUNED_SUBSETS" \
    --local-window 32 --retention 0.4 2>&1 || true)"
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
  run $PY -m dynts.cli testbed train --config "$cfg" $resume
  [ -n "$DRY" ] || log "done $cfg: $(tr -d '\n ' < "$run/train_result.json" | cut -c1-400)"
}

train_predictor() {  # $1: configs/predictor/X.pipeline.yaml (dynts pipeline skips the stages it has done)
  local cfg=$1 export
  export=$(yaml_get "$cfg" export_dir)
  if [ -f "$export/predictor.safetensors" ]; then log "skip $cfg: exported to $export"; return; fi
  wait_for_others
  log "pipeline $cfg -> $export"
  run $PY -m dynts.cli pipeline --config "$cfg"
  log "done $cfg"
}

dev_table() {  # $1 name (report dir), $2 benchmark, $3 model, $4 predictor, $5 tuning report dir, $6 untuned methods
  local name=$1 bench=$2 model=$3 pred=$4 tuning=$5 untuned=$6 specs dynts tuned
  if [ -f "reports/$name/results.json" ]; then log "skip dev table $name: reports/$name exists"; return; fi
  for need in "$model/model.safetensors" "$pred/predictor.safetensors"; do
    [ -f "$need" ] || [ -n "$DRY" ] || { log "dev table $name needs $need: run its train step first"; return 1; }
  done
  specs=".venv/bin/python -m eval.harness.tuning specs $tuning/choices.json --local-window 32 --retention 0.4"
  if ! dynts=$($specs --methods dynts) || ! tuned=$($specs --subsets "$TUNED_SUBSETS"); then
    log "dev table $name needs the complete tuning $tuning/choices.json (step tune-$(basename "$tuning" | cut -d- -f1)); not running it"
    [ -n "$DRY" ] && return; return 1
  fi
  log "dev table $name: $bench, $model, $pred; tuned ($tuning): $tuned"
  run $PY -m dynts.cli eval --benchmark "$bench" $K5 --model "$model" --predictor "$pred" --method "full,$dynts,$tuned,$untuned" \
    --run-dir "runs/$name"
  run mkdir -p "reports/$name/records"
  [ -n "$DRY" ] || $PY -m eval.harness.compare "runs/$name" --against "$dynts" --write > "reports/$name/compare.md"
  [ -n "$DRY" ] || $PY -m eval.harness.compare "runs/$name" --against "$dynts" --wide > "reports/$name/wide.md"
  run cp runs/"$name"/records/*.json "reports/$name/records/"
  run cp runs/"$name"/results.md "reports/$name/"
  run cp runs/"$name"/results.json "reports/$name/"  # last: its presence marks the table done
  log "done dev table $name"
}

steps=${*:-tune-chain tune-copy train-s1 train-s2 train-s3 dev-s1 dev-s2 dev-s3}
log "start${DRY:+ (dry run)}: $steps (pid $$)"
for step in $steps; do
  s=${step##*-s}
  case $step in
    tune-chain) tune configs/tuning/chain-fair.yaml ;;  # -> $TUNING/chain-fair (checkpoints/testbed-chain-fair-lrm)
    tune-copy)  tune configs/tuning/copy-fair.yaml ;;   # -> $TUNING/copy-fair (checkpoints/testbed-fair-lrm)
    train-s[0-9]*)
      train_lrm "configs/testbed/chain-lrm-fair-s$s.yaml"                          # -> checkpoints/testbed-chain-fair-s$s-lrm
      train_predictor "configs/predictor/testbed-chain-fair-s$s.pipeline.yaml"     # -> checkpoints/testbed-chain-fair-s$s-predictor
      train_lrm "configs/testbed/lrm-fair-scratch-s$s.yaml"                        # -> checkpoints/testbed-fair-scratch-s$s-lrm
      train_predictor "configs/predictor/testbed-fair-scratch-s$s.pipeline.yaml" ;; # -> checkpoints/testbed-fair-scratch-s$s-predictor
    dev-s[0-9]*)
      dev_table "chain-dev-fair-s$s" "testbed:n=200,family=chain,set=dev" "checkpoints/testbed-chain-fair-s$s-lrm" \
        "checkpoints/testbed-chain-fair-s$s-predictor" "$TUNING/chain-fair" "$CHAIN_UNTUNED"
      dev_table "copy-dev-fair-scratch-s$s" "testbed:n=200,set=dev" "checkpoints/testbed-fair-scratch-s$s-lrm" \
        "checkpoints/testbed-fair-scratch-s$s-predictor" "$TUNING/copy-fair" "$COPY_UNTUNED" ;;
    *) log "unknown step $step (tune-chain, tune-copy, train-sN, dev-sN)"; exit 2 ;;
  esac
done
log "finished: $steps"
