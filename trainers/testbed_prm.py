"""Training the testbed process reward model (PRM).

Interface of Qwen2.5-Math-PRM: a ``Qwen2ForTokenClassification`` with 2 labels (0 = wrong,
1 = correct); a step's score is ``softmax(logits)[..., 1]`` at its separator token (``;``).
Training traces are reference traces whose steps are corrupted with probability
``corrupt_prob`` (a wrong result digit, or a wrong operand value with the result either kept or
recomputed from the wrong operand); the loss is cross-entropy at the separators only. The backbone
may start from the trained reasoning model (``init_from``), which already copies operands and
does the arithmetic.

Chain traces (``data.family: chain``) are checked locally, step by step: a step is right when each
written operand value equals the question's value (a variable) or the value *written* at the most
recent earlier definition of the result it names (``r3``), and its value follows from them. A
corrupted result therefore also makes the later steps that copied the original value wrong, so in
chain traces every ``;`` is labelled by this check after the corruption (copy labels and copy
random streams are unchanged).
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
from trainers.testbed_lm import TOKEN_ID, DataConfig, LMConfig, build_model
from trainers.testbed_prm_answers import answer_positions, lrm_answer, weighted_label_loss, with_answer
from trainers.testbed_prm_order import IGNORE, ORDER_KINDS, order_heldout, order_row


@dataclass
class PRMConfig(LMConfig):
    init_from: str | None = None
    corrupt_prob: float = 0.3
    token_labels: bool = False  # also label xv..";" with "right so far" (dense auxiliary signal)
    digit_labels: bool = False  # also label each digit with its local check (operand = question value, v = xv op yv)
    extra_layers: int = 0  # fresh decoder layers on top of the ``init_from`` backbone
    freeze_backbone: bool = False  # train only the fresh layers, the final norm and the head
    prm_short_steps: int = 0  # first steps on short traces (data.short_min..short_max, data.short_batch)
    answer_prob: float = 0.0  # append the answer "</think> rK= v ;" (labelled), corrupted with this probability
    answer_from_step: int = 0  # training steps before this one have no answers
    expect_weight: float = 0.0  # auxiliary: after the first fresh layer, predict the frozen LM's distribution at t-1
    order_prob: float = 0.0  # rows cut after a step that is, half the time, a repeat / skip / rekey (trainers.testbed_prm_order)
    init_prm_from: str | None = None  # start from a trained PRM directory (same architecture): a fine-tune
    traces: dict[str, Any] | None = None  # policy traces with process labels (trainers.testbed_prm_traces.TraceConfig)
    trace_prob: float = 0.0  # each row is a policy trace with this probability (else a corrupted reference trace)
    lrm_answer_prob: float = 0.0  # a reference row is, with this probability, answered as the LRM answers (testbed_prm_answers.lrm_answer)
    answer_weight: float = 1.0  # the loss weight of a row's answer label (every other label weighs 1)

    def __post_init__(self) -> None:
        if not 0.0 <= self.order_prob <= 1.0:
            raise ValueError(f"order_prob={self.order_prob} must be in [0, 1]")
        for name in ("trace_prob", "lrm_answer_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if not self.answer_weight > 0:
            raise ValueError(f"answer_weight={self.answer_weight} must be > 0")
        if self.trace_prob > 0 and not self.traces:
            raise ValueError("trace_prob > 0 needs a traces: block (trainers.testbed_prm_traces.TraceConfig: out_dir, base, helper, ...)")
        if self.init_prm_from and self.init_from:
            raise ValueError("give init_from (an LM backbone) or init_prm_from (a trained PRM to fine-tune), not both")
        if self.init_prm_from and self.expect_weight > 0:
            raise ValueError("expect_weight > 0 trains a fresh probe from init_from's LM head; set expect_weight: 0 "
                             "with init_prm_from (the exported PRM does not carry the probe)")


def corrupt(problem: task.Problem, rng: random.Random, prob: float, token_labels: bool = False,
            digit_labels: bool = False) -> tuple[list[str], list[int]]:
    """The problem's text up to ``</think>`` with some steps corrupted, and per-token labels
    (``1``/``0`` at each step's ``;``, ``IGNORE`` elsewhere). With ``token_labels`` every token from
    ``xv`` to ``;`` is labelled "the step is right so far"; with ``digit_labels`` each digit gets its
    local check (dense auxiliary signals for training; held-out sets label only the ``;``)."""
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
    if problem.family != "copy":  # chain: re-check every step (a corrupted result breaks its readers' copies)
        for i, t in enumerate(toks):
            if t == task.SEP:
                s = i - task.STEP_TOKENS + 1
                x, y = operand_value(problem, toks, s, 0), operand_value(problem, toks, s, 3)
                xv, yv, v = int(toks[s + 1]), int(toks[s + 4]), int(toks[s + 7])
                labels[i] = int(xv == x and yv == y and v == task.OPS[toks[s + 2]](xv, yv))  # type: ignore[operator]
    if digit_labels:  # the local check of each digit: operands against the question, v against xv op yv
        for i, t in enumerate(toks):
            if t == task.SEP:
                s = i - task.STEP_TOKENS + 1
                x, y = operand_value(problem, toks, s, 0), operand_value(problem, toks, s, 3)
                labels[s + 1], labels[s + 4] = int(int(toks[s + 1]) == x), int(int(toks[s + 4]) == y)
                labels[s + 7] = int(int(toks[s + 7]) == task.OPS[toks[s + 2]](int(toks[s + 1]), int(toks[s + 4])))  # type: ignore[operator]
    if token_labels:  # "is the step right so far?" on every token from xv to ";" (a running AND)
        for i, t in enumerate(toks):
            if t == task.SEP:
                s = i - task.STEP_TOKENS + 1
                x, y = operand_value(problem, toks, s, 0), operand_value(problem, toks, s, 3)
                ok_x = int(toks[s + 1]) == x
                ok_y = ok_x and int(toks[s + 4]) == y
                ok_v = ok_y and int(toks[s + 7]) == task.OPS[toks[s + 2]](x, y)  # type: ignore[operator]
                for j, ok in zip(range(s + 1, i + 1), [ok_x] * 3 + [ok_y] * 3 + [ok_v] * 2):
                    labels[j] = int(ok)
    return toks, labels


def operand_value(problem: task.Problem, toks: Sequence[str], start: int, offset: int) -> int | None:
    """What the operand at ``toks[start + offset]`` (a step's ``x`` or ``y``) must copy: the
    question's value of a variable, or (chain) the value written after the most recent ``rJ=``
    before the step; None when ``rJ`` was never written."""
    name = toks[start + offset]
    if name in task.VARIABLES:
        return problem.operands[task.VARIABLES.index(name)]
    key = f"{name}="
    for i in range(start - 1, task.QUESTION_TOKENS - 1, -1):
        if toks[i] == key and i + 1 < start and toks[i + 1] in task.DIGITS:
            return int(toks[i + 1])
    return None


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
        self.traces: list[tuple[list[str], list[int]]] = []
        if cfg.trace_prob > 0:
            from trainers.testbed_prm_traces import load_trace_rows

            self.traces = [(r["tokens"], r["labels"]) for r in load_trace_rows(cfg.traces["out_dir"])]  # type: ignore[index]
            if not self.traces:
                raise ValueError(f"traces.out_dir={cfg.traces['out_dir']!r} holds no traces: generate them first "  # type: ignore[index]
                                 "(python -m eval.rescue.prm_traces --config CONFIG)")

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        d = self.cfg.data
        rng = random.Random(f"prm-batch:{self.cfg.seed}:{step}")
        if step < self.cfg.prm_short_steps:  # warm-up on short traces: many steps per token of compute
            lo, hi, size = d.short_min, d.short_max, d.short_batch
        else:
            center = rng.randint(d.min_think, d.max_think)
            lo, hi, size = max(d.min_think, center - d.length_spread), min(d.max_think, center + d.length_spread), d.long_batch
        rows = []
        for r in range(size):
            if self.traces and step >= self.cfg.prm_short_steps and rng.random() < self.cfg.trace_prob:
                rows.append(self.traces[rng.randrange(len(self.traces))])  # a policy trace, labelled by the oracle
                continue
            p = task.make_problem(f"train:prm:{self.cfg.seed}:{step}:{r}", min_think=lo, max_think=hi, family=d.family)
            if self.cfg.lrm_answer_prob > 0 and rng.random() < self.cfg.lrm_answer_prob:
                rows.append(lrm_answer(p, rng))  # the LRM's kinds of answer, oracle-labelled
                continue
            row = corrupt(p, rng, self.cfg.corrupt_prob, self.cfg.token_labels, self.cfg.digit_labels)
            if self.cfg.order_prob > 0 and rng.random() < self.cfg.order_prob:
                cut = order_row(*row, rng, negative=rng.random() < 0.5, key_labels=self.cfg.digit_labels)
                if cut is not None:
                    rows.append(cut)
                    continue
            if self.cfg.answer_prob > 0 and step >= self.cfg.answer_from_step:
                row = with_answer(p, *row, rng, self.cfg.answer_prob, self.cfg.digit_labels)
            rows.append(row)
        return collate(rows)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        step = self.start_step
        while True:
            yield self.batch(step)
            step += 1


def heldout(name: str, n: int, cfg: PRMConfig) -> list[tuple[list[str], list[int]]]:
    """Reference traces of a fixed problem set, corrupted (and answered, when the config trains on
    answers) as in training, labelled only at the ``;`` s."""
    rows = []
    for p in task.problem_set(name, n, min_think=cfg.data.min_think, max_think=cfg.data.max_think, family=cfg.data.family):
        rng = random.Random(f"{name}-corrupt:{p.name}")
        row = corrupt(p, rng, cfg.corrupt_prob)
        rows.append(with_answer(p, *row, rng, cfg.answer_prob) if cfg.answer_prob > 0 else row)
    return rows


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
    """Area under the ROC curve of ``scores`` for ``labels`` (1 = positive, 0 = negative): the
    Mann-Whitney U statistic with tied scores counted half, by torchmetrics' binary AUROC
    (computed in float32). NaN when one class is missing.

    ``scores`` are probabilities; torchmetrics reads values outside [0, 1] as logits and applies a
    sigmoid, which keeps the order (the AUROC) unless it saturates.
    """
    from torchmetrics.functional.classification import binary_auroc

    target = torch.as_tensor(list(labels), dtype=torch.long)
    if len(target) != len(scores):
        raise ValueError(f"got {len(scores)} scores but {len(target)} labels; give one label per score")
    positives = int((target == 1).sum())
    if positives == 0 or positives == len(target):
        return float("nan")
    return float(binary_auroc(torch.as_tensor(list(scores), dtype=torch.float64), target))


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
        base_layers = build_model(self.cfg.model).config.num_hidden_layers
        config = build_model({**self.cfg.model, "num_hidden_layers": base_layers + self.cfg.extra_layers}).config
        config.num_labels = 2
        config.id2label, config.label2id = {0: "wrong", 1: "correct"}, {"wrong": 0, "correct": 1}
        self.model = Qwen2ForTokenClassification(config)
        self.base_layers = base_layers
        if self.cfg.init_from:
            from dynts.models import resolve_path  # weights only: a bundled name, directory or cached hub id

            lm = AutoModelForCausalLM.from_pretrained(resolve_path(self.cfg.init_from), local_files_only=True)
            loaded = self.model.model.load_state_dict(lm.model.state_dict(), strict=False)
            fresh = tuple(f"layers.{i}." for i in range(base_layers, base_layers + self.cfg.extra_layers))
            assert not loaded.unexpected_keys and all(k.startswith(fresh) for k in loaded.missing_keys), loaded
            # the frozen LM's own output head (final norm + tied embedding) gives the "expected token" target
            self.lm_norm = lm.model.norm.requires_grad_(False)
        if self.cfg.init_prm_from:
            from dynts.models import resolve_path

            prm = Qwen2ForTokenClassification.from_pretrained(resolve_path(self.cfg.init_prm_from), local_files_only=True)
            self.model.load_state_dict(prm.state_dict())  # strict: the config must build the same architecture
        if self.cfg.freeze_backbone:
            frozen = ("embed_tokens.",) + tuple(f"layers.{i}." for i in range(base_layers))
            for name, param in self.model.model.named_parameters():
                if name.startswith(frozen):
                    param.requires_grad_(False)
        if self.cfg.expect_weight > 0:
            if not (self.cfg.init_from and self.cfg.extra_layers and self.cfg.freeze_backbone):
                raise ValueError("expect_weight > 0 needs init_from, extra_layers >= 1 and freeze_backbone: true")
            self.expect_probe = torch.nn.Linear(config.hidden_size, config.vocab_size)

    def _layer_outputs(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Token-classification logits and the outputs of the last frozen and the first fresh layer."""
        seen: dict[int, torch.Tensor] = {}

        def keep(index: int):
            return lambda module, args, out: seen.__setitem__(index, out[0] if isinstance(out, tuple) else out)

        hooks = [self.model.model.layers[i].register_forward_hook(keep(i)) for i in (self.base_layers - 1, self.base_layers)]
        try:
            logits = self.model(input_ids=input_ids).logits.float()
        finally:
            for h in hooks:
                h.remove()
        return logits, seen

    def _expect_loss(self, input_ids: torch.Tensor, seen: dict[int, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy of a probe on the first fresh layer's output at ``t`` against the frozen LM's
        next-token distribution at ``t - 1``: teaches the fresh layers what the LM expected each token
        to be, which the step checks then compare with the token that is there."""
        with torch.no_grad():
            logits = self.lm_norm(seen[self.base_layers - 1]) @ self.model.model.embed_tokens.weight.T
            target = logits.float().softmax(-1)
        pred = self.expect_probe(seen[self.base_layers][:, 1:]).float().log_softmax(-1)
        per_token = -(target[:, :-1] * pred).sum(-1)
        real = (input_ids[:, 1:] != TOKEN_ID[task.PAD]).float()
        return (per_token * real).sum() / real.sum().clamp(min=1)

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        labels = batch["labels"]
        if self.cfg.expect_weight > 0:
            logits, seen = self._layer_outputs(batch["input_ids"])
        else:
            logits = self.model(input_ids=batch["input_ids"]).logits.float()
        if self.cfg.answer_weight != 1.0:
            answers = answer_positions(batch["input_ids"], labels, TOKEN_ID[task.END_THINK], TOKEN_ID[task.SEP])
            loss = weighted_label_loss(logits, labels, 1.0 + (self.cfg.answer_weight - 1.0) * answers.float())
        else:
            loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE)
        mask = labels != IGNORE
        acc = (logits.argmax(-1)[mask] == labels[mask]).float().mean()
        if self.cfg.expect_weight > 0 and self.training:
            expect = self._expect_loss(batch["input_ids"], seen)
            self.log("train/expect", expect)
            loss = loss + self.cfg.expect_weight * expect
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

        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1.0, betas=(0.9, 0.98), weight_decay=self.cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(self.cfg, s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def export(self) -> Path:
        out = Path(self.cfg.export_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        build_tokenizer().save_pretrained(out)
        return out

    def gate(self) -> dict[str, float]:
        """AUROC of correct vs corrupted steps on held-out traces of the gate set (``task.GATE``)."""
        rows = heldout(task.GATE, self.cfg.gate_size, self.cfg)
        scores, labels = step_scores(self.model, rows)
        result = {"gate_auroc": auroc(scores, labels), "gate_steps": len(labels), "gate_wrong_steps": labels.count(0)}
        answers = []  # the same rows labelled only at the answer's ";"
        for toks, labels in rows:
            if task.END_THINK in toks:
                end = toks.index(task.END_THINK)
                answers.append((toks, [IGNORE] * (end + 1) + labels[end + 1 :]))
        if answers:
            scores, labels = step_scores(self.model, answers)
            result.update({"gate_answer_auroc": auroc(scores, labels), "gate_answers": len(labels), "gate_wrong_answers": labels.count(0)})
        if self.cfg.order_prob > 0:  # the held-out step-order negatives
            for kind in ORDER_KINDS:
                rows = order_heldout(task.GATE, self.cfg.gate_size, kind, self.cfg.data.min_think, self.cfg.data.max_think,
                                     self.cfg.data.family)
                scores, labels = step_scores(self.model, rows)
                result[f"gate_{kind}_auroc"] = auroc(scores, labels)
        return result


def step_requests(rows: Sequence[tuple[list[str], list[int]]], tokenizer: Any) -> tuple[list[Any], list[int]]:
    """Held-out corrupted traces as :class:`~dynts.rescue.StepRequest` s (one per labelled step: the
    question as prompt, everything before the step as the committed context, the step from the
    previous ``;`` to its own ``;`` as the candidate) and their labels."""
    from dynts.rescue import StepRequest

    requests, labels = [], []
    for toks, labs in rows:
        ids = [TOKEN_ID[t] for t in toks]
        prompt = task.QUESTION_TOKENS
        previous = prompt
        for j, label in enumerate(labs):
            if label == IGNORE:
                continue
            requests.append(StepRequest(question=" ".join(toks[:prompt]), prompt_ids=ids[:prompt],
                                        steps=[ids[prompt:previous]], candidate=ids[previous : j + 1], tokenizer=tokenizer))
            labels.append(label)
            previous = j + 1
    return requests, labels


def scorer_gate(scorer: Any, n: int, tokenizer: Any, cfg: PRMConfig | None = None) -> dict[str, float]:
    """AUROC of any :class:`~dynts.rescue.StepScorer` on the PRM gate set (held-out traces of ``task.GATE``)."""
    requests, labels = step_requests(heldout(task.GATE, n, cfg or PRMConfig(data=DataConfig(min_think=60, max_think=700))), tokenizer)
    scores = scorer.score(requests)
    return {"gate_auroc": auroc(scores, labels), "gate_steps": len(labels), "gate_wrong_steps": labels.count(0)}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainers.testbed_prm PRM_DIR [--n 200]``: a PRM's held-out AUROC on the training-style
    negatives and on the step-order negatives (:mod:`trainers.testbed_prm_order`), as JSON."""
    import argparse
    import json

    p = argparse.ArgumentParser(description="AUROC of a testbed PRM on training-style and step-order negatives")
    p.add_argument("prm", help="a testbed PRM directory (Qwen2ForTokenClassification)")
    p.add_argument("--n", type=int, default=200, help="held-out problems per negative kind")
    p.add_argument("--family", default="copy", choices=task.FAMILIES, help="the task family of the held-out traces")
    args = p.parse_args(argv)
    model = Qwen2ForTokenClassification.from_pretrained(args.prm).eval()
    cfg = PRMConfig(data=DataConfig(min_think=60, max_think=700, family=args.family), corrupt_prob=0.5, answer_prob=0.5)
    out: dict[str, Any] = {"prm": args.prm}
    scores, labels = step_scores(model, heldout(task.GATE, args.n, cfg))
    out["digits_operands_answers"] = {"auroc": auroc(scores, labels), "steps": len(labels), "negatives": labels.count(0)}
    for kind in ORDER_KINDS:
        scores, labels = step_scores(model, order_heldout(task.GATE, args.n, kind, family=args.family))
        out[kind] = {"auroc": auroc(scores, labels), "steps": len(labels), "negatives": labels.count(0)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
