#!/bin/bash
# Seed 1's fair chain predictor trained on the `golden` label, measured on dev against the committed seed-1 chain dev
# table (reports/chain-dev-fair-s1, DynTS on the `answer` label). Steps (each resumable, each under /tmp/dynts-cpu.lock):
#   train:   dynts pipeline --config configs/predictor/testbed-chain-fair-s1-golden.pipeline.yaml --label golden
#            (the same traces and recipe as configs/predictor/testbed-chain-fair-s1.pipeline.yaml)
#            -> checkpoints/testbed-chain-fair-s1-golden-predictor
#   eval:    dynts eval of DynTS with seed 1's tuned chain settings (local_window_share=0.5289, retention=0.6) on the
#            same 200 dev problems x k = 5, W_l 32, retention 0.4, batch 100, at B = 72 first, then 119 and 167
#            (the committed table's budgets: 0.15 / 0.25 / 0.35 of the full cache's mean sequence)
#            -> runs/chain-dev-fair-s1-golden; LIMIT=N runs the first N problems only
#   report:  the run's records in reports/chain-dev-fair-s1-golden/records, and compare.md / wide.md: the golden run
#            and the committed table's records in one paired table (python -m eval.harness.compare --from-records), the
#            two DynTS rows labelled golden-dynts:... and answer-dynts:... (the same method spec, two predictors)
# Usage: scripts/run_golden_chain_s1.sh [train] [eval] [report]   (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false DYNTS_TRAIN_THREADS=2
LOCK="flock /tmp/dynts-cpu.lock"
PRED=checkpoints/testbed-chain-fair-s1-golden-predictor
RUN=runs/chain-dev-fair-s1-golden
REPORT=reports/chain-dev-fair-s1-golden
BASE=reports/chain-dev-fair-s1
SPEC=dynts:local_window_share=0.5289,retention=0.6
LIMIT_ARG=()
[ -n "${LIMIT:-}" ] && LIMIT_ARG=(--limit "$LIMIT")
log() { echo "$(date -u +%FT%TZ) [golden-s1] $*"; }

train() {
  if [ -f "$PRED/predictor.safetensors" ]; then log "skip train: $PRED exists"; return; fi
  log "train -> $PRED"
  $LOCK .venv/bin/python -m dynts.cli pipeline --config configs/predictor/testbed-chain-fair-s1-golden.pipeline.yaml --label golden
}

evaluate() {
  for budget in 72 119,167; do
    log "eval B = $budget -> $RUN"
    $LOCK .venv/bin/python -m dynts.cli eval --benchmark testbed:n=200,family=chain,set=dev --k 5 --local-window 32 \
      --retention 0.4 --batch-size 100 --threads 2 --no-progress --budget "$budget" "${LIMIT_ARG[@]}" \
      --model checkpoints/testbed-chain-fair-s1-lrm --predictor "$PRED" --method "$SPEC" --run-dir "$RUN"
  done
}

report() {
  local both=runs/chain-dev-fair-s1-golden-vs-answer
  .venv/bin/python -m eval.harness.compare "$RUN" --against "$SPEC" --write > /dev/null
  mkdir -p "$REPORT/records" "$both/records"
  cp "$RUN"/records/*.json "$REPORT/records/"
  cp "$RUN"/results.md "$RUN"/results.json "$REPORT/"
  rm -f "$both"/records/*.json
  cp "$BASE"/records/*.json "$both/records/"
  .venv/bin/python - "$RUN/records" "$both/records" <<'EOF'
import json, pathlib, sys
golden, both = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for src, tag in [(p, "answer") for p in both.glob("*dynts*.json")] + [(p, "golden") for p in golden.glob("*.json")]:
    record = json.loads(src.read_text())
    record["cell"]["method"]["label"] = f"{tag}-{record['cell']['method']['label']}"
    (both / f"{tag}-{src.name}").write_text(json.dumps(record))
    if tag == "answer":
        src.unlink()
EOF
  .venv/bin/python -m eval.harness.compare "$both" --from-records --against "golden-$SPEC" > "$REPORT/compare.md"
  .venv/bin/python -m eval.harness.compare "$both" --from-records --against "golden-$SPEC" --wide > "$REPORT/wide.md"
  log "report -> $REPORT"
}

for step in "${@:-train eval report}"; do
  for s in $step; do
    case $s in train) train ;; eval) evaluate ;; report) report ;; *) log "unknown step $s"; exit 2 ;; esac
  done
done
