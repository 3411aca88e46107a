"""Finished rows leave a batched decode: the forward runs on the rows still generating.

``model.generate`` keeps every row of a batch in every forward until the longest one ends; a row that has
emitted EOS is still decoded (its tokens are replaced by padding). In a batch of reasoning traces of very
different lengths most of the decode work then goes to finished rows. :class:`RowRetirement` hooks the
model's forward (through :func:`dynts.attach`): every ``check_every`` decode steps the rows that have fed an
EOS token leave the cache (:meth:`~dynts.cache.BoundedCache.batch_select_indices`) and later forwards run on
the other rows only; their logits are written back into a ``[batch, 1, vocab]`` tensor (zeros for the rows that
left), so ``generate``'s sampling sees the shapes it expects and draws the same random numbers.

The rows left generate exactly what they generate in the whole batch: every row evicts on its own at the
shared events, the model computes each row independently, and a multinomial draw for one row does not depend
on the other rows' probabilities (``tests/test_retire.py`` checks bitwise equal sequences, method by method).
``result.cache`` then holds only the rows still running at the end.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .bounded import BoundedCache

__all__ = ["RowRetirement"]


class RowRetirement:
    """Drop finished rows from the forwards of one ``generate`` call.

    Args:
        eos_token_ids: the ids that end a row (the generation config's EOS).
        check_every: decode steps between two checks; a check reads one ``[batch]`` flag to the host
            (one sync on an accelerator), and a check that finds finished rows copies the cache once.
        min_rows: the fewest rows a forward keeps (finished ones fill up to it): a matrix product of
            fewer rows may take another kernel and round differently (on our CPU a decode forward of
            under 16 rows gives logits a few ulp off the whole batch's), and a forward that small costs
            about what one of 16 rows costs.
    """

    def __init__(self, eos_token_ids: Sequence[int], check_every: int = 8, min_rows: int = 16) -> None:
        if not eos_token_ids:
            raise ValueError("RowRetirement needs the EOS token ids (generation_config.eos_token_id)")
        if check_every < 1:
            raise ValueError(f"check_every={check_every} must be >= 1")
        if min_rows < 1:
            raise ValueError(f"min_rows={min_rows} must be >= 1")
        self.eos = torch.tensor(list(eos_token_ids), dtype=torch.long)
        self.check_every, self.min_rows = check_every, min_rows
        self.batch = 0  # rows of the whole batch
        self.active: torch.Tensor | None = None  # [r] rows of the whole batch still in the forwards (None: all)
        self.done: torch.Tensor | None = None  # [batch] the row has fed an EOS token
        self.steps = 0
        self.retired = 0

    def before(self, cache: BoundedCache, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The forward's keyword arguments restricted to the rows still generating (decode steps only)."""
        ids = kwargs.get("input_ids")
        if ids is None or ids.shape[1] != 1 or cache.positions is None:  # a prefill: every row
            self.batch = 0 if ids is None else ids.shape[0]
            return kwargs
        if self.done is None:
            self.batch = ids.shape[0]
            self.done = torch.zeros(self.batch, dtype=torch.bool, device=ids.device)
            self.eos = self.eos.to(ids.device)
        self.done |= torch.isin(ids[:, 0], self.eos)
        self.steps += 1
        if self.steps % self.check_every == 0:
            self._retire(cache)
        if self.active is None:
            return kwargs
        return {k: v.index_select(0, self.active) if _per_row(v, self.batch) else v for k, v in kwargs.items()}

    def after(self, output: Any) -> Any:
        """``output`` with its logits ``[r, q, vocab]`` spread back to the whole batch."""
        if self.active is None:
            return output
        logits = output["logits"]
        full = logits.new_zeros(self.batch, *logits.shape[1:])
        full.index_copy_(0, self.active.to(logits.device), logits)
        output["logits"] = full
        return output

    def _retire(self, cache: BoundedCache) -> None:
        active = self.active if self.active is not None else torch.arange(self.batch, device=self.done.device)
        finished = self.done.index_select(0, active).tolist()  # the check's one host read
        stay = max(0, self.min_rows - finished.count(False))  # finished rows that stay to keep min_rows
        keep = []
        for i, done in enumerate(finished):
            if done and stay:
                stay -= 1
            elif done:
                continue
            keep.append(i)
        if len(keep) in (len(finished), 0):  # nothing leaves, or the last rows end with generate
            return
        keep = torch.tensor(keep, device=active.device)  # places among the rows the cache holds now
        cache.batch_select_indices(keep)
        self.retired += active.numel() - keep.numel()
        self.active = active.index_select(0, keep)


def _per_row(value: Any, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch
