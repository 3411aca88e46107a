"""What KV-Rescue does per step, apart from the base's eviction: :class:`RescueConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .detector import DegenerationDetector, resolve_option
from .sampling import Sampler

__all__ = ["RescueConfig"]


@dataclass
class RescueConfig:
    """The step search of KV-Rescue (paper, Method and Algorithm 1; defaults: Appendix C).

    The base's eviction is separate: :class:`~dynts.core.EvictionSettings` (or its keywords).

    Args:
        n_base, n_helper: candidates per step from the evicted base and from the full-context helper
            (``n_base + n_helper >= 1``; ``n_helper = 0`` is eviction-only stepwise best-of-N).
        step_delimiter: text ending a step (paper: ``"\\n\\n"``; the testbed: ``";"``).
        max_steps, max_step_tokens, max_tokens: caps on committed steps, tokens per candidate and
            committed output tokens.
        detector: the online degeneration detector for base candidates: ``True`` (paper defaults),
            a :class:`~dynts.rescue.DegenerationDetector`, a dict of its fields, or ``None``/``False``
            (off); held as a detector or ``None`` after construction.
        temperature, top_p, top_k: sampling (paper: 0.8, 0.95, 20); ``seed``: the candidates'
            random streams (:func:`~dynts.rescue.candidate_generator`).
        max_rows: most candidate rows per batched forward (sets how many problems are in flight;
            results do not depend on it).

    ``sampler`` (the candidates' :class:`~dynts.rescue.Sampler`) is derived.
    """

    n_base: int = 4
    n_helper: int = 4
    step_delimiter: str = "\n\n"
    max_steps: int = 1024
    max_step_tokens: int = 512
    max_tokens: int = 4096
    detector: DegenerationDetector | dict | bool | None = True
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 20
    seed: int = 0
    max_rows: int = 64
    sampler: Sampler = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, low in (("n_base", 0), ("n_helper", 0), ("max_steps", 1), ("max_step_tokens", 1),
                          ("max_tokens", 1), ("max_rows", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        if self.n_base + self.n_helper < 1:
            raise ValueError(f"n_base + n_helper must be >= 1 (got n_base={self.n_base}, n_helper={self.n_helper}); "
                             "e.g. n_base=4, n_helper=4")
        self.detector = resolve_option("detector", self.detector, DegenerationDetector)
        self.sampler = Sampler(self.temperature, self.top_k, self.top_p)  # checks temperature, top_k, top_p

    @property
    def width(self) -> int:
        """Rows one problem takes in a batch (its larger candidate set)."""
        return max(self.n_base, self.n_helper)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The fields a caller sets."""
        return frozenset(f.name for f in fields(cls) if f.init)
