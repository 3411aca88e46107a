"""A verifier-likelihood step scorer: a full-context causal LM judges a candidate step by how likely
it finds the step's tokens.

``R(c_t, s) = exp(reduce_i log p_verifier(s_i | c_t, s_<i))`` with ``reduce`` = ``min`` (the least
likely token: one wrong digit or hallucinated value sinks the step) or ``mean`` (per-token geometric
mean). This is the process signal of policy-likelihood verifiers (cf. "implicit PRMs", Yuan et al.
2024, which use a log-likelihood ratio): no process labels are needed, only a model that sees the
whole context. In KV-Rescue it stands where a trained PRM is not available or not good enough; any
causal LM sharing the policy's tokenizer (or any tokenizer, via text) can be the verifier.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..prompts import pad_id
from .scorer import StepRequest, StepScorer, padded_batches, shares_vocab

__all__ = ["LikelihoodPRM"]


class LikelihoodPRM(StepScorer):
    """Scores candidates with a causal LM's token log-probabilities given the full committed context.

    Args:
        model: a causal LM (``logits`` ``[b, T, vocab]``), kept on its device.
        tokenizer: the verifier's tokenizer. When it has the policy's vocabulary the policy's ids
            are scored as they are; otherwise context and candidate are decoded and re-tokenised.
        reduce: ``"min"`` or ``"mean"`` over the candidate's tokens (log space).
        batch_size: rows per forward.

    Returns (``score``) one probability-like value in ``(0, 1]`` per request.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, reduce: str = "min", batch_size: int = 16):
        if reduce not in ("min", "mean"):
            raise ValueError(f"reduce={reduce!r} must be 'min' or 'mean'")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
        self.model, self.tokenizer, self.reduce, self.batch_size = model.eval(), tokenizer, reduce, batch_size
        pad = pad_id(tokenizer)
        self.pad_id = 0 if pad is None else int(pad)
        self._same_vocab: dict[int, bool] = {}

    def _shares_vocab(self, policy_tokenizer: Any) -> bool:
        return shares_vocab(self._same_vocab, self.tokenizer, policy_tokenizer)

    def encode(self, request: StepRequest) -> tuple[list[int], int]:
        """``(row, start)``: the verifier's ids of context + candidate and where the candidate starts."""
        context = list(request.prompt_ids) + [t for s in request.steps for t in s]
        candidate = [t for t in request.candidate if t != self.pad_id]
        if self._shares_vocab(request.tokenizer):
            return context + candidate, len(context)
        decode = request.tokenizer.decode
        head = self.tokenizer.encode(decode(context, skip_special_tokens=False), add_special_tokens=False)
        row = self.tokenizer.encode(decode(context + candidate, skip_special_tokens=False), add_special_tokens=False)
        return row, min(len(head), len(row) - 1)

    @torch.no_grad()
    def score_rows(self, rows: Sequence[list[int]], starts: Sequence[int]) -> list[float]:
        """Reduced log-probability (exponentiated) of ``rows[i][starts[i]:]`` given ``rows[i][:starts[i]]``."""
        out = [1.0] * len(rows)
        for chunk, ids, mask in padded_batches(rows, self.batch_size, self.pad_id, next(self.model.parameters()).device):
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
            logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # [b, T-1]: token t+1
            for j, i in enumerate(chunk):
                start = max(1, starts[i])
                token_logp = logp[j, start - 1 : len(rows[i]) - 1]
                if token_logp.numel() == 0:
                    continue  # an empty candidate is neither likely nor unlikely
                value = token_logp.min() if self.reduce == "min" else token_logp.mean()
                out[i] = float(value.exp())
        return out

    def score(self, requests: Sequence[StepRequest]) -> list[float]:
        encoded = [self.encode(r) for r in requests]
        return self.score_rows([r for r, _ in encoded], [s for _, s in encoded])
