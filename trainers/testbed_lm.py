"""Training the testbed reasoning model (and its weaker helper) from scratch on generated traces.

Recipe: a tiny ``Qwen2ForCausalLM``, weighted next-token
loss (answer value 10, step values 3, operand values 2, answer key 2, structure 1, filler 0.5),
10% pure retrieval drills, short traces first, then long ones; piecewise-cosine learning rate over
stages. Batches are a pure function of ``(seed, global_step)``, so a resumed run continues the
same stream.

Two fine-tuning options start from a trained model (``init_from``):

* ``evict_frac``: that share of the rows is trained under an *eviction-shaped* attention mask
  (:func:`eviction_visibility`): each token sees the question, a random subset of whole earlier
  steps (always the asked one) and its last ``W`` tokens, which is exactly what an evicting cache
  that decides when a token leaves its local window would show it at decode time (RoPE positions
  stay absolute in dynts). The model learns to keep counting steps and to stop on time with most of
  its context gone, so an evictor that keeps the right tokens loses little. ``evict_shapes`` mixes
  other kept-set shapes in (single tokens, values only, windows, attention-ranked subsets, and the
  caches H2O, SnapKV and R-KV would keep, simulated on the model's own attention (and keys);
  :mod:`trainers.eviction_masks`), so the model does not favour one shape of kept set;
  ``evict_lose_asked`` drops the forced asked value from some rows, ``evict_lose_reads`` (chain) the
  forced results later steps read.
* ``slip``: traces write some step values wrong by a fixed rule (``task.SLIPS``): a helper whose
  errors are of capability (arithmetic), not of context.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from data_pipeline.testbed import task
from data_pipeline.testbed.tokenizer import build_tokenizer
from trainers.eviction_masks import (
    MECHANISM_SHAPES,
    SHAPES,
    Visibility,
    add_attention_ranked,
    attention_mask,
    check_shapes,
    draw_kept_set,
    draw_shape,
    eviction_visibility,
    needs_attention,
)
from trainers.layer_head_masks import layer_head_masks
from trainers.schedules import cosine, linear_warmup

TOKEN_ID = {t: i for i, t in enumerate(task.VOCAB)}
ROLE_NAMES = ("prompt", "filler", "structure", "operand", "step_value", "answer_key", "answer_value")


@dataclass
class DataConfig:
    min_think: int = 150
    max_think: int = 900
    short_min: int = 30
    short_max: int = 120
    short_batch: int = 32
    long_batch: int = 16
    length_spread: int = 60
    drill_frac: float = 0.1
    drill_operands: float = 0.0  # share of drill recalls written as chain operands ``rK v`` (task.make_drill)
    short_steps: int = 200
    val_size: int = 64
    early_prob: float = 0.8  # how often the asked key is r1-r3 (training data only)
    slip: str | None = None  # a task.SLIPS rule applied to every training trace
    family: str = "copy"  # the task family of the traces, validation set and gate (task.FAMILIES)
    evict_frac: float = 0.0  # share of trace rows trained under an eviction-shaped mask
    evict_window: tuple[int, int] = (48, 128)  # local window W, drawn per row
    evict_keep: float = 0.5  # each earlier step stays visible with probability U(0, evict_keep)
    evict_shapes: dict[str, float] = field(default_factory=lambda: {"steps": 1.0})  # kept-set shape -> weight
    evict_every: int = 32  # snapkv shape: tokens between two eviction events
    evict_observe: int = 8  # snapkv shape: the observation window (the last queries that vote)
    evict_rkv_lambda: float = 0.1  # rkv shape: lambda of lambda * importance - (1 - lambda) * redundancy (dynts.evictors.rkv's default)
    evict_lose_asked: float = 0.0  # drawn shapes: probability a row does not force-keep the asked key and value
    evict_lose_reads: float = 0.0  # drawn shapes, chain: probability a row does not force-keep the results later steps read

    def __post_init__(self) -> None:
        if self.slip is not None and self.slip not in task.SLIPS:
            raise ValueError(f"data.slip={self.slip!r}: use one of {sorted(task.SLIPS)} or leave it out")
        task.check_family(self.family, "data.family")
        if not 0.0 <= self.drill_operands <= 1.0:
            raise ValueError(f"data.drill_operands={self.drill_operands!r} is a probability in [0, 1] (0 = the copy drill)")
        if not 0.0 <= self.evict_frac <= 1.0 or not 0.0 <= self.evict_keep <= 1.0:
            raise ValueError("data.evict_frac and data.evict_keep are probabilities in [0, 1]")
        self.evict_window = tuple(self.evict_window)  # type: ignore[assignment]
        if len(self.evict_window) != 2 or not 1 <= self.evict_window[0] <= self.evict_window[1]:
            raise ValueError(f"data.evict_window={self.evict_window!r}: give [min, max] with 1 <= min <= max")
        self.evict_shapes = check_shapes(self.evict_shapes)
        for name, what in (("evict_every", "tokens between two snapkv eviction events"), ("evict_observe", "queries in the snapkv observation window")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{name}={value!r}: give an int >= 1 ({what}), e.g. {name}: {type(self).__dataclass_fields__[name].default}")
        lam = self.evict_rkv_lambda
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0.0 <= lam <= 1.0:
            raise ValueError(f"data.evict_rkv_lambda={lam!r}: give a weight in [0, 1] (rkv's importance share), e.g. evict_rkv_lambda: 0.1")
        for name, what in (("evict_lose_asked", "the asked value"), ("evict_lose_reads", "the results later chain steps read")):
            lose = getattr(self, name)
            if isinstance(lose, bool) or not isinstance(lose, (int, float)) or not 0.0 <= lose <= 1.0:
                raise ValueError(f"data.{name}={lose!r}: give a probability in [0, 1] (0 = always force-keep {what}), e.g. {name}: 0.3")


@dataclass
class Stage:
    steps: int
    lr: float
    lr_end: float
    long_frac: float
    early_prob: float | None = None  # overrides data.early_prob during this stage
    drill_frac: float | None = None  # overrides data.drill_frac during this stage
    evict_frac: float | None = None  # overrides data.evict_frac during this stage
    max_think: int | None = None  # overrides data.max_think (long traces) during this stage


@dataclass
class LMConfig:
    name: str = "testbed-lrm"
    seed: int = 0
    run_dir: str = "runs/testbed-lrm"
    export_dir: str = "checkpoints/testbed-lrm"
    init_from: str | None = None  # start from these weights (a bundled name or HF directory)
    model: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    stages: list[Stage] = field(default_factory=list)
    warmup: int = 50
    weight_decay: float = 0.05
    loss_weights: dict[str, float] = field(default_factory=dict)
    val_every: int = 200
    ckpt_every: int = 50
    gate_size: int = 100
    gate_max_new_tokens: int = 1100
    precision: str = "32-true"
    threads: int = 1

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LMConfig":
        d = dict(d)
        d.pop("kind", None)
        d["data"] = DataConfig(**d.get("data", {}))
        d["stages"] = [Stage(**s) for s in d.get("stages", [])]
        return cls(**d)

    @property
    def max_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    @property
    def longest_think(self) -> int:
        """The longest thinking length any stage trains on (the gate's range)."""
        return max([self.data.max_think] + [s.max_think for s in self.stages if s.max_think is not None])


def build_model(model_cfg: dict[str, Any]) -> Qwen2ForCausalLM:
    cfg = dict(
        vocab_size=len(task.VOCAB),
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=TOKEN_ID[task.BOS],
        eos_token_id=TOKEN_ID[task.EOS],
        pad_token_id=TOKEN_ID[task.PAD],
    )
    cfg.update(model_cfg)
    config = Qwen2Config(**cfg)
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config)


def collate(
    rows: list[tuple[list[str], list[int]]],
    weights: dict[int, float],
    visibility: list[Visibility] | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` plus per-target loss weights (``weight[t]`` weighs token t+1);
    with ``visibility`` (one entry per row, None = full causal; see :func:`attention_mask`) also a
    4-D ``attention_mask``."""
    T = max(len(t) for t, _ in rows)
    ids = torch.full((len(rows), T), TOKEN_ID[task.PAD], dtype=torch.long)
    w = torch.zeros(len(rows), T)
    target_roles = torch.full((len(rows), T), -1, dtype=torch.long)
    probe = torch.full((len(rows),), -1, dtype=torch.long)
    for b, (toks, roles) in enumerate(rows):
        ids[b, : len(toks)] = torch.tensor([TOKEN_ID[t] for t in toks])
        w[b, : len(toks) - 1] = torch.tensor([weights.get(r, 0.0) for r in roles[1:]])
        target_roles[b, : len(toks) - 1] = torch.tensor(roles[1:])
        probe[b] = len(roles) - 3  # the answer key; its target is the answer value
    batch = {"input_ids": ids, "weights": w, "probe_pos": probe, "target_roles": target_roles}
    if visibility is not None and any(v is not None for v in visibility):
        batch["attention_mask"] = attention_mask([len(t) for t, _ in rows], T, visibility)
    return batch


def role_weights(named: dict[str, float]) -> dict[int, float]:
    defaults = {"filler": 0.5, "structure": 1.0, "operand": 2.0, "step_value": 3.0, "answer_key": 2.0, "answer_value": 10.0}
    defaults.update(named)
    return {ROLE_NAMES.index(k): v for k, v in defaults.items()}


class TraceStream(IterableDataset):
    """Infinite stream of whole batches; batch ``s`` depends only on ``(seed, s)``."""

    def __init__(self, cfg: LMConfig, start_step: int) -> None:
        self.cfg, self.start_step = cfg, start_step
        self.weights = role_weights(cfg.loss_weights)

    def stage(self, step: int) -> Stage:
        for stage in self.cfg.stages:
            if step < stage.steps:
                return stage
            step -= stage.steps
        return self.cfg.stages[-1]

    def long_frac(self, step: int) -> float:
        return 0.0 if step < self.cfg.data.short_steps else self.stage(step).long_frac

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        d, seed = self.cfg.data, self.cfg.seed
        rng = random.Random(f"batch:{seed}:{step}")
        stage = self.stage(step)
        max_think = d.max_think if stage.max_think is None else stage.max_think
        if rng.random() < self.long_frac(step):
            size, center = d.long_batch, rng.randint(d.min_think, max_think)
            lo, hi = max(d.min_think, center - d.length_spread), min(max_think, center + d.length_spread)
            drill_kw: dict[str, Any] = {"max_gap": max(2, hi // 30)}
        else:
            size, lo, hi = d.short_batch, d.short_min, d.short_max
            drill_kw = {"max_pairs": 8, "max_gap": 4}
        early = d.early_prob if stage.early_prob is None else stage.early_prob
        drill = d.drill_frac if stage.drill_frac is None else stage.drill_frac
        evict = d.evict_frac if stage.evict_frac is None else stage.evict_frac
        rows: list[tuple[list[str], list[int]]] = []
        visibility: list[Visibility] = []
        ranked: list[tuple[int, float, torch.Tensor]] = []  # attention-shaped rows: (row, share, candidates)
        mech: list[tuple[int, int, int, int]] = []  # mechanism-shaped rows: (row, kind, C, W)
        shapes, lost = [-1] * size, [False] * size  # per row: index in SHAPES (-1: full context); asked value not forced
        for r in range(size):
            s = f"train:{seed}:{step}:{r}"
            if rng.random() < drill:
                rows.append(task.make_drill(s, operand_share=d.drill_operands, **drill_kw))
                visibility.append(None)
            else:
                p = task.make_problem(s, min_think=lo, max_think=hi, early_prob=early, slip=d.slip, family=d.family)
                rows.append((list(p.tokens), list(p.roles)))
                evicted = evict > 0 and rng.random() < evict
                if not evicted:
                    visibility.append(None)
                    continue
                shape = draw_shape(d.evict_shapes, rng)
                lose = shape not in MECHANISM_SHAPES and d.evict_lose_asked > 0 and rng.random() < d.evict_lose_asked
                lose_reads = shape not in MECHANISM_SHAPES and d.evict_lose_reads > 0 and rng.random() < d.evict_lose_reads
                tokens = rows[-1][0]
                kept, window, share = draw_kept_set(tokens, rng, d.evict_window, d.evict_keep, shape, keep_asked=not lose,
                                                    keep_reads=not lose_reads)
                visibility.append((kept, window))
                shapes[r], lost[r] = SHAPES.index(shape), lose
                end = tokens.index(task.END_THINK) if task.END_THINK in tokens else len(tokens)
                if shape == "attention":
                    candidates = ~kept & (torch.arange(len(tokens)) < end)
                    ranked.append((r, share, candidates))
                elif shape in MECHANISM_SHAPES:  # the placeholder (question + window) is replaced in the step
                    mech.append((r, MECHANISM_SHAPES.index(shape), math.ceil(share * (end - task.QUESTION_TOKENS)), window))
        batch = collate(rows, self.weights, visibility)
        if "attention_mask" in batch:
            batch["evict_shape"], batch["lost_asked"] = torch.tensor(shapes), torch.tensor(lost)
        if ranked or mech:
            batch["lengths"] = torch.tensor([len(t) for t, _ in rows])
        if ranked:
            T = batch["input_ids"].shape[1]
            batch["rank_rows"] = torch.tensor([r for r, _, _ in ranked])
            batch["rank_keep"] = torch.tensor([share for _, share, _ in ranked])
            batch["rank_candidates"] = torch.stack([torch.nn.functional.pad(c, (0, T - len(c))) for *_, c in ranked])
        if mech:
            for i, key in enumerate(("mech_rows", "mech_kind", "mech_count", "mech_window")):
                batch[key] = torch.tensor([m[i] for m in mech])
            batch["mech_every"], batch["mech_observe"] = torch.tensor(d.evict_every), torch.tensor(d.evict_observe)
            if any(MECHANISM_SHAPES[kind] in ("rkv", "rkv-head") for _, kind, _, _ in mech):  # no new key in older configs' batches
                batch["mech_lambda"] = torch.tensor(float(d.evict_rkv_lambda))
        return batch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        step = self.start_step
        while True:
            yield self.batch(step)
            step += 1


class LMData(L.LightningDataModule):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def train_dataloader(self) -> DataLoader:
        start = self.trainer.global_step if self.trainer is not None else 0
        return DataLoader(TraceStream(self.cfg, start), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        d = self.cfg.data
        probs = task.problem_set("val", d.val_size, min_think=d.min_think, max_think=d.max_think, family=d.family)
        probs.sort(key=lambda p: len(p.tokens))
        w = role_weights(self.cfg.loss_weights)
        batches = [collate([(list(p.tokens), list(p.roles)) for p in probs[i : i + 16]], w) for i in range(0, len(probs), 16)]
        return DataLoader(batches, batch_size=None)


class LMModule(L.LightningModule):
    """Weighted next-token training of a tiny Qwen2 on testbed traces."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.save_hyperparameters({"cfg": cfg})
        self.cfg = LMConfig.from_dict(cfg)
        self.model = build_model(self.cfg.model)
        if self.cfg.init_from:
            from dynts.models import resolve_path  # weights only: a bundled name or a directory

            trained = Qwen2ForCausalLM.from_pretrained(resolve_path(self.cfg.init_from), local_files_only=True)
            self.model.load_state_dict(trained.state_dict())  # strict: the model config must match

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weighted loss, the answer-value probe and the operand-copy accuracy (teacher forced)."""
        ids, w = batch["input_ids"], batch["weights"]
        if needs_attention(batch):
            was_training = self.model.training
            self.model.eval()
            add_attention_ranked(self.model, batch)
            self.model.train(was_training)
        mask = batch.get("attention_mask")
        with layer_head_masks(self.model, mask):  # a batch with a per-head row has one mask per (layer, KV head)
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (ce * w[:, :-1]).sum() / w[:, :-1].sum()
        pos = batch["probe_pos"]
        rows = torch.arange(ids.shape[0])
        hit = logits[rows, pos].argmax(-1) == ids[rows, pos + 1]
        operand = batch["target_roles"][:, :-1] == task.ROLE_OPERAND
        copied = (logits.argmax(-1) == ids[:, 1:])[operand].float()
        return loss, hit.float().mean(), copied.mean() if copied.numel() else torch.tensor(float("nan"))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, probe, operand = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/probe", probe)
        self.log("train/operand", operand)
        self.log("train/seq_len", float(batch["input_ids"].shape[1]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, probe, operand = self._loss(batch)
        n = batch["input_ids"].shape[0]
        self.log("val/loss", loss, batch_size=n)
        self.log("val/probe", probe, batch_size=n, prog_bar=True)
        self.log("val/operand", operand, batch_size=n, prog_bar=True)

    def export(self) -> Path:
        return export(self.model, self.cfg.export_dir)

    def gate(self) -> dict[str, float]:
        """Full-cache generation check on ``gate_size`` dev problems up to the longest thinking length any
        stage trains on (the gate: >= 95 % correct)."""
        from trainers.testbed_eval import generate_texts, score

        d = self.cfg.data
        probs = task.problem_set("dev", self.cfg.gate_size, min_think=d.min_think, max_think=self.cfg.longest_think, family=d.family)
        texts = generate_texts(self.model, build_tokenizer(), probs, max_new_tokens=self.cfg.gate_max_new_tokens)
        return {f"gate_{k}": v for k, v in score(probs, texts).items()}

    def configure_optimizers(self) -> dict[str, Any]:
        opt = torch.optim.AdamW(self.model.parameters(), lr=1.0, betas=(0.9, 0.98), weight_decay=self.cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(self.cfg, s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def lr_at(cfg: LMConfig, step: int) -> float:
    """Linear warmup, then one cosine from ``lr`` to ``lr_end`` per stage."""
    scale = linear_warmup(step, cfg.warmup)
    for stage in cfg.stages:
        if step < stage.steps:
            frac = step / max(1, stage.steps)
            return scale * cosine(frac, stage.lr, stage.lr_end)
        step -= stage.steps
    return cfg.stages[-1].lr_end


def export(model: Qwen2ForCausalLM, out_dir: str | Path) -> Path:
    """Save a standard HF directory: safetensors weights, config, generation config, tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=1100,
        bos_token_id=TOKEN_ID[task.BOS], eos_token_id=TOKEN_ID[task.EOS], pad_token_id=TOKEN_ID[task.PAD],
    )
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out
