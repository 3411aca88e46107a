#!/usr/bin/env bash
# A short run of two stock OpenAI clients against `dynts serve` (docs/serving.md, "Real clients"):
# lm-evaluation-harness `local-completions` (tokenized list prompts, batch_size 4, stop strings) and
# guidellm (synthetic data with output_tokens, which sends ignore_eos). The clients live in their own
# venv: python3 -m venv $CLIENTS && $CLIENTS/bin/pip install 'lm-eval[api]==0.4.13' guidellm==0.8.1
set -euo pipefail
cd "$(dirname "$0")/../.."
CLIENTS=${CLIENTS:-/work/clients-venv}
PY=${PY:-python}
MODEL=${MODEL:-smollm2-135m}
PORT=${PORT:-8765}
OUT=${OUT:-runs/serve_clients}
SERVE_ARGS=${SERVE_ARGS:---kv-method streamingllm --kv-budget 128 --kv-local-window 16 --page-size 32 --num-blocks 64 --max-batch-tokens 256}
mkdir -p "$OUT"
TOKENIZER=$($PY -c "from dynts.models import resolve_path; print(resolve_path('$MODEL'))")

$PY -m dynts.cli serve "$MODEL" --port "$PORT" --device cpu $SERVE_ARGS >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/server.log"; exit 1; }
  sleep 1
done
grep "^dynts serve:" "$OUT/server.log"

echo "== lm-eval local-completions"
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$CLIENTS/bin/lm-eval" run --model local-completions \
  --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$TOKENIZER,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1" \
  --tasks dynts_serve_smoke --include_path scripts/serve_clients --batch_size 4 --output_path "$OUT/lm_eval" 2>&1 \
  | tee "$OUT/lm_eval.log" | grep -E "^\|" || true
echo "lm-eval rc=${PIPESTATUS[0]}"

echo "== guidellm"
HF_HUB_OFFLINE=1 "$CLIENTS/bin/guidellm" run --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=$MODEL" \
  --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
  --data "kind=synthetic_text,prompt_tokens=64,output_tokens=64" \
  --profile kind=concurrent,streams=4 --constraint kind=max_requests,count=16 \
  --output "kind=json,path=$OUT/guidellm.json" --disable-console-interactive 2>&1 | tee "$OUT/guidellm.log" | tail -40
echo "guidellm rc=${PIPESTATUS[0]}"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -v "^#" | tee "$OUT/metrics.txt"
grep -c Traceback "$OUT/server.log" || true
