"""Incremental detokenization: the last ``window`` characters of a candidate's text, token by token.

The gzip test of the degeneration detector (paper Eq. 5) needs the last ``compress_window``
characters of each candidate after every token. Re-decoding the whole candidate each time costs
``O(T)`` per token (``O(T^2)`` per candidate); :class:`TextTail` decodes only the tokens since the
last complete piece of text (the offsets scheme of Hugging Face's ``TextStreamer`` and vLLM's
detokenizer: decode ``tokens[prefix:read]`` and ``tokens[prefix:]`` and keep the difference, so
tokenizers that merge or strip spaces at piece boundaries give the same text as one full decode).
Text ending in an incomplete UTF-8 character (``"\\ufffd"``) is held back until the character is
complete.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["TextTail"]


class TextTail:
    """The last ``window`` characters of ``decode(tokens)``, kept up to date by :meth:`push`.

    Args:
        decode: ``ids -> str`` (e.g. ``tokenizer.decode(ids, skip_special_tokens=False)``).
        window: characters kept.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], window: int):
        if window < 1:
            raise ValueError(f"window={window!r} must be >= 1 character")
        self.decode, self.window = decode, window
        self.text = ""
        self._prefix = self._read = 0

    def push(self, tokens: Sequence[int]) -> str:
        """Account for the tokens appended to ``tokens`` since the last call; return the tail."""
        before = self.decode(tokens[self._prefix : self._read]) if self._read > self._prefix else ""
        after = self.decode(tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text = (self.text + after[len(before) :])[-self.window :]
            self._prefix, self._read = self._read, len(tokens)
        return self.text
