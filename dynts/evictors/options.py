"""Validation of evictor settings shared by several methods (each raises ``ValueError`` naming the field)."""

from __future__ import annotations

POOLINGS = ("max", "avg")


def check_pooling(kernel_size: object, pooling: object) -> None:
    """Raise ``ValueError`` unless ``kernel_size`` is a positive odd int and ``pooling`` is known."""
    if not isinstance(kernel_size, int) or isinstance(kernel_size, bool) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size={kernel_size!r} must be a positive odd int (e.g. 7; 1 = no pooling)")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} must be one of {POOLINGS}")


def check_window(observation_window: object) -> None:
    if not isinstance(observation_window, int) or isinstance(observation_window, bool) or observation_window < 1:
        raise ValueError(f"observation_window={observation_window!r} must be a positive int (e.g. 8)")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")


class KeepsQuestion:
    """The ``keep_question`` option of the attention-scored methods (their ``+q`` presets): the prompt is
    protected at every event, so its leading slots never move (a paged engine may share their blocks)."""

    keep_question: bool

    def protected_prefix(self, question_length: int) -> int:
        return question_length if self.keep_question else 0


class SelectsPerHead:
    """The ``per_head`` option of the attention-scored methods: ``True`` selects each KV head's own top
    ``n_keep`` of every layer, from that head's attention (and keys), as H2O, SnapKV and R-KV do in their
    papers; ``False`` selects one set for all layers and heads (the statistics summed over them), the only
    granularity a paged engine (vLLM, continuous batching) can apply: its blocks hold every head of a token."""

    per_head: bool
