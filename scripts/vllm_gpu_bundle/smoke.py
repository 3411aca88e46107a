"""The bundle's smoke test on the GPU: stock vLLM 0.34 (no dynts) from the carry bundle on the image's torch and
triton. One in-process engine, ``torch.compile`` with FULL_AND_PIECEWISE CUDA graphs, TRITON_ATTN, native custom ops,
on a tiny random bf16 Llama; greedy tokens against transformers on the same weights; CUDA-graph replays counted.

    PYTHONPATH=<bundle site>:<checkout> python3 scripts/vllm_gpu_bundle/smoke.py --json OUT.json

Exit status: 0 every prompt's tokens equal transformers'; 4 the engine ran and produced every token but some prompt
diverged (bf16: HF eager and Triton/inductor may sum in another order and flip a near-tie); 3 the engine did not
produce every token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

PROMPTS = [[1, 17, 300, 42, 7], [5, 6, 7, 8, 9, 10, 11, 12], [900, 3], [2, 4, 8, 16, 32, 64]]
TOKENS = 16


def first_divergence(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None if len(got) == len(want) else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="write the result here")
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="vllm-smoke-")
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, initializer_range=0.2,  # peaky logits: fewer bf16 near-ties
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp)
    model = model.cuda().eval()
    with torch.no_grad():
        want = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=TOKENS, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    del model
    torch.cuda.empty_cache()

    import vllm
    from vllm import LLM, SamplingParams

    from dynts.vllm.selfcheck import counting_graph_replays

    with counting_graph_replays() as replays:
        t0 = time.perf_counter()
        llm = LLM(model=tmp, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3,
                  enforce_eager=False, attention_backend="TRITON_ATTN",
                  compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "custom_ops": ["none"]},
                  max_num_seqs=8, seed=0)
        init_s = time.perf_counter() - t0
        after_init = replays[0]
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        gen_s = time.perf_counter() - t0
        got = [list(o.outputs[0].token_ids) for o in outs]
    cc = llm.llm_engine.vllm_config.compilation_config
    match = [g == w for g, w in zip(got, want)]
    complete = all(len(g) == TOKENS for g in got)
    status = 0 if all(match) and complete else 4 if complete else 3
    result = {"status": status, "verdict": {0: "exact", 3: "no tokens", 4: "diverged (bf16)"}[status],
              "vllm": vllm.__version__, "torch": torch.__version__, "triton": __import__("triton").__version__,
              "device": torch.cuda.get_device_name(), "init_s": round(init_s, 1), "generate_s": round(gen_s, 3),
              "mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode),
              "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
              "attention": str(llm.llm_engine.vllm_config.attention_config.backend),
              "graph_replays_generate": replays[0] - after_init, "match": match,
              "first_divergence": [first_divergence(g, w) for g, w in zip(got, want)], "got": got, "want": want}
    print(json.dumps(result), flush=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
