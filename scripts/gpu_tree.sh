#!/usr/bin/env bash
# A lent GPU's `run` copies the working tree (tracked and untracked-not-ignored files) plus the carried paths, at most
# 64 MiB together. The tree is ~128 MB (reports/ and the testbed checkpoints), so around the call:
#
#   bash scripts/gpu_tree.sh stash     # moves what scripts/gpu_check.py does not read out of the tree, prints what travels
#   run(command="... scripts/gpu_check.py --out $OUT --budget-s 540", timeout_s=600), then
#   run(command="... -m eval.perf.vllm_gpu_bundle --out $OUT --budget-s 540", carry=[".vllm-gpu-bundle"], timeout_s=600)
#   bash scripts/gpu_tree.sh restore   # puts it back (before any commit: git sees the moved files as deleted meanwhile)
#
# Kept: the code, tests, docs, configs and the checkpoints the check loads (the testbed LRM and its predictor).
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=${GPU_TREE_STASH:-$(cd .. && pwd)/gpu-tree-stash}
KEEP=(checkpoints/testbed-lrm checkpoints/testbed-predictor)

travelling() {  # bytes of what a run would copy: tracked files present, untracked-not-ignored files, the bundle
  local tree bundle=0
  tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | { xargs -0 du -cb 2>/dev/null || true; } \
         | awk '$2 == "total" { s += $1 } END { print s + 0 }')  # moved files are listed but not there: skipped
  [ -d .vllm-gpu-bundle ] && bundle=$(du -sb .vllm-gpu-bundle | cut -f1)
  echo "travels: tree $((tree / 1048576)) MiB + .vllm-gpu-bundle $((bundle / 1048576)) MiB (limit 64 MiB)"
}

case "${1:-}" in
  stash)
    if [ -e "$STASH" ]; then echo "a stash is already at $STASH: run 'bash scripts/gpu_tree.sh restore' first" >&2; exit 2; fi
    mkdir -p "$STASH/checkpoints"
    mv reports "$STASH/"
    for dir in checkpoints/*/; do
      dir=${dir%/}
      [[ " ${KEEP[*]} " == *" $dir "* ]] || mv "$dir" "$STASH/checkpoints/"
    done
    travelling
    ;;
  restore)
    if [ ! -d "$STASH" ]; then echo "no stash at $STASH" >&2; exit 2; fi
    mv "$STASH/reports" reports
    mv "$STASH"/checkpoints/* checkpoints/ 2>/dev/null || true
    rmdir "$STASH/checkpoints" "$STASH"
    git status --short -- reports checkpoints | head -5
    ;;
  size)
    travelling
    ;;
  *)
    echo "usage: bash scripts/gpu_tree.sh stash|restore|size" >&2
    exit 2
    ;;
esac
