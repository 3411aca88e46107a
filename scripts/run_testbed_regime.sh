#!/bin/bash
# The measurements on the shipped testbed (the LRM trained on a mixture of kept-set shapes, helper in
# KV-Rescue's regime), one command per number, each under the machine's CPU lock (other jobs may run between).
# Run after configs/testbed/{lrm,lrm-robust,lrm-mix,helper}.yaml are trained:  scripts/run_testbed_regime.sh [STEP...]
# Steps: predictor chain report eval pareto prm-order rescue rescue-n8 rescue-verifiers fair confirm confirm-ablations verifiers-dev
#        rescue-confirm rescue-confirm-chain pareto-confirm demo-confirm
# (default: all, in this order). The ranking steps are not in the default list; run them by name, in order:
#        chain-fair chain-fair-dev copy-fair-dev sealed
# (chain-fair trains the fair chain LRM and rebuilds its helper, PRM and predictor; chain-fair-dev is the
# before/after table on dev and where the budget fractions are checked, copy-fair-dev the same check for copy; sealed reads the final-only
# `sealed` problems once every choice is made, and each of its runs appends to reports/final-ledger.jsonl).
# The rescue steps run two single-threaded benches side by side under one lock (the 2 cores).
set -ex
cd "$(dirname "$0")/.."
export MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv/bin/python
LOCK="flock /tmp/dynts-cpu.lock"
RESCUE="$PY -m dynts.cli rescue bench --benchmark testbed:n=100,set=test --method window,rkv,dynts \
  --predictor checkpoints/testbed-predictor --prm testbed-prm-order --local-window 16 --delimiter ';' --loop-ngram 8 --loop-pattern 1,4,2 \
  --max-steps 96 --max-step-tokens 64 --degen-steps 24 --entropy-threshold 3.3 --compress-threshold 0.5 \
  --compress-window 100 --guard 12 --entropy-window 6 --temperature 0.6 --top-p 0.95 --top-k 20 --seed 0 \
  --settings full,helper,evict,bon,kvr,helper-search,full-search"  # + the controls: helper alone (2N) and a full-cache base, same search
# the chain family's rescue: its LRM, helper, predictor and problems; the verifier is set per step
CHAIN_RESCUE="${RESCUE/checkpoints\/testbed-predictor/checkpoints/testbed-chain-predictor} --base testbed-chain --helper testbed-chain-helper"
CHAIN_RESCUE="${CHAIN_RESCUE/testbed:n=100,set=test/testbed:n=100,family=chain,set=test}"
# the verifiers chosen on dev (verifiers-dev: reports/rescue/table-verifiers-dev.md), one per family
COPY_VERIFIER='testbed-prm-order*likelihood:testbed-helper'
CHAIN_VERIFIER='testbed-chain-prm*likelihood:testbed-chain-helper'
EVAL_METHODS=full,window,streamingllm,sepllm,h2o,h2o+q,snapkv,snapkv+q,rkv,rkv+q,random,dynts,dynts-no-question,dynts-no-thinking,dynts-no-local,t-random,t-bottom,oracle-step,oracle-value,oracle-token
FAIR_METHODS=full,window,streamingllm,sepllm,h2o,h2o+q,snapkv,snapkv+q,rkv,rkv+q,random,dynts,oracle-step,oracle-value
# the fair copy LRM (configs/testbed/lrm-fair.yaml) and its predictor (configs/predictor/testbed-fair.pipeline.yaml)
COPY_FAIR=checkpoints/testbed-fair-lrm
COPY_FAIR_PREDICTOR=checkpoints/testbed-fair-predictor
# the fair chain LRM (configs/testbed/chain-lrm-fair.yaml) and its rebuilt helper, PRM and predictor
CHAIN_FAIR=checkpoints/testbed-chain-fair-lrm
CHAIN_FAIR_PREDICTOR=checkpoints/testbed-chain-fair-predictor
# the paper's protocol: k = 5 samples per problem, W_l = 32, budgets as shares of the full cache's mean
# sequence (--budget-fraction) on dev. The final runs take the token budgets those shares gave on dev
# (chain-fair-dev, copy-fair-dev): a share of the final set's own mean moves B with that set's lengths
# (copy: 0.15 of sealed's 322-token mean is B = 48, which leaves no selection slot and is refused under
# --final; dev's 361-token mean gave 54). The tables print B / full seq on the set they read.
FRACTIONS=0.15,0.25,0.35
CHAIN_BUDGETS=72,121,169   # FRACTIONS x the fair chain LRM's mean full sequence on dev (483 tokens)
COPY_BUDGETS=54,90,126     # FRACTIONS x the fair copy LRM's mean full sequence on dev (361 tokens)
RANK_METHODS=full,dynts,random,h2o+q,snapkv+q,rkv+q,h2o,snapkv,rkv
ABLATIONS=dynts-no-question,dynts-no-thinking,dynts-no-local,t-random,t-bottom
K5_RUN="--k 5 --local-window 32 --retention 0.4 --batch-size 100 --threads 1 --no-progress"
K5="$K5_RUN --budget-fraction $FRACTIONS"
steps=${*:-predictor chain report eval pareto prm-order rescue rescue-n8 rescue-verifiers fair confirm confirm-ablations verifiers-dev rescue-confirm rescue-confirm-chain pareto-confirm demo-confirm}
one() { $LOCK bash -c "$1"; }  # the rescue commands are strings (quoted ';'), run by bash -c
pair() { $LOCK bash -c "$1 & a=\$!; $2 & b=\$!; wait \$a; x=\$?; wait \$b; exit \$((x || \$?))"; }  # two single-threaded jobs on the 2 cores
for step in $steps; do
  date
  case $step in
    predictor)  # traces -> importance -> training -> checkpoints/testbed-predictor
      $LOCK $PY -m dynts.cli pipeline --config configs/predictor/testbed.pipeline.yaml
      $LOCK $PY scripts/report_testbed_predictor.py --out reports/testbed-predictor.json ;;
    report)  # reports/testbed{,-chain}.json: LRM and helper accuracy, oracle vs full, attention, PRM AUROC, per-problem bits
      DYNTS_THREADS=2 $LOCK $PY -m dynts.cli testbed report --n 200
      DYNTS_THREADS=2 $LOCK $PY -m dynts.cli testbed report --family chain --n 200 ;;
    eval)  # every method, its +q variant, the random control, the ablations and the oracles at four budgets
      # (one locked job per budget, ~15 min each; the run dir resumes, so the table gathers all four)
      for budget in 64 96 128 192; do
        $LOCK $PY -m dynts.cli eval --model testbed --benchmark testbed:n=200 --predictor checkpoints/testbed-predictor \
          --method $EVAL_METHODS --budget $budget --local-window 32 --retention 0.4 --k 1 --batch-size 100 --threads 2 \
          --no-progress --run-dir runs/eval-testbed-budgets
      done
      $PY -m eval.harness.compare runs/eval-testbed-budgets --write   # one table of every cell; DynTS minus each method
      $PY -m eval.harness.testbed_errors runs/eval-testbed-budgets --degeneration > runs/eval-testbed-budgets/degeneration.md
      $PY -m eval.harness.testbed_errors runs/eval-testbed-budgets > runs/eval-testbed-budgets/errors.md
      mkdir -p reports/eval-testbed-budgets
      cp runs/eval-testbed-budgets/{results.md,results.json,accuracy_vs_budget.png,degeneration.md,errors.md} reports/eval-testbed-budgets/
      $PY -m dynts.cli testbed report --oracles-from reports/eval-testbed-budgets --oracles-label testbed-lrm ;;  # the kept-set shape check
    pareto)
      [ -d runs/analysis/testbed-robust-traces ] || $LOCK $PY -m dynts.cli analyze traces --source testbed --model testbed \
        --n 100 --out runs/analysis/testbed-robust-traces --threads 2
      $LOCK $PY -m dynts.cli analyze pareto --traces runs/analysis/testbed-robust-traces --model testbed \
        --out runs/analysis/pareto-testbed-robust --runs 3 --threads 2
      mkdir -p reports/pareto-testbed && cp runs/analysis/pareto-testbed-robust/pareto.{png,csv} reports/pareto-testbed/ ;;
    prm-order)  # the step-order-aware PRM (fine-tuned from testbed-prm) and both PRMs' AUROC on order negatives
      $LOCK $PY -m dynts.cli testbed train --config configs/testbed/prm-order.yaml --resume
      for prm in testbed-prm testbed-prm-order; do
        $LOCK $PY -m trainers.testbed_prm checkpoints/$prm --n 200 > reports/prm-order-$prm.json
      done ;;
    rescue)  # window / R-KV / DynTS bases, N = 4 + 4: B = 64, 32, 128 (physical) and the paper's B = 64; the controls
      # (helper-search, full-search) are budget-free: every run dir computes the same two cells (same seed)
      pair "$RESCUE --budget 64 --n 4 --out reports/rescue/B64-N4" "$RESCUE --budget 32 --n 4 --out reports/rescue/B32-N4"
      pair "$RESCUE --budget 128 --n 4 --out reports/rescue/B128-N4" \
           "$RESCUE --budget 64 --paper-budget --headroom 128 --n 4 --out reports/rescue/paperB64-N4"
      $PY -m eval.rescue.table reports/rescue/{B32-N4,B64-N4,B128-N4,paperB64-N4} --write reports/rescue/table.md ;;
    rescue-n8)  # N = 8 + 8 at B = 64 on the first 50 problems: the bases split over two processes, then one table
      N8="${RESCUE/testbed:n=100,set=test/testbed:n=50,set=test} --budget 64 --n 8 --out reports/rescue/B64-N8"
      pair "$N8 --method window,rkv" "$N8 --method dynts --settings evict,bon,kvr"
      one "$N8"  # every cell is on disk: this only writes results.md / results.json
      $PY -m eval.rescue.table reports/rescue/B64-N8 --write reports/rescue/table-n8.md ;;
    rescue-verifiers)  # the DynTS base at B = 64: which verifier and screen make the rescue
      V="${RESCUE/--method window,rkv,dynts/--method dynts} --budget 64 --n 4 --settings full,bon,kvr"
      one "$V --prm testbed-prm --loop-ngram 0 --loop-pattern 0 --out reports/rescue/B64-N4-prm-blind"   # the PRM before
      pair "$V --loop-ngram 0 --loop-pattern 0 --out reports/rescue/B64-N4-no-screen" \
           "$V --prm likelihood:testbed-helper --out reports/rescue/B64-N4-helper-likelihood"  # the resident helper as verifier
      one "$RESCUE --budget 64 --n 4 --settings full,bon,kvr,helper-search,full-search --prm 'testbed-prm-order*likelihood:testbed-helper' --out reports/rescue/B64-N4-product"  # both verifiers, every base, the controls
      $PY -m eval.rescue.table reports/rescue/{B64-N4-prm-blind,B64-N4-no-screen,B64-N4,B64-N4-helper-likelihood,B64-N4-product} \
        --method dynts --write reports/rescue/table-verifiers.md
      $PY -m eval.rescue.table reports/rescue/B64-N4-product --write reports/rescue/table-product.md ;;
    fair)  # the training change, before/after for every method: the shipped LRM vs lrm-fair.yaml (mechanism-made
      # kept sets, the asked value lost in 30 % of the rows), each with its own predictor, B = 64 and 128, 200 dev problems
      $LOCK $PY -m dynts.cli testbed train --config configs/testbed/lrm-fair.yaml --resume
      $LOCK $PY -m dynts.cli pipeline --config configs/predictor/testbed-fair.pipeline.yaml
      FAIR="$PY -m dynts.cli eval --benchmark testbed:n=200,set=dev --method $FAIR_METHODS --budget 64,128 --local-window 32 \
        --retention 0.4 --k 1 --batch-size 100 --threads 1 --no-progress"
      pair "$FAIR --model testbed --predictor checkpoints/testbed-predictor --run-dir runs/eval-fair-before" \
           "$FAIR --model $COPY_FAIR --predictor $COPY_FAIR_PREDICTOR --run-dir runs/eval-fair-after"
      for side in before after; do
        mkdir -p reports/eval-fair/$side/records
        $PY -m eval.harness.compare runs/eval-fair-$side --write > reports/eval-fair/$side/compare.md
        cp runs/eval-fair-$side/records/*.json reports/eval-fair/$side/records/
        cp runs/eval-fair-$side/results.{md,json} reports/eval-fair/$side/
      done ;;
    confirm)  # the final tables: every method on the confirm problems no choice saw (dynts eval --final), both
      # families; copy on the shipped LRM and on lrm-fair.yaml's, each with its own predictor (run the fair step first)
      CONFIRM="$PY -m dynts.cli eval --final --method $FAIR_METHODS --local-window 32 --retention 0.4 --k 1 --batch-size 100 --threads 1 --no-progress"
      COPY="$CONFIRM --benchmark testbed:n=200,set=confirm --budget 64,96,128,192"
      pair "$COPY --model testbed --predictor checkpoints/testbed-predictor --run-dir runs/confirm-copy" \
           "$COPY --model $COPY_FAIR --predictor $COPY_FAIR_PREDICTOR --run-dir runs/confirm-copy-fair"
      CHAIN="$CONFIRM --benchmark testbed:n=200,family=chain,set=confirm --model testbed-chain --predictor checkpoints/testbed-chain-predictor"
      pair "${CHAIN/oracle-step,oracle-value/chain-oracle-step,chain-oracle-value} --budget 48,64 --run-dir runs/confirm-chain" \
           "${CHAIN/oracle-step,oracle-value/chain-oracle-step,chain-oracle-value} --budget 96,128 --run-dir runs/confirm-chain-b"
      for run in confirm-copy confirm-copy-fair confirm-chain; do
        extra=""; [ $run = confirm-chain ] && extra=runs/confirm-chain-b
        mkdir -p reports/$run/records
        $PY -m eval.harness.compare runs/$run $extra --write > reports/$run/compare.md
        $PY -m eval.harness.compare runs/$run $extra --wide > reports/$run/wide.md   # the tables in docs/evaluation.md
        cp runs/$run/records/*.json reports/$run/records/; [ -n "$extra" ] && cp $extra/records/*.json reports/$run/records/
        cp runs/$run/results.{md,json} runs/$run/accuracy_vs_budget.png reports/$run/
      done ;;
    rescue-confirm)  # the rescue headline on confirm: window / R-KV / DynTS bases, B = 64, N = 4 + 4, the frozen verifier
      # (dynts rescue's default, chosen on test: rescue-verifiers), with the helper-search and full-search controls
      RC="${RESCUE/testbed:n=100,set=test/testbed:n=100,set=confirm} --final --budget 64 --n 4 --out reports/rescue/confirm-B64-N4"
      RC="$RC --prm '$COPY_VERIFIER'"
      pair "$RC --method window,rkv --settings evict,bon,kvr" "$RC --method dynts"
      one "$RC"  # every cell is on disk: this only writes results.md / results.json
      $PY -m eval.rescue.table reports/rescue/confirm-B64-N4 --write reports/rescue/table-confirm.md ;;
    verifiers-dev)  # the verifier choice, on dev only: the DynTS base at B = 64, N = 4 + 4, 100 dev problems per family;
      # copy: the five verifiers of rescue-verifiers; chain: its PRM, its helper's likelihood, their product.
      # The rule: the highest A_KVR; a tie goes to the one with fewer base tokens under KVR.
      D=reports/rescue/dev-verifiers
      V="${RESCUE/set=test/set=dev}"; V="${V/--method window,rkv,dynts/--method dynts} --budget 64 --n 4 --settings full,bon,kvr"
      CV="${CHAIN_RESCUE/set=test/set=dev}"; CV="${CV/--method window,rkv,dynts/--method dynts} --budget 64 --n 4 --settings full,bon,kvr"
      pair "$V --prm testbed-prm --loop-ngram 0 --loop-pattern 0 --out $D/copy-prm-blind" "$V --loop-ngram 0 --loop-pattern 0 --out $D/copy-no-screen"
      pair "$V --out $D/copy-prm-order" "$V --prm likelihood:testbed-helper --out $D/copy-helper-likelihood"
      pair "$V --prm '$COPY_VERIFIER' --out $D/copy-product" "$CV --prm testbed-chain-prm --out $D/chain-prm"
      pair "$CV --prm likelihood:testbed-chain-helper --out $D/chain-helper-likelihood" "$CV --prm '$CHAIN_VERIFIER' --out $D/chain-product"
      $PY -m eval.rescue.table $D/copy-{prm-blind,no-screen,prm-order,helper-likelihood,product} --method dynts --write reports/rescue/table-verifiers-dev.md
      $PY -m eval.rescue.table $D/chain-{prm,helper-likelihood,product} --method dynts --write reports/rescue/table-verifiers-dev-chain.md ;;
    rescue-confirm-chain)  # the chain family's rescue headline on confirm, as rescue-confirm: its frozen verifier, the controls
      RC="${CHAIN_RESCUE/set=test/set=confirm} --final --budget 64 --n 4 --prm '$CHAIN_VERIFIER' --out reports/rescue/confirm-chain-B64-N4"
      pair "$RC --method window,rkv --settings evict,bon,kvr" "$RC --method dynts"
      one "$RC"  # every cell is on disk: this only writes results.md / results.json
      $PY -m eval.rescue.table reports/rescue/confirm-chain-B64-N4 --write reports/rescue/table-confirm-chain.md ;;
    pareto-confirm)  # Pareto retention on confirm, both families: the LRM's own traces of 100 confirm problems, 3 answers
      # per trace and condition; paired CIs (eval.analyses.pareto_stats) from the per-trace records kept in reports/
      for fam in copy chain; do
        model=testbed; [ $fam = chain ] && model=testbed-chain
        [ -d runs/analysis/confirm-$fam-traces ] || $LOCK $PY -m dynts.cli analyze traces --source testbed --model $model \
          --family $fam --set confirm --final --n 100 --out runs/analysis/confirm-$fam-traces --threads 2
        $LOCK $PY -m dynts.cli analyze pareto --traces runs/analysis/confirm-$fam-traces --model $model \
          --out runs/analysis/pareto-confirm-$fam --runs 3 --threads 2
        mkdir -p reports/pareto-confirm-$fam
        cp runs/analysis/pareto-confirm-$fam/{pareto.png,pareto.csv,records.json,table.md} reports/pareto-confirm-$fam/
      done ;;
    confirm-ablations)  # the paper's Table 2 ablations and the remaining controls on confirm, copy, shipped LRM, B = 64 and
      # 96, next to full and dynts (recomputed: the same seed gives the confirm step's records, which the tables pair with)
      A="$PY -m dynts.cli eval --final --model testbed --predictor checkpoints/testbed-predictor --benchmark testbed:n=200,set=confirm \
        --budget 64,96 --local-window 32 --retention 0.4 --k 1 --batch-size 100 --threads 1 --no-progress"
      pair "$A --method full,dynts,dynts-no-question,dynts-no-thinking --run-dir runs/confirm-ablations" \
           "$A --method dynts-no-local,t-random,t-bottom,oracle-token --run-dir runs/confirm-ablations-b"
      mkdir -p reports/confirm-ablations/records
      $PY -m eval.harness.compare runs/confirm-ablations runs/confirm-ablations-b --write > reports/confirm-ablations/compare.md
      $PY -m eval.harness.compare runs/confirm-ablations runs/confirm-ablations-b --wide > reports/confirm-ablations/wide.md
      cp runs/confirm-ablations/records/*.json runs/confirm-ablations-b/records/*.json reports/confirm-ablations/records/
      cp runs/confirm-ablations/results.{md,json} reports/confirm-ablations/ ;;
    demo-confirm)  # the demo's claims on confirm: dynts demo --final, the first 100 confirm problems per family
      $LOCK $PY -m dynts.cli demo --final --set confirm --run-dir runs/demo-confirm
      for fam in copy chain; do
        mkdir -p reports/demo-confirm/$fam/records
        cp runs/demo-confirm/$fam/records/*.json reports/demo-confirm/$fam/records/
        cp runs/demo-confirm/$fam/results.{md,json} reports/demo-confirm/$fam/
        $PY -m eval.harness.compare runs/demo-confirm/$fam --wide > reports/demo-confirm/$fam/wide.md
      done ;;
    chain)  # the chain family's models and first numbers (training, PRM, predictor, full cache, B = 96 on dev)
      scripts/run_chain_testbed.sh ;;
    chain-fair)  # the fair chain LRM from scratch (4 x 256, the mechanism shapes, lost values and
      # reads), then its helper, PRM (+ AUROC on gate traces) and predictor rebuilt on it, the full cache on 200 dev
      # problems x k = 5 (target >= 85 %), and the predictor held out on ptest with the on-policy retention table
      $LOCK $PY -m dynts.cli testbed train --config configs/testbed/chain-lrm-fair.yaml --resume      # -> $CHAIN_FAIR
      $LOCK $PY -m dynts.cli eval --model $CHAIN_FAIR --benchmark testbed:n=200,family=chain,set=dev --method full \
        --k 5 --batch-size 100 --threads 2 --no-progress --run-dir runs/chain-fair-dev-full
      $LOCK $PY -m dynts.cli testbed train --config configs/testbed/chain-fair-helper.yaml --resume   # -> checkpoints/testbed-chain-fair-helper
      $LOCK $PY -m dynts.cli testbed train --config configs/testbed/chain-fair-prm.yaml --resume      # -> checkpoints/testbed-chain-fair-prm
      $LOCK $PY -m trainers.testbed_prm checkpoints/testbed-chain-fair-prm --family chain --n 200 > reports/prm-chain-fair.json
      $LOCK $PY -m dynts.cli pipeline --config configs/predictor/testbed-chain-fair.pipeline.yaml     # -> $CHAIN_FAIR_PREDICTOR
      for side in favouring fair; do
        model=testbed-chain; pred=checkpoints/testbed-chain-predictor
        [ $side = fair ] && model=$CHAIN_FAIR && pred=$CHAIN_FAIR_PREDICTOR
        $LOCK $PY -m eval.analyses.predictor_heldout --family chain --model $model --predictor $pred --n 200 --budget 96 \
          --local-window 32 --methods full,dynts,random,h2o+q,snapkv+q,rkv+q --out reports/predictor-heldout/chain-$side.json
      done
      $LOCK $PY -m eval.analyses.predictor_heldout --family copy --n 200 --budget 96 --local-window 32 \
        --methods full,dynts,random,h2o+q,snapkv+q,rkv+q --out reports/predictor-heldout/copy.json ;;
    chain-fair-dev)  # the before/after table on dev, every method, the DynTS-favouring chain LRM (testbed-chain)
      # vs the fair one, each with its own predictor, k = 5, the fractions above (a vacuous share shows here first)
      DEV="$PY -m dynts.cli eval --benchmark testbed:n=200,family=chain,set=dev $K5"
      M="$RANK_METHODS,window,streamingllm,sepllm,chain-oracle-step,chain-oracle-value"  # every method
      pair "$DEV --model testbed-chain --predictor checkpoints/testbed-chain-predictor --method $M --run-dir runs/chain-dev-favouring" \
           "$DEV --model $CHAIN_FAIR --predictor $CHAIN_FAIR_PREDICTOR --method $M --run-dir runs/chain-dev-fair"
      for side in favouring fair; do
        mkdir -p reports/chain-dev-$side/records
        $PY -m eval.harness.compare runs/chain-dev-$side --write > reports/chain-dev-$side/compare.md
        $PY -m eval.harness.compare runs/chain-dev-$side --wide > reports/chain-dev-$side/wide.md
        cp runs/chain-dev-$side/records/*.json reports/chain-dev-$side/records/
        cp runs/chain-dev-$side/results.{md,json} reports/chain-dev-$side/
      done
      $PY -m eval.harness.before_after reports/chain-dev-favouring reports/chain-dev-fair --names favouring,fair \
        > reports/chain-dev-before-after.md ;;  # the table docs/testbed.md prints
    copy-fair-dev)  # the fractions on dev for the fair copy LRM: its mean full trace sizes B; each share must leave
      # selection slots (question 14 + W_l 32 kept)
      $LOCK $PY -m dynts.cli eval --model $COPY_FAIR --predictor $COPY_FAIR_PREDICTOR --benchmark testbed:n=200,set=dev \
        --method full,dynts,random,rkv+q $K5 --run-dir runs/copy-dev-fair
      mkdir -p reports/copy-dev-fair/records
      $PY -m eval.harness.compare runs/copy-dev-fair --wide > reports/copy-dev-fair/wide.md
      cp runs/copy-dev-fair/records/*.json reports/copy-dev-fair/records/
      cp runs/copy-dev-fair/results.{md,json} reports/copy-dev-fair/ ;;
    sealed)  # the final tables on the final-only `sealed` problems, read only here (dynts eval
      # --final; each run appends to reports/final-ledger.jsonl): chain n = 500 on the fair chain LRM, copy n = 200 on
      # the fair copy LRM (lrm-fair.yaml), k = 5, the budgets dev gave the fractions above, every ranked method, the
      # oracles and the Table 2 ablations; verdicts Holm-adjusted per table with TOST +-3 points (compare --wide).
      # The full cache runs once, in the first run dir: token budgets need no full cell of their own
      SEALED="$PY -m dynts.cli eval --final $K5_RUN"
      CHAIN="$SEALED --benchmark testbed:n=500,family=chain,set=sealed --budget $CHAIN_BUDGETS --model $CHAIN_FAIR --predictor $CHAIN_FAIR_PREDICTOR"
      COPY="$SEALED --benchmark testbed:n=200,set=sealed --budget $COPY_BUDGETS --model $COPY_FAIR --predictor $COPY_FAIR_PREDICTOR"
      # chain ranks the question-protected scorers only (on dev the question-free ones score level with or below
      # their +q variants, reports/chain-dev-fair/): 500 problems x 5 samples is about 10 min of a core per cell
      pair "$CHAIN --method full,dynts,random,h2o+q,snapkv+q,rkv+q --run-dir runs/sealed-chain" \
           "$CHAIN --method chain-oracle-step,chain-oracle-value,$ABLATIONS --run-dir runs/sealed-chain-b"
      pair "$COPY --method $RANK_METHODS --run-dir runs/sealed-copy" \
           "$COPY --method oracle-step,oracle-value,$ABLATIONS --run-dir runs/sealed-copy-b"
      for run in sealed-chain sealed-copy; do
        mkdir -p reports/$run/records
        $PY -m eval.harness.compare runs/$run runs/$run-b --write > reports/$run/compare.md
        $PY -m eval.harness.compare runs/$run runs/$run-b --wide > reports/$run/wide.md   # the tables docs/evaluation.md will print
        cp runs/$run/records/*.json reports/$run/records/
        cp runs/$run-b/records/*.json reports/$run/records/   # one cp per run dir: a record both hold is rewritten, not refused
        cp runs/$run/results.{md,json} reports/$run/
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
date
