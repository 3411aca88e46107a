#!/bin/bash
# Seed 1's fair chain predictor trained on another importance label, measured on dev against the committed seed-1 chain
# dev table (reports/chain-dev-fair-s1, DynTS on the `answer` label). VARIANT names the label's configs (default golden):
#   VARIANT=golden      configs/predictor/testbed-chain-fair-s1-golden.pipeline.yaml: golden at its defaults (B = 25 %
#                       of each trace, W_l 16, retention 0.4)
#   VARIANT=golden-b72  configs/predictor/testbed-chain-fair-s1-golden-b72.pipeline.yaml: golden replaying the cache
#                       DynTS runs at B = 72 (W_l 38, retention 0.6: seed 1's tuned chain settings)
# Steps (each resumable, each under /tmp/dynts-cpu.lock):
#   train:   dynts pipeline --config configs/predictor/testbed-chain-fair-s1-$VARIANT.pipeline.yaml
#            (the same traces and recipe as configs/predictor/testbed-chain-fair-s1.pipeline.yaml)
#            -> checkpoints/testbed-chain-fair-s1-$VARIANT-predictor
#   eval:    dynts eval of DynTS with seed 1's tuned chain settings (local_window_share=0.5289, retention=0.6) on the
#            same 200 dev problems x k = 5, W_l 32, retention 0.4, batch 100, at BUDGETS (default "72 119,167": the
#            committed table's budgets, 0.15 / 0.25 / 0.35 of the full cache's mean sequence, B = 72 first)
#            -> runs/chain-dev-fair-s1-$VARIANT; LIMIT=N runs the first N problems only
#   report:  the run's records in reports/chain-dev-fair-s1-$VARIANT/records, and compare.md / wide.md: the run and the
#            committed table's records in one paired table (python -m eval.harness.compare --from-records), the two
#            DynTS rows labelled $VARIANT-dynts:... and answer-dynts:... (the same method spec, two predictors)
# Usage: [VARIANT=golden-b72] [BUDGETS=72] scripts/run_label_chain_s1.sh [train] [eval] [report]   (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false DYNTS_TRAIN_THREADS=2
LOCK="flock /tmp/dynts-cpu.lock"
VARIANT=${VARIANT:-golden}
BUDGETS=${BUDGETS:-72 119,167}
PRED=checkpoints/testbed-chain-fair-s1-$VARIANT-predictor
RUN=runs/chain-dev-fair-s1-$VARIANT
REPORT=reports/chain-dev-fair-s1-$VARIANT
BASE=reports/chain-dev-fair-s1
SPEC=dynts:local_window_share=0.5289,retention=0.6
LIMIT_ARG=()
[ -n "${LIMIT:-}" ] && LIMIT_ARG=(--limit "$LIMIT")
log() { echo "$(date -u +%FT%TZ) [$VARIANT-s1] $*"; }

train() {
  if [ -f "$PRED/predictor.safetensors" ]; then log "skip train: $PRED exists"; return; fi
  log "train -> $PRED"
  $LOCK .venv/bin/python -m dynts.cli pipeline --config configs/predictor/testbed-chain-fair-s1-$VARIANT.pipeline.yaml
}

evaluate() {
  for budget in $BUDGETS; do
    log "eval B = $budget -> $RUN"
    $LOCK .venv/bin/python -m dynts.cli eval --benchmark testbed:n=200,family=chain,set=dev --k 5 --local-window 32 \
      --retention 0.4 --batch-size 100 --threads 2 --no-progress --budget "$budget" "${LIMIT_ARG[@]}" \
      --model checkpoints/testbed-chain-fair-s1-lrm --predictor "$PRED" --method "$SPEC" --run-dir "$RUN"
  done
}

report() {
  local both=runs/chain-dev-fair-s1-$VARIANT-vs-answer
  .venv/bin/python -m eval.harness.compare "$RUN" --against "$SPEC" --write > /dev/null
  mkdir -p "$REPORT/records" "$both/records"
  cp "$RUN"/records/*.json "$REPORT/records/"
  cp "$RUN"/results.md "$RUN"/results.json "$REPORT/"
  rm -f "$both"/records/*.json
  cp "$BASE"/records/*.json "$both/records/"
  .venv/bin/python - "$RUN/records" "$both/records" "$VARIANT" <<'EOF'
import json, pathlib, sys
run, both, variant = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
for src, tag in [(p, "answer") for p in both.glob("*dynts*.json")] + [(p, variant) for p in run.glob("*.json")]:
    record = json.loads(src.read_text())
    record["cell"]["method"]["label"] = f"{tag}-{record['cell']['method']['label']}"
    (both / f"{tag}-{src.name}").write_text(json.dumps(record))
    if tag == "answer":
        src.unlink()
EOF
  .venv/bin/python -m eval.harness.compare "$both" --from-records --against "$VARIANT-$SPEC" > "$REPORT/compare.md"
  .venv/bin/python -m eval.harness.compare "$both" --from-records --against "$VARIANT-$SPEC" --wide > "$REPORT/wide.md"
  log "report -> $REPORT"
}

for step in "${@:-train eval report}"; do
  for s in $step; do
    case $s in train) train ;; eval) evaluate ;; report) report ;; *) log "unknown step $s"; exit 2 ;; esac
  done
done
