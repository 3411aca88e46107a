"""Random-init models of a given shape with the testbed tokenizer, saved as Hugging Face directories: what the
engine checks and memory benches run (speed and memory do not depend on the weights)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["R1_DISTILL_7B", "random_llama"]

# DeepSeek-R1-Distill-Qwen-7B's shape (a Qwen2): what every 7B timing of the GPU check and its vLLM bundle runs
R1_DISTILL_7B = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, max_position_embeddings=131072, rope_theta=10000.0, tie_word_embeddings=False,
)


def random_llama(path: str | Path, *, seed: int = 0, **shape) -> Path:
    """Save a seeded random-init Llama (``shape``: any ``LlamaConfig`` field, e.g. ``hidden_size``,
    ``num_hidden_layers``, ``head_dim``) with the testbed tokenizer under ``path``; returns ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dynts.models import load_tokenizer

    tok = load_tokenizer("testbed")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **shape)
    path = Path(path)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path
