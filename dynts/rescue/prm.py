"""Process reward models behind one small interface: ``scorer.score(requests) -> list[float]``.

A :class:`StepRequest` is one candidate step ``s`` in its committed context ``c_t = (q, s_<t)``;
the scorer returns ``R(c_t, s)`` in ``[0, 1]`` (higher = better). Three kinds:

* :class:`QwenMathPRM` -- the Qwen2.5-Math-PRM recipe (model card; paper, Appendix C): system
  prompt, the steps (split at ``"\\n\\n"``) joined and followed by ``<extra_0>`` in the assistant
  turn of the chat template, and ``softmax(logits)[..., 1]`` at each ``<extra_0>``; the candidate's
  score is the one at its own (last) separator.
* :class:`TokenClassificationPRM` -- a 2-label token classifier scored at a separator token that
  ends each step, on the raw trajectory text (the testbed PRM: ``;``).
* :class:`CallablePRM` -- any ``fn(question, steps) -> float`` scoring the last of ``steps``.

:func:`load_prm` builds one from a name (``"testbed-prm"``), a local directory, a
``(model, tokenizer)`` pair or a callable. Nothing is downloaded; ``trust_remote_code`` is used only
when the caller passes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from ..prompts import pad_id
from .prefix import PrefixScorer
from .scorer import CallablePRM, StepRequest, StepScorer, padded_batches, shares_vocab

__all__ = [
    "QWEN_MATH_SYSTEM",
    "CallablePRM",
    "QwenMathPRM",
    "StepRequest",
    "StepScorer",
    "TokenClassificationPRM",
    "load_prm",
]

QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def _logits(output: Any) -> torch.Tensor:
    """Token-classification logits ``[b, T, labels]`` from a model output (ModelOutput or tuple)."""
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output[0]


def _groups(requests: Sequence[StepRequest]) -> list[list[int]]:
    """Indices of requests that share a committed context (the candidates of one step)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        key = (r.question, tuple(r.prompt_ids), tuple(t for s in r.steps for t in s))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


class _TokenScorer(StepScorer):
    """Shared batching: score each row of token ids at one position (right padding; causal models).

    With ``reuse_prefix`` (default) the candidates of a step are scored as continuations of their
    committed context, which is encoded once and extended step by step (:mod:`.prefix`); this is
    verified once against full forwards and falls back to them for non-causal backbones.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, positive_label: int = 1, batch_size: int = 16,
                 reuse_prefix: bool = True, prefix_entries: int = 32):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.positive_label, self.batch_size = positive_label, batch_size
        pad = pad_id(tokenizer)
        self.pad_id = 0 if pad is None else int(pad)
        self.prefix = PrefixScorer(self.model, self.pad_id, prefix_entries) if reuse_prefix else None

    def _positive(self, probs: torch.Tensor) -> list[float]:
        if probs.shape[-1] <= self.positive_label:
            raise ValueError(
                f"PRM outputs {probs.shape[-1]} labels per token; positive_label={self.positive_label} "
                "needs a token-classification PRM with at least 2 labels"
            )
        return probs[:, self.positive_label].tolist()

    def score_rows(self, rows: Sequence[list[int]], positions: Sequence[int], groups: Sequence[list[int]]) -> list[float]:
        """Positive-label probability at ``positions[i]`` of ``rows[i]``; ``groups`` lists rows that
        share their committed context."""
        if self.prefix is not None and groups and self.prefix.check([rows[i] for i in groups[0]], [positions[i] for i in groups[0]]):
            out = [0.0] * len(rows)
            for group in groups:
                probs = self.prefix.score_group([rows[i] for i in group], [positions[i] for i in group])
                for i, p in zip(group, self._positive(probs)):
                    out[i] = p
            return out
        return self.score_ids(rows, positions)

    @torch.no_grad()
    def score_ids(self, rows: Sequence[list[int]], positions: Sequence[int]) -> list[float]:
        """Positive-label probability at ``positions[i]`` of ``rows[i]`` (full forwards)."""
        out = [0.0] * len(rows)
        for chunk, ids, mask in padded_batches(rows, self.batch_size, self.pad_id, next(self.model.parameters()).device):
            logits = _logits(self.model(input_ids=ids, attention_mask=mask))
            at = torch.tensor([positions[i] for i in chunk], device=logits.device)
            probs = logits[torch.arange(len(chunk), device=logits.device), at].float().softmax(-1)
            for i, p in zip(chunk, self._positive(probs)):
                out[i] = p
        return out


class QwenMathPRM(_TokenScorer):
    """The Qwen2.5-Math-PRM recipe.

    ``system`` + user ``question`` + assistant ``"<extra_0>".join(steps) + "<extra_0>"`` through the
    tokenizer's chat template; the score is ``softmax(logits)[positive_label]`` at the candidate's
    separator (the last one). Steps are stripped of the ``step_delimiter`` the policy generated.
    """

    def __init__(self, model, tokenizer, *, system: str = QWEN_MATH_SYSTEM, separator: str = "<extra_0>",
                 step_delimiter: str = "\n\n", positive_label: int = 1, batch_size: int = 8, reuse_prefix: bool = True):
        super().__init__(model, tokenizer, positive_label, batch_size, reuse_prefix)
        ids = tokenizer.encode(separator, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"separator={separator!r} must be one token of the PRM tokenizer (got {len(ids)} tokens)")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the PRM tokenizer has no chat template; the Qwen2.5-Math-PRM recipe needs one")
        self.separator, self.separator_id = separator, ids[0]
        self.system, self.step_delimiter = system, step_delimiter

    def encode(self, question: str, steps: Sequence[str]) -> list[int]:
        """Token ids of the recipe's conversation for ``steps``."""
        clean = [s.strip() if self.step_delimiter.strip() == "" else s.replace(self.step_delimiter, "").strip() for s in steps]
        messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": question},
            {"role": "assistant", "content": self.separator.join(clean) + self.separator},
        ]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @torch.no_grad()
    def step_rewards(self, question: str, steps: Sequence[str]) -> list[float]:
        """The model card's ``make_step_rewards`` for one solution: one score per step."""
        ids = torch.tensor([self.encode(question, steps)], device=next(self.model.parameters()).device)
        probs = _logits(self.model(input_ids=ids)).float().softmax(-1)[0]
        return probs[ids[0] == self.separator_id, self.positive_label].tolist()

    def score(self, requests: Sequence[StepRequest]) -> list[float]:
        rows = [self.encode(r.question, r.step_texts()) for r in requests]
        positions = []
        for row in rows:
            seps = [i for i, t in enumerate(row) if t == self.separator_id]
            positions.append(seps[-1])
        return self.score_rows(rows, positions, _groups(requests))


class TokenClassificationPRM(_TokenScorer):
    """A token classifier scored at the ``separator`` ending the candidate, on the raw trajectory.

    The trajectory is ``prompt + steps + candidate`` as the policy wrote it; when the candidate does
    not end with the separator (EOS or the per-step cap), EOS is dropped and the separator appended,
    as the Qwen recipe appends ``<extra_0>`` after every step. When the PRM and the policy share a
    vocabulary the policy's ids are used as they are; otherwise the decoded text is re-tokenised.
    """

    def __init__(self, model, tokenizer, *, separator: str = ";", positive_label: int = 1, batch_size: int = 16,
                 reuse_prefix: bool = True):
        super().__init__(model, tokenizer, positive_label, batch_size, reuse_prefix)
        ids = tokenizer.encode(separator, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"separator={separator!r} must be one token of the PRM tokenizer (got {len(ids)} tokens)")
        self.separator, self.separator_id = separator, ids[0]
        self._same_vocab: dict[int, bool] = {}

    def _shares_vocab(self, policy_tokenizer: Any) -> bool:
        return shares_vocab(self._same_vocab, self.tokenizer, policy_tokenizer)

    def encode(self, request: StepRequest) -> list[int]:
        tok = request.tokenizer
        special = set(getattr(tok, "all_special_ids", []))
        candidate = list(request.candidate)
        while candidate and candidate[-1] in special:
            candidate.pop()
        ids = list(request.prompt_ids) + [t for s in request.steps for t in s] + candidate
        if self._shares_vocab(tok):
            row = ids
        else:
            row = self.tokenizer.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False)
        if not row or row[-1] != self.separator_id:
            row = row + [self.separator_id]
        return row

    def score(self, requests: Sequence[StepRequest]) -> list[float]:
        rows = [self.encode(r) for r in requests]
        return self.score_rows(rows, [len(r) - 1 for r in rows], _groups(requests))


def _load_dir(path: Path, trust_remote_code: bool, dtype: torch.dtype, device: str | torch.device):
    from ..models import load

    config = json.loads((path / "config.json").read_text())
    remote = "AutoModel" in (config.get("auto_map") or {})
    if remote and not trust_remote_code:
        raise ValueError(
            f"PRM {str(path)!r} ships its own model code (auto_map {config['auto_map'].get('AutoModel')!r}); "
            "pass trust_remote_code=True if you trust that directory"
        )
    if not remote and not any(a.endswith("ForTokenClassification") for a in config.get("architectures") or []):
        raise ValueError(
            f"PRM {str(path)!r} is neither a token-classification model (architectures "
            f"{config.get('architectures')}) nor a remote-code PRM with auto_map.AutoModel"
        )
    task = "model" if remote else "token-classification"
    return load(path, task=task, dtype=dtype, device=device, trust_remote_code=trust_remote_code)


def load_prm(
    prm: Any,
    *,
    kind: str | None = None,
    separator: str | None = None,
    step_delimiter: str = "\n\n",
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **options: Any,
) -> StepScorer:
    """Build a :class:`StepScorer`.

    Args:
        prm: a :class:`StepScorer`; a callable ``fn(question, steps) -> float``; a
            ``(model, tokenizer)`` pair; ``"testbed-prm"``; or a local directory.
        kind: ``"qwen"`` (chat-template recipe), ``"token"`` (raw trajectory) or ``"likelihood"``
            (a causal LM as verifier: :class:`~dynts.rescue.likelihood.LikelihoodPRM`; ``prm`` is then a
            ``(causal_lm, tokenizer)`` pair, a model name for :func:`dynts.models.load` or a directory);
            default: ``"qwen"`` when the tokenizer knows ``<extra_0>``, else ``"token"``.
        separator: the scored separator token (default ``<extra_0>`` / ``;``).
        step_delimiter: the policy's step delimiter (stripped from steps by the Qwen recipe).
        trust_remote_code: allow a directory's own model code (Qwen2.5-Math-PRM ships
            ``Qwen2ForProcessRewardModel``); never implied.
        **options: ``positive_label``, ``batch_size``, ``system`` (Qwen recipe), ``reduce`` (likelihood).
    """
    if isinstance(prm, StepScorer):
        return prm
    if kind not in (None, "qwen", "token", "likelihood"):
        raise ValueError(f"kind={kind!r} must be 'qwen', 'token', 'likelihood' or None (auto)")
    if kind == "likelihood":
        from .likelihood import LikelihoodPRM

        if isinstance(prm, (str, Path)):
            from ..models import load

            prm = load(prm, dtype=dtype, device=device, task="causal-lm", trust_remote_code=trust_remote_code)
        if not (isinstance(prm, tuple) and len(prm) == 2 and isinstance(prm[0], torch.nn.Module)):
            raise ValueError(f"prm={prm!r}: kind='likelihood' needs a (causal_lm, tokenizer) pair or a model name / directory")
        return LikelihoodPRM(prm[0], prm[1], **options)
    if isinstance(prm, (str, Path)):
        name = str(prm)
        if name.startswith("testbed"):
            from ..models import load

            model, tokenizer = load(name, dtype=dtype, device=device, task="token-classification")
            kind, separator = kind or "token", separator or ";"
        else:
            path = Path(name).expanduser()
            if not (path / "config.json").is_file():
                raise ValueError(f"prm={name!r} is not 'testbed-prm' nor a local directory with config.json")
            model, tokenizer = _load_dir(path, trust_remote_code, dtype, device)
        prm = (model, tokenizer)
    if isinstance(prm, tuple) and len(prm) == 2 and isinstance(prm[0], torch.nn.Module):
        model, tokenizer = prm
        if kind is None:
            kind = "qwen" if "<extra_0>" in tokenizer.get_vocab() else "token"
        if kind == "qwen":
            return QwenMathPRM(model, tokenizer, separator=separator or "<extra_0>", step_delimiter=step_delimiter, **options)
        return TokenClassificationPRM(model, tokenizer, separator=separator or ";", **options)
    if isinstance(prm, torch.nn.Module):
        raise ValueError("prm=<model> needs its tokenizer: pass prm=(model, tokenizer)")
    if callable(prm):
        return CallablePRM(prm)
    raise ValueError(
        f"prm={prm!r} must be a StepScorer, a callable fn(question, steps) -> float, a (model, tokenizer) pair, "
        "'testbed-prm' or a local PRM directory"
    )
