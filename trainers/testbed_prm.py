"""Training the testbed process reward model (PRM).

Interface of Qwen2.5-Math-PRM: a ``Qwen2ForTokenClassification`` with 2 labels (0 = wrong,
1 = correct); a step's score is ``softmax(logits)[..., 1]`` at its separator token (``;``).
Training traces are reference traces whose steps are corrupted with probability
``corrupt_prob`` (a wrong result digit, or a wrong operand value with the result either kept or
recomputed from the wrong operand); the loss is cross-entropy at the separators only. The backbone
may start from the trained reasoning model (``init_from``), which already copies operands and
does the arithmetic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoModelForCausalLM, Qwen2ForTokenClassification

from data_pipeline.testbed import task
from data_pipeline.testbed.tokenizer import build_tokenizer
from trainers.testbed_lm import TOKEN_ID, LMConfig, build_model

IGNORE = -100


@dataclass
class PRMConfig(LMConfig):
    init_from: str | None = None
    corrupt_prob: float = 0.3
    token_labels: bool = False  # also label xv..";" with "right so far" (dense auxiliary signal)


def corrupt(problem: task.Problem, rng: random.Random, prob: float, token_labels: bool = False) -> tuple[list[str], list[int]]:
    """The problem's text up to ``</think>`` with some steps corrupted, and per-token labels
    (``1``/``0`` at each step's ``;``, ``IGNORE`` elsewhere). With ``token_labels`` every token from
    ``xv`` to ``;`` is labelled "the step is right so far": a dense auxiliary signal for training."""
    toks = list(problem.tokens[: problem.tokens.index(task.END_THINK)])
    labels = [IGNORE] * len(toks)
    for i, t in enumerate(toks):
        if t != task.SEP:
            continue
        s = i - task.STEP_TOKENS + 1  # x xv op y yv gives rK= v ;
        if rng.random() >= prob:
            labels[i] = 1
            continue
        labels[i] = 0
        kind = rng.randrange(3)
        if kind == 0:  # wrong result digit
            toks[s + 7] = str((int(toks[s + 7]) + rng.randint(1, 9)) % 10)
            continue
        j = s + rng.choice((1, 4))  # wrong operand value
        toks[j] = str((int(toks[j]) + rng.randint(1, 9)) % 10)
        if kind == 2:  # result consistent with the wrong operand
            toks[s + 7] = str(task.OPS[toks[s + 2]](int(toks[s + 1]), int(toks[s + 4])))  # type: ignore[operator]
    if token_labels:  # "is the step right so far?" on every token from xv to ";" (a running AND)
        for i, t in enumerate(toks):
            if t == task.SEP:
                s = i - task.STEP_TOKENS + 1
                x, y = problem.operands[task.VARIABLES.index(toks[s])], problem.operands[task.VARIABLES.index(toks[s + 3])]
                ok_x = int(toks[s + 1]) == x
                ok_y = ok_x and int(toks[s + 4]) == y
                ok_v = ok_y and int(toks[s + 7]) == task.OPS[toks[s + 2]](x, y)  # type: ignore[operator]
                for j, ok in zip(range(s + 1, i + 1), [ok_x] * 3 + [ok_y] * 3 + [ok_v] * 2):
                    labels[j] = int(ok)
    return toks, labels


def collate(rows: Sequence[tuple[list[str], list[int]]]) -> dict[str, torch.Tensor]:
    T = max(len(t) for t, _ in rows)
    ids = torch.full((len(rows), T), TOKEN_ID[task.PAD], dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for b, (toks, lab) in enumerate(rows):
        ids[b, : len(toks)] = torch.tensor([TOKEN_ID[t] for t in toks])
        labels[b, : len(toks)] = torch.tensor(lab)
    return {"input_ids": ids, "labels": labels}


class CorruptStream(IterableDataset):
    """Infinite stream of PRM batches; batch ``s`` depends only on ``(seed, s)``."""

    def __init__(self, cfg: PRMConfig, start_step: int) -> None:
        self.cfg, self.start_step = cfg, start_step

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        d = self.cfg.data
        rng = random.Random(f"prm-batch:{self.cfg.seed}:{step}")
        center = rng.randint(d.min_think, d.max_think)
        lo, hi = max(d.min_think, center - d.length_spread), min(d.max_think, center + d.length_spread)
        rows = []
        for r in range(d.long_batch):
            p = task.make_problem(f"train:prm:{self.cfg.seed}:{step}:{r}", min_think=lo, max_think=hi)
            rows.append(corrupt(p, rng, self.cfg.corrupt_prob, self.cfg.token_labels))
        return collate(rows)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        step = self.start_step
        while True:
            yield self.batch(step)
            step += 1


def heldout(name: str, n: int, cfg: PRMConfig) -> list[tuple[list[str], list[int]]]:
    probs = task.problem_set(name, n, min_think=cfg.data.min_think, max_think=cfg.data.max_think)
    return [corrupt(p, random.Random(f"{name}-corrupt:{p.name}"), cfg.corrupt_prob) for p in probs]


class PRMData(L.LightningDataModule):
    def __init__(self, cfg: PRMConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def train_dataloader(self) -> DataLoader:
        start = self.trainer.global_step if self.trainer is not None else 0
        return DataLoader(CorruptStream(self.cfg, start), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        rows = sorted(heldout("val", self.cfg.data.val_size, self.cfg), key=lambda r: len(r[0]))
        return DataLoader([collate(rows[i : i + 16]) for i in range(0, len(rows), 16)], batch_size=None)


def auroc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve (Mann-Whitney U with tie correction)."""
    pairs = sorted(zip(scores, labels))
    ranks = [0.0] * len(pairs)
    i = 0
    while i < len(pairs):
        j = i
        while j + 1 < len(pairs) and pairs[j + 1][0] == pairs[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    pos = sum(1 for _, y in pairs if y == 1)
    neg = len(pairs) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    r_pos = sum(r for r, (_, y) in zip(ranks, pairs) if y == 1)
    return (r_pos - pos * (pos + 1) / 2) / (pos * neg)


@torch.no_grad()
def step_scores(model: Qwen2ForTokenClassification, rows: Sequence[tuple[list[str], list[int]]]) -> tuple[list[float], list[int]]:
    """PRM scores (prob of label 1) at labelled separators, and the labels."""
    model.eval()
    scores: list[float] = []
    labels: list[int] = []
    for i in range(0, len(rows), 16):
        batch = collate(rows[i : i + 16])
        probs = model(input_ids=batch["input_ids"]).logits.float().softmax(-1)[..., 1]
        mask = batch["labels"] != IGNORE
        scores += probs[mask].tolist()
        labels += batch["labels"][mask].tolist()
    return scores, labels


class PRMModule(L.LightningModule):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.save_hyperparameters({"cfg": cfg})
        self.cfg = PRMConfig.from_dict(cfg)
        config = build_model(self.cfg.model).config
        config.num_labels = 2
        config.id2label, config.label2id = {0: "wrong", 1: "correct"}, {"wrong": 0, "correct": 1}
        self.model = Qwen2ForTokenClassification(config)
        if self.cfg.init_from:
            lm = AutoModelForCausalLM.from_pretrained(self.cfg.init_from)
            missing = self.model.model.load_state_dict(lm.model.state_dict())
            assert not missing.missing_keys, missing

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=batch["input_ids"]).logits.float()
        labels = batch["labels"]
        loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE)
        mask = labels != IGNORE
        acc = (logits.argmax(-1)[mask] == labels[mask]).float().mean()
        return loss, acc

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, acc = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", acc)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, acc = self._loss(batch)
        n = batch["input_ids"].shape[0]
        self.log("val/loss", loss, batch_size=n)
        self.log("val/acc", acc, batch_size=n, prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        from trainers.testbed_lm import lr_at

        opt = torch.optim.AdamW(self.model.parameters(), lr=1.0, betas=(0.9, 0.98), weight_decay=self.cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(self.cfg, s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def export(self) -> Path:
        out = Path(self.cfg.export_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        build_tokenizer().save_pretrained(out)
        return out

    def gate(self) -> dict[str, float]:
        """AUROC of correct vs corrupted steps on held-out ("test") traces."""
        scores, labels = step_scores(self.model, heldout("test", self.cfg.gate_size, self.cfg))
        return {"gate_auroc": auroc(scores, labels), "gate_steps": len(labels), "gate_wrong_steps": labels.count(0)}
