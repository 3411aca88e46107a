"""Tiny offline models and tokenizers for the KV-Rescue tests (random weights, word-level vocab)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForTokenClassification

from conftest import TINY, tiny_model

DELIMITER = ";"
DELIMITER_ID = 3
CHAT = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + ' <|im_end|> ' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant ' }}{%- endif -%}"
)


def word_tokenizer(extra: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """128 words matching ``conftest.TINY``: pad 0, bos 1, eos 2, ``;`` 3, then w4..w127 (+ extra specials)."""
    words = ["<pad>", "<bos>", "<eos>", DELIMITER] + [f"w{i}" for i in range(4, TINY["vocab_size"])]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<pad>", padding_side="left", clean_up_tokenization_spaces=False)
    if extra:
        tok.add_special_tokens({"additional_special_tokens": list(extra)})
    tok.chat_template = CHAT
    return tok


def step_model(seed: int = 0, family: str = "qwen2", delimiter_logit: float = 3.0) -> torch.nn.Module:
    """A tiny random causal LM that writes the delimiter every few tokens and EOS rarely: the
    delimiter's output row points along the mean final hidden state (logit ~``delimiter_logit``)."""
    model = tiny_model(family, seed)
    g = torch.Generator().manual_seed(seed)
    probe = torch.randint(4, TINY["vocab_size"], (8, 32), generator=g)
    with torch.no_grad():
        hidden = model(probe, output_hidden_states=True).hidden_states[-1].reshape(-1, TINY["hidden_size"])
        mean = hidden.mean(0)
        w = model.lm_head.weight
        w[DELIMITER_ID] = delimiter_logit * mean / mean.norm() ** 2
        w[0].zero_()  # pad
        w[1].zero_()  # bos
        w[2] = 0.5 * delimiter_logit * mean / mean.norm() ** 2  # eos: now and then
    return model


def tiny_prm(seed: int = 5, vocab_size: int = TINY["vocab_size"]) -> torch.nn.Module:
    """A random 2-label token classifier (the Qwen2.5-Math-PRM interface)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(**{**TINY, "vocab_size": vocab_size}, num_labels=2, attn_implementation="sdpa")
    return Qwen2ForTokenClassification(cfg).eval()


def decode_ragged(policy, cache, continuations: list[list[int]], first_logits: torch.Tensor) -> list[list[torch.Tensor]]:
    """Feed each row its own continuation through ``policy.forward``, one token per step; rows that run
    out ride along padded (``valid`` False). Returns each row's logits: ``first_logits[r]`` then one per
    token it was fed."""
    got = [[first_logits[r]] for r in range(len(continuations))]
    for k in range(max(len(c) for c in continuations)):
        valid = torch.tensor([[k < len(c)] for c in continuations])
        ids = torch.tensor([[c[k] if k < len(c) else 0] for c in continuations])
        out = policy.forward(cache, ids, valid)
        for r in range(len(continuations)):
            if valid[r, 0]:
                got[r].append(out[r])
    return got
