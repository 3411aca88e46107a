"""From engine outputs to OpenAI choices: incremental text, stop strings, finish reasons, usage.

Every engine request streams its tokens (also for a non-streaming HTTP request) so that
:class:`Choice` can decode them incrementally and end the text *before* a ``stop`` string the moment
it appears (``finish_reason="stop"``; the server then cancels the engine request). Text is held back
by ``len(longest stop) - 1`` characters so a stop string split over tokens is never sent. A
:class:`Completion` groups the ``n`` choices of every prompt of one HTTP request and renders the
OpenAI bodies: the response, the stream chunks and the usage (with ``usage.dynts``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from ..metrics import ServerCounters, usage_dynts
from .openai_api import CompletionRequest
from .sampling import SamplingParams

__all__ = ["Choice", "Completion"]


class Choice:
    """One generated sequence: its engine request, its text so far and how it ended."""

    def __init__(self, index: int, prompt_index: int, sampling: SamplingParams, stops: tuple[str, ...], tokenizer,
                 max_new_tokens: int, on_change, counters: ServerCounters | None = None) -> None:
        self.index, self.prompt_index, self.sampling, self.stops = index, prompt_index, sampling, stops
        self.request_id = f"dynts-{uuid.uuid4().hex}"
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens
        self._on_change, self._counters = on_change, counters
        self.tokens: list[int] = []
        self.text = ""  # released to the client
        self.unsent = ""  # released, not yet drained into a stream chunk
        self._held = ""  # decoded, held back in case a stop string starts here
        self._prefix = self._read = 0  # incremental decoding offsets into self.tokens
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.engine_done = False  # the engine delivered its last output for this request
        self.done = False

    def on_output(self, output) -> None:
        """Engine callback (on the event loop) with the request's tokens so far."""
        if self.done:
            return
        new = output.generated_tokens[len(self.tokens):]
        self.tokens.extend(new)
        if self._counters is not None and new:
            self._counters.add(generation_tokens=len(new))
        finished = output.is_finished()
        if finished:
            self.engine_done = True
        if output.error is not None:
            self.error, self.done = output.error, True
            self._on_change()
            return
        pending = self._held + self._decode(final=finished)
        cut = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._release(pending[:cut])
            self._end("stop")
        elif finished:
            self._release(pending)
            self._end("length" if len(self.tokens) >= self.max_new_tokens else "stop")
        else:
            keep = len(pending) - self._hold if self._hold else len(pending)
            self._release(pending[:keep])
            self._held = pending[keep:]
        self._on_change()

    def _decode(self, final: bool) -> str:
        """Text of the tokens not decoded yet (an incomplete UTF-8 sequence waits for its next token)."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.tokens[self._prefix:self._read])
        after = decode(self.tokens[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return after[len(before):]

    def _release(self, text: str) -> None:
        self.text += text
        self.unsent += text
        self._held = ""

    def _end(self, reason: str) -> None:
        self.finish_reason, self.done = reason, True


class Completion:
    """The choices of one HTTP request and its OpenAI response bodies."""

    def __init__(self, request: CompletionRequest, *, model: str, tokenizer, prompt_lengths: list[int],
                 max_new_tokens: list[int], counters: ServerCounters | None = None) -> None:
        self.request, self.model, self.prompt_lengths = request, model, prompt_lengths
        self.id = f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._changed = asyncio.Event()
        self.stats: list[dict[str, int]] | None = None
        self.choices: list[Choice] = []
        for p, budget in enumerate(max_new_tokens):
            for j in range(request.n):
                sampling = request.sampling
                if sampling.seed is not None and j:  # n seeded choices differ, and each is reproducible
                    sampling = SamplingParams(**{**sampling.__dict__, "seed": sampling.seed + j})
                self.choices.append(Choice(len(self.choices), p, sampling, request.stop, tokenizer, budget,
                                           self._changed.set, counters))
        self._announced: set[int] = set()
        self._closed: set[int] = set()

    @property
    def done(self) -> bool:
        return all(c.done for c in self.choices) or self.error is not None

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error is not None), None)

    async def wait(self, timeout: float | None) -> None:
        """Until a choice changes (or ``timeout`` seconds)."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._changed.clear()

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_lengths)
        completion = sum(len(c.tokens) for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        usage["dynts"] = usage_dynts(self.stats or [])
        return usage

    def response(self) -> dict[str, Any]:
        """The non-streaming body."""
        if self.request.chat:
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                        "finish_reason": c.finish_reason} for c in self.choices]
            kind = "chat.completion"
        else:
            choices = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                       for c in self.choices]
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage()}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.request.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def drain_chunks(self) -> list[dict[str, Any]]:
        """Stream chunks for the text released since the last call (one per choice that changed)."""
        chunks = []
        for c in self.choices:
            if c.index in self._closed:
                continue
            text, c.unsent = c.unsent, ""
            ended = c.done and c.error is None
            if not text and not ended and (not self.request.chat or c.index in self._announced):
                continue
            if self.request.chat:
                delta: dict[str, Any] = {"content": text} if text else {}
                if c.index not in self._announced:
                    delta = {"role": "assistant", **delta}
                    self._announced.add(c.index)
                entry = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
            else:
                entry = {"index": c.index, "text": text, "logprobs": None, "finish_reason": None}
            if ended:
                entry["finish_reason"] = c.finish_reason
                self._closed.add(c.index)
            chunks.append(self._chunk([entry]))
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk([]), "usage": self.usage()}
