#!/bin/bash
# The measurements of docs/analyses.md, one after the other (~25 min on 2 CPU cores).
# Run: flock /tmp/dynts-cpu.lock scripts/run_analyses.sh
set -x
cd "$(dirname "$0")/.."
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
A=runs/analysis
date
# snapshot of the testbed LRM as it is now (the trainer may re-export it)
rm -rf $A/testbed-lrm-snapshot; cp -r checkpoints/testbed-lrm $A/testbed-lrm-snapshot
cp runs/testbed-lrm/train_result.json $A/testbed-lrm-snapshot.train_result.json
[ -d $A/gsm8k-smollm2 ] || .venv/bin/python -m dynts.cli analyze traces --source gsm8k --model smollm2-135m --n 32 --max-reasoning-tokens 128 --batch-size 16 --out $A/gsm8k-smollm2 --threads 1
.venv/bin/python -m dynts.cli analyze pos --traces $A/gsm8k-smollm2 --tokenizer smollm2-135m --out $A/pos-smollm2 --threads 1
date
[ -d $A/testbed-traces ] || .venv/bin/python -m dynts.cli analyze traces --source testbed --model $A/testbed-lrm-snapshot --n 100 --out $A/testbed-traces --threads 1
.venv/bin/python -m dynts.cli analyze sparsity --traces $A/testbed-traces --out $A/sparsity-testbed --threads 1
.venv/bin/python -m dynts.cli analyze sparsity --traces $A/gsm8k-smollm2 --out $A/sparsity-smollm2 --threads 1
date
.venv/bin/python -m dynts.cli analyze pareto --traces $A/testbed-traces --model $A/testbed-lrm-snapshot --out $A/pareto-testbed --runs 5 --threads 1
date
.venv/bin/python -m dynts.cli analyze pareto --traces $A/testbed-traces --model $A/testbed-lrm-snapshot --out $A/pareto-testbed-reencode --context reencode --runs 5 --limit 50 --threads 1
date
