"""The synthetic reasoning task of the embedded testbed, in two families.

``copy`` (the default, the committed numbers' task): a question names five operand values and asks
for one step result: ``<bos> a 6 b 6 c 0 d 4 e 8 find r2 <think>``. The thinking trace computes
steps in order, ``x xv op y yv gives rK= v ;`` (``rK=`` is one token, ``v`` the next), with random
filler words between steps (each gap capped). Every operand is a question variable, so a step
reads only the (protected) question. The answer ``</think> r2= v <eos>`` must copy the value
written right after the asked key, often hundreds of tokens back: the only long-range dependency.

``chain`` (``family="chain"``): thinking reads thinking. Same question, vocabulary and 9-token
step, but an operand may be an earlier result, written as its query token and the value copied
from where that result was written: ``r3 7 plus r1 5 gives r5= 2 ;`` (``r3`` is the query token,
``7`` the value written after ``r3=``). The operand-draw rule: in step ``k >= 2`` each operand is,
independently, with probability :data:`CHAIN_REF_PROB` (0.5) an earlier result ``rJ`` with ``J``
uniform on ``1..k-1`` (recency-unbiased, so a dependency spans on average half the trace), else a
question variable (uniform); step 1 reads only the question. The asked key is uniform on the
second half of the steps, ``ceil(n/2)..n`` (``early_prob`` is a copy-family knob), so the asked
result usually depends on a chain of earlier results that the question does not name. The answer
still copies the asked value; ``Problem.critical_positions`` holds the value tokens of the asked
result's *dependency closure* (the asked step, the results its operands name, theirs, ...), in
trace order: the values the answer's chain reads. A slip (``SLIPS``) writes a step value wrong and
later steps copy the value as written, so a slip anywhere in the closure changes the answer.

Everything is word-level; one word is one token (see ``tokenizer.py``). ``family`` is threaded
through :func:`make_problem`, :func:`problem_set`, the parsers and the checker; ``copy`` draws
exactly the problems it drew before families existed (``tests/test_testbed_chain.py`` pins a digest).
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

PAD, UNK, BOS, EOS, THINK, END_THINK, SEP = "<pad>", "<unk>", "<bos>", "<eos>", "<think>", "</think>", ";"
VARIABLES: tuple[str, ...] = ("a", "b", "c", "d", "e")
DIGITS: tuple[str, ...] = tuple(str(i) for i in range(10))
OPS: dict[str, object] = {
    "plus": lambda x, y: (x + y) % 10,
    "minus": lambda x, y: (x - y) % 10,
    "times": lambda x, y: (x * y) % 10,
}
FIND, GIVES = "find", "gives"
MAX_KEY = 24
QUERY_KEYS: tuple[str, ...] = tuple(f"r{k}" for k in range(1, MAX_KEY + 1))
RESULT_KEYS: tuple[str, ...] = tuple(f"r{k}=" for k in range(1, MAX_KEY + 1))
FILLER: tuple[str, ...] = ("wait", "hmm", "let", "me", "check", "so", "ok", "right", "now", "then", "yes", "verify")
STEP_TOKENS = 9  # x xv op y yv gives rK= v ;
KEY_INDEX = 6  # rK= is a step's 7th word, its value the 8th

# Systematic arithmetic slips (training data of a helper whose errors are of capability, not of
# context): ``rule(op, xv, yv, value) -> written value``. ``"times-high"``: a product whose first
# operand is 6 or more is written one too high (13% of steps: 1/3 of the ops x 4/10 of the values);
# ``"times-mid"``: the same from 5 up (17% of steps); ``"times-top"``: from 8 up (7% of steps, the
# chain helper's rule: a slip anywhere in the asked result's closure propagates, and times-high
# changed 27% of the chain answers, times-top 14.5%).
SLIPS: dict[str, object] = {
    "times-high": lambda op, xv, yv, v: (v + 1) % 10 if op == "times" and xv >= 6 else v,
    "times-mid": lambda op, xv, yv, v: (v + 1) % 10 if op == "times" and xv >= 5 else v,
    "times-top": lambda op, xv, yv, v: (v + 1) % 10 if op == "times" and xv >= 8 else v,
}
QUESTION_TOKENS = 14  # <bos> + 10 operand tokens + find rK + <think>

# Task families (see the module docstring); ``copy`` is the default everywhere.
FAMILIES: tuple[str, ...] = ("copy", "chain")
CHAIN_REF_PROB = 0.5  # chain: each operand of step k >= 2 is an earlier result with this probability


def check_family(family: object, where: str = "family") -> str:
    """``family`` if it names a task family, else a ValueError naming ``where`` and the valid values."""
    if family not in FAMILIES:
        raise ValueError(f"{where}={family!r} is not a testbed task family; use one of {list(FAMILIES)}")
    return family  # type: ignore[return-value]

VOCAB: tuple[str, ...] = (
    (PAD, UNK, BOS, EOS, THINK, END_THINK, SEP, FIND, GIVES)
    + VARIABLES + DIGITS + tuple(OPS) + QUERY_KEYS + RESULT_KEYS + FILLER
)

# Loss roles of target tokens (trainers map them to weights).
ROLE_PROMPT, ROLE_FILLER, ROLE_STRUCTURE, ROLE_OPERAND, ROLE_STEP_VALUE = 0, 1, 2, 3, 4
ROLE_ANSWER_KEY, ROLE_ANSWER_VALUE = 5, 6


@dataclass(frozen=True)
class Step:
    """One computed step: ``x xv op y yv gives rK= v ;``. ``x`` and ``y`` are question variables
    (``a``..``e``) or, in the chain family, earlier results' query tokens (``r1``..)."""

    key: int
    x: str
    op: str
    y: str
    value: int


@dataclass(frozen=True)
class Problem:
    """One problem with its reference trace.

    ``tokens`` is the full reference text as words, ``roles`` the loss role of each word and
    ``critical_positions`` the indices (into ``tokens``) of the value tokens the answer depends on:
    copy, the one value the answer copies; chain, the values of the asked result's dependency
    closure (the asked value included), ascending.
    """

    name: str
    operands: tuple[int, ...]
    asked: int
    steps: tuple[Step, ...]
    tokens: tuple[str, ...]
    roles: tuple[int, ...]
    critical_positions: tuple[int, ...]
    family: str = "copy"

    @property
    def question(self) -> str:
        """User-message content, e.g. ``a 6 b 6 c 0 d 4 e 8 find r2``."""
        return " ".join(self.tokens[1 : QUESTION_TOKENS - 1])

    @property
    def prompt(self) -> str:
        """``<bos> {question} <think>``: what the chat template renders."""
        return " ".join(self.tokens[:QUESTION_TOKENS])

    @property
    def trace(self) -> str:
        """The reference thinking text between ``<think>`` and ``</think>``."""
        return " ".join(self.tokens[QUESTION_TOKENS : self.tokens.index(END_THINK)])

    @property
    def text(self) -> str:
        """Full reference text, prompt to ``<eos>``."""
        return " ".join(self.tokens)

    @property
    def answer(self) -> int:
        return self.steps[self.asked - 1].value

    @property
    def thinking_length(self) -> int:
        return self.tokens.index(END_THINK) - QUESTION_TOKENS


def question_tokens(operands: Sequence[int], asked: int) -> list[str]:
    words = [BOS]
    for var, val in zip(VARIABLES, operands):
        words += [var, str(val)]
    return words + [FIND, f"r{asked}", THINK]


def _gaps(rng: random.Random, total: int, n: int, cap: int) -> list[int]:
    """Split ``total`` filler words into ``n`` gaps of at most ``cap`` words each."""
    cap = max(cap, -(-total // n))
    gaps = [0] * n
    open_ = list(range(n))
    for _ in range(total):
        i = rng.randrange(len(open_))
        gaps[open_[i]] += 1
        if gaps[open_[i]] == cap:
            open_.pop(i)
    return gaps


def make_problem(
    seed: int | str,
    min_think: int = 150,
    max_think: int = 900,
    max_gap: int = 40,
    early_prob: float = 0.8,
    name: str | None = None,
    slip: str | None = None,
    family: str = "copy",
) -> Problem:
    """Generate one problem, deterministic in ``(family, seed)``.

    The thinking length is drawn uniformly from ``[min_think, max_think]``; it has
    ``round(L / 37)`` steps (1..24). Filler gaps are capped at ``max_gap`` words, raised only
    when a long target length cannot be met otherwise. ``slip`` (a key of :data:`SLIPS`, training
    data only) makes the trace write some step values wrong, the way a weaker model would; the
    answer copies the value as written and ``Step.value`` holds it too (the random stream, hence
    the problem, is the same as without the slip). ``family``: :data:`FAMILIES` (module
    docstring); a chain problem seeds its own stream (``"chain|{seed}"``), so it shares no draws
    with the copy problem of the same seed, and ignores ``early_prob``. A seed of a final-only
    namespace (``"final:..."``, ``"confirm:..."``: :data:`FINAL_ONLY`) is refused with
    :class:`FinalSetError`: only :func:`problem_set` inside :func:`final_tables` draws those.
    """
    check_family(family)
    if _final_stream(seed if family == "copy" else f"{family}|{seed}"):
        raise FinalSetError(f"make_problem({seed!r}, family={family!r}) draws a problem of a final-only namespace "
                            f"({', '.join(FINAL_ONLY)}); those are drawn only by problem_set inside the final tables "
                            "(dynts eval --final, through the final-set ledger)")
    return _make_problem(seed, min_think, max_think, max_gap, early_prob, name, slip, family)


def _final_stream(stream: int | str) -> bool:
    """Whether ``stream`` (a problem's random seed: ``seed``, or ``"{family}|{seed}"``) is a final-only namespace's."""
    text = str(stream)
    head, _, rest = text.partition("|")
    return namespace(text) in FINAL_ONLY or (head in FAMILIES and namespace(rest) in FINAL_ONLY)


def _make_problem(seed: int | str, min_think: int = 150, max_think: int = 900, max_gap: int = 40,
                  early_prob: float = 0.8, name: str | None = None, slip: str | None = None,
                  family: str = "copy") -> Problem:
    """:func:`make_problem` without its final-only check (``problem_set`` draws the admitted final-only sets here)."""
    if slip is not None and slip not in SLIPS:
        raise ValueError(f"slip={slip!r} is not a known rule; use one of {sorted(SLIPS)} or None")
    rng = random.Random(seed if family == "copy" else f"{family}|{seed}")
    length = rng.randint(min_think, max_think)
    n_steps = min(MAX_KEY, max(1, round(length / 37)))
    operands = tuple(rng.randrange(10) for _ in VARIABLES)
    if family == "chain":
        asked = rng.randint(-(-n_steps // 2), n_steps)
    elif rng.random() < early_prob:
        asked = rng.randint(1, min(3, n_steps))
    else:
        asked = rng.randint(1, n_steps)
    steps: list[Step] = []

    def value_of(name: str) -> int:
        return operands[VARIABLES.index(name)] if name in VARIABLES else steps[int(name[1:]) - 1].value

    def operand(k: int) -> str:
        if family == "chain" and k > 1 and rng.random() < CHAIN_REF_PROB:
            return f"r{rng.randint(1, k - 1)}"
        return rng.choice(VARIABLES)

    for k in range(1, n_steps + 1):
        x, y = operand(k), operand(k)
        op = rng.choice(tuple(OPS))
        xv, yv = value_of(x), value_of(y)
        value = OPS[op](xv, yv)  # type: ignore[operator]
        if slip is not None:
            value = SLIPS[slip](op, xv, yv, value)  # type: ignore[operator]
        steps.append(Step(k, x, op, y, value))
    gaps = _gaps(rng, max(0, length - STEP_TOKENS * n_steps), n_steps + 1, max_gap)

    tokens = question_tokens(operands, asked)
    roles = [ROLE_PROMPT] * len(tokens)
    value_pos: dict[int, int] = {}
    for step, gap in zip(steps, gaps):
        tokens += [rng.choice(FILLER) for _ in range(gap)]
        roles += [ROLE_FILLER] * gap
        xv, yv = value_of(step.x), value_of(step.y)
        tokens += [step.x, str(xv), step.op, step.y, str(yv), GIVES, f"r{step.key}=", str(step.value), SEP]
        roles += [ROLE_STRUCTURE, ROLE_OPERAND, ROLE_STRUCTURE, ROLE_STRUCTURE, ROLE_OPERAND]
        roles += [ROLE_STRUCTURE, ROLE_STRUCTURE, ROLE_STEP_VALUE, ROLE_STRUCTURE]
        value_pos[step.key] = len(tokens) - 2
    critical = sorted(value_pos[k] for k in dependency_closure(steps, asked))
    tokens += [rng.choice(FILLER) for _ in range(gaps[-1])]
    roles += [ROLE_FILLER] * gaps[-1]
    tokens += [END_THINK, f"r{asked}=", str(steps[asked - 1].value), EOS]
    roles += [ROLE_STRUCTURE, ROLE_ANSWER_KEY, ROLE_ANSWER_VALUE, ROLE_STRUCTURE]
    return Problem(
        name=name if name is not None else str(seed),
        operands=operands,
        asked=asked,
        steps=tuple(steps),
        tokens=tuple(tokens),
        roles=tuple(roles),
        critical_positions=tuple(critical),
        family=family,
    )


def dependency_closure(steps: Sequence[Step], asked: int) -> set[int]:
    """Keys of the asked result and of every earlier result it reads, directly or through others
    (a copy problem's closure is ``{asked}``: its operands are question variables)."""
    closure, todo = set(), [asked]
    while todo:
        k = todo.pop()
        if k in closure:
            continue
        closure.add(k)
        todo += [int(n[1:]) for n in (steps[k - 1].x, steps[k - 1].y) if n not in VARIABLES]
    return closure


def make_drill(
    seed: int | str,
    min_pairs: int = 4,
    max_pairs: int = MAX_KEY,
    max_gap: int = 30,
    recalls: tuple[int, int] = (3, 8),
    operand_share: float = 0.0,
) -> tuple[list[str], list[int]]:
    """A pure retrieval drill (training only): shuffled ``rK= v ;`` pairs (random values, not
    trained), then recall queries ``rK= v ;`` that must copy the value written after ``rK=``
    earlier (trained like answers), then the usual answer. Returns ``(tokens, roles)``.

    ``operand_share``: each recall is, with this probability, a chain operand ``rK v`` instead (the
    query token ``rK`` names the result, ``v`` is trained like an operand): the copy a chain step
    makes from an earlier result. At 0 the drill is exactly the one it always was (no extra draws)."""
    if not 0.0 <= operand_share <= 1.0:
        raise ValueError(f"operand_share={operand_share!r} is a probability in [0, 1]")
    rng = random.Random(seed)
    n = rng.randint(min_pairs, max_pairs)
    values = [rng.randrange(10) for _ in range(n)]
    asked = rng.randint(1, n)
    tokens = question_tokens([rng.randrange(10) for _ in VARIABLES], asked)
    roles = [ROLE_PROMPT] * len(tokens)
    order = list(range(n))
    rng.shuffle(order)
    for i in order:
        gap = rng.randint(0, max_gap)
        tokens += [rng.choice(FILLER) for _ in range(gap)] + [f"r{i + 1}=", str(values[i]), SEP]
        roles += [ROLE_FILLER] * gap + [ROLE_FILLER, ROLE_PROMPT, ROLE_FILLER]
    for _ in range(rng.randint(*recalls)):
        i = rng.randrange(n)
        gap = rng.randint(0, 6)
        tokens += [rng.choice(FILLER) for _ in range(gap)]
        roles += [ROLE_FILLER] * gap
        if operand_share > 0 and rng.random() < operand_share:
            tokens += [f"r{i + 1}", str(values[i])]
            roles += [ROLE_FILLER, ROLE_OPERAND]
            continue
        tokens += [f"r{i + 1}=", str(values[i]), SEP]
        roles += [ROLE_FILLER, ROLE_ANSWER_VALUE, ROLE_FILLER]
    tokens += [END_THINK, f"r{asked}=", str(values[asked - 1]), EOS]
    roles += [ROLE_STRUCTURE, ROLE_ANSWER_KEY, ROLE_ANSWER_VALUE, ROLE_STRUCTURE]
    return tokens, roles


# Named sets (``problem_set``'s first argument; a set's namespace is the part before any ``:``):
#   ``dev`` / ``test`` / ``val``  choices, checkpoint selection, validation (problem ``i`` seeded by
#                                 ``"{set}:{i}"``: the same problem whatever the length range is, the
#                                 committed numbers' sets);
#   ``gate``                      the PRM gates and AUROC tools (``GATE``);
#   ``ptest``                     the predictor's held-out metrics and the on-policy retention measure
#                                 (``PREDICTOR_TEST``, eval/analyses/predictor_heldout.py): no epoch,
#                                 recipe or setting is chosen on it;
#   ``confirm``                   final-only (``CONFIRM``): served only inside :func:`final_tables`,
#                                 which only the final-set ledger opens (eval.harness.ledger.final_run);
#   ``final``                     final-only and read once (``FINAL``, :data:`READ_ONCE`): the final
#                                 tables run after the baselines are tuned and the seeds trained; the
#                                 ledger refuses a second run over the same (set, family, length range)
#                                 unless it says why (``--reread``);
#   ``sealed``                    retired (:data:`RETIRED`): refused everywhere, with the reason; its
#                                 committed records stay readable (``--from-records`` draws no problem);
#   ``train...``                  refused: training draws its own ``"train:..."`` seeds.
# ``gate``, ``confirm``, ``final``, ``sealed`` and ``ptest`` seed problem ``i`` by
# ``"{set}:{min_think}-{max_think}:{i}"``, so other length ranges give other problems (``dev``/``test``
# share them across ranges: :func:`shared_questions` measures it). Each family draws its own stream
# (:func:`make_problem`), so every family's sets are disjoint as the copy sets are.
GATE = "gate"
CONFIRM = "confirm"
FINAL = "final"
SEALED = "sealed"
PREDICTOR_TEST = "ptest"
FRESH_NAMESPACES: tuple[str, ...] = (GATE, CONFIRM, FINAL, SEALED, PREDICTOR_TEST)
FINAL_ONLY: tuple[str, ...] = (CONFIRM, FINAL)
READ_ONCE: tuple[str, ...] = (FINAL,)
RETIRED: dict[str, str] = {
    SEALED: (
        "the 'sealed' namespace is retired: its final tables ranked untuned, token-level baselines against "
        "LRMs and predictors trained with one seed each, so it cannot serve as the final read; the final "
        f"tables now read the fresh '{FINAL}' namespace once, after the baselines are "
        f"tuned and the seeds trained (set={FINAL} with --final; reports/final-ledger.jsonl holds the "
        "retirement line). Its committed records stay readable with --from-records, which draws no problem"),
}


class FinalSetError(ValueError):
    """A final-only or retired set was asked for outside what the final-set ledger admits."""


class LedgerHandle:
    """The one key to :func:`final_tables`: the run handle of :func:`eval.harness.ledger.final_run`,
    which writes the run's ledger line. Only that module may define a concrete handle (a subclass
    elsewhere is refused when it is defined) and this base is not instantiable, so the final-only
    sets cannot be opened without the ledger. :meth:`admit` sees every final read before any
    problem is drawn: it records it in the run's line, and refuses a second read of a
    :data:`READ_ONCE` cell."""

    _DOOR_MODULE = "eval.harness.ledger"

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        module = sys.modules.get(cls.__module__)
        spec = getattr(module, "__spec__", None)  # ``python -m eval.harness.ledger`` runs it as __main__
        if LedgerHandle._DOOR_MODULE not in (cls.__module__, getattr(spec, "name", None)):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__}: only {LedgerHandle._DOOR_MODULE} defines the "
                            "final-set ledger's handle (final_run creates it and writes the ledger line)")

    def __new__(cls, *args: Any, **kw: Any) -> "LedgerHandle":
        if cls is LedgerHandle:
            raise TypeError("LedgerHandle is abstract: eval.harness.ledger.final_run creates the handle")
        return super().__new__(cls)

    def admit(self, read: dict[str, Any]) -> None:  # pragma: no cover - the ledger's handle overrides it
        raise NotImplementedError


_FINAL_DOOR: contextvars.ContextVar[LedgerHandle | None] = contextvars.ContextVar("final_tables", default=None)
_NO_DOOR = ("the final-only sets ({sets}) open only through the final-set ledger, which writes the run's line "
            "to reports/final-ledger.jsonl: run the work inside eval.harness.ledger.final_run(command, argv, "
            "enabled=True, methods=...) (what dynts eval/demo/rescue bench/analyze traces --final do)")


@contextlib.contextmanager
def final_tables(handle: LedgerHandle | None = None) -> Iterator[LedgerHandle]:
    """Inside this block (and only there) :func:`problem_set` serves the final-only namespaces
    (:data:`FINAL_ONLY`), each read first passed to ``handle.admit``. ``handle`` must be the
    final-set ledger's run handle (:class:`LedgerHandle`), which only
    :func:`eval.harness.ledger.final_run` creates: entering without it raises :class:`FinalSetError`.
    The commands that produce final tables enter through the ledger on their explicit ``--final``
    (``dynts eval``, ``dynts demo``, ``dynts rescue bench``, ``dynts analyze traces``);
    ``tests/test_namespaces.py`` checks that no other module names this function or a final-only set."""
    if not isinstance(handle, LedgerHandle):
        raise FinalSetError("task.final_tables() refused: " + _NO_DOOR.format(sets=", ".join(FINAL_ONLY)))
    token = _FINAL_DOOR.set(handle)
    try:
        yield handle
    finally:
        _FINAL_DOOR.reset(token)


def namespace(name_or_seed: str | int) -> str:
    """The namespace of a set name: the part before any ``:`` (``"confirm:chain"`` -> ``"confirm"``)."""
    return str(name_or_seed).split(":", 1)[0]


def problem_set(
    name_or_seed: str | int, n: int, min_think: int = 150, max_think: int = 900, family: str = "copy", **kw: object
) -> list[Problem]:
    """``n`` fixed problems; problem ``i`` of set ``s`` is seeded by the string ``"{s}:{i}"``
    (the fresh namespaces, ``gate``, ``confirm``, ``final``, ...: ``"{s}:{min_think}-{max_think}:{i}"``,
    the namespaces above). Problem ``i`` is the same whatever ``n`` is.

    Training draws from the ``"train:..."`` namespace, so named sets stay fresh. ``family``
    (:data:`FAMILIES`) chooses the task; each family's sets are disjoint as the copy sets are (the
    same seeds, each family its own stream: :func:`make_problem`), and the rules above hold per
    family (``confirm`` and ``final`` are final-only in every family, ``sealed`` retired in every family).
    """
    check_family(family)
    if family != "copy":
        kw["family"] = family
    base = str(name_or_seed)
    if base.startswith("train"):
        raise ValueError("the 'train' namespace is reserved for training data")
    space = namespace(base)
    if space in RETIRED:
        raise FinalSetError(f"problem_set({base!r}): {RETIRED[space]}")
    if space in FINAL_ONLY:
        door = _FINAL_DOOR.get()
        if door is None:
            raise FinalSetError(
                f"problem_set({base!r}): the {space!r} namespace is read only by the final tables; "
                f"choose, gate and tune on set=dev, set=test or set={GATE}, or produce a final table with "
                "dynts eval --final / dynts demo --final (through the final-set ledger)")
        door.admit({"set": base, "n": n, "family": family, "min_think": min_think, "max_think": max_think})
    if space in FRESH_NAMESPACES:
        extra = "".join(f",{k}={v}" for k, v in sorted(kw.items()) if k != "family")
        seeds = [f"{base}:{min_think}-{max_think}{extra}:{i}" for i in range(n)]
    else:
        seeds = [f"{base}:{i}" for i in range(n)]
    draw = _make_problem if space in FINAL_ONLY else make_problem  # a final-only set: admitted above
    return [draw(s, min_think=min_think, max_think=max_think, name=s, **kw)  # type: ignore[arg-type]
            for s in seeds]


def shared_questions(problems: Sequence[Problem], others: Sequence[Problem]) -> list[str]:
    """Names of the ``problems`` whose question (operand values and asked key: all a model is
    shown) is also the question of one of ``others``: the overlap of two sets."""
    seen = {(p.operands, p.asked) for p in others}
    return [p.name for p in problems if (p.operands, p.asked) in seen]


# ---------------------------------------------------------------- parsing and checking


def words(text_or_tokens: str | Sequence[str]) -> list[str]:
    return text_or_tokens.split() if isinstance(text_or_tokens, str) else list(text_or_tokens)


def parse_question(question: str | Sequence[str]) -> tuple[tuple[int, ...], int] | None:
    """``(operands, asked)`` from a question (with or without ``<bos>``/``<think>``), else None."""
    w = [t for t in words(question) if t not in (BOS, THINK)]
    if len(w) < 12 or w[10] != FIND:
        return None
    try:
        operands = tuple(int(w[2 * i + 1]) for i in range(5))
    except ValueError:
        return None
    if tuple(w[0:10:2]) != VARIABLES or not w[11].startswith("r") or not w[11][1:].isdigit():
        return None
    return operands, int(w[11][1:])


def parse_answer(text: str | Sequence[str]) -> tuple[int, int] | None:
    """``(key, value)`` from the first ``</think> rK= v`` in ``text``; None if unparsable."""
    w = words(text)
    if END_THINK not in w:
        return None
    i = w.index(END_THINK)
    if i + 2 >= len(w):
        return None
    key, val = w[i + 1], w[i + 2]
    if key not in RESULT_KEYS or val not in DIGITS:
        return None
    return int(key[1:-1]), int(val)


def thinking_words(text: str | Sequence[str]) -> list[str]:
    """The words between ``<think>`` (if present) and ``</think>`` (or the end)."""
    w = words(text)
    start = w.index(THINK) + 1 if THINK in w else 0
    end = w.index(END_THINK) if END_THINK in w[start:] else len(w)
    return w[start:end]


def _operand_names(family: str) -> tuple[str, ...]:
    return VARIABLES if family == "copy" else VARIABLES + QUERY_KEYS


def step_spans(text: str | Sequence[str], family: str = "copy") -> list[tuple[int, tuple[str, int, str, str, int, int, int]]]:
    """Well-formed steps of the thinking of ``text`` with the index (into ``words(text)``) of each
    step's first word: ``[(start, (x, xv, op, y, yv, key, v)), ...]``. Chain steps may name earlier
    results (``r3``) as operands."""
    check_family(family)
    w = words(text)
    begin = w.index(THINK) + 1 if THINK in w else 0
    end = w.index(END_THINK, begin) if END_THINK in w[begin:] else len(w)
    names = _operand_names(family)
    out = []
    for i in range(begin, end - STEP_TOKENS + 1):
        x, xv, op, y, yv, g, k, v, s = w[i : i + STEP_TOKENS]
        if (x in names and y in names and op in OPS and g == GIVES and k in RESULT_KEYS
                and s == SEP and xv in DIGITS and yv in DIGITS and v in DIGITS):
            out.append((i, (x, int(xv), op, y, int(yv), int(k[1:-1]), int(v))))
    return out


def parse_steps(text: str | Sequence[str], family: str = "copy") -> list[tuple[str, int, str, str, int, int, int]]:
    """Well-formed steps ``(x, xv, op, y, yv, key, v)`` in the thinking of ``text`` (chain: ``x``
    and ``y`` may be results' query tokens, ``r3``)."""
    return [step for _, step in step_spans(text, family)]


def _resolve(spans: list[tuple[int, tuple]], index: int, operands: Sequence[int], memo: dict[int, int | None]) -> int | None:
    """The true value of step ``spans[index]`` as the trace wrote it: its operator applied to the
    question's values and to the true values of the results it names, each read from the most
    recent earlier step with that key. None when a named result was never written before it."""
    if index in memo:
        return memo[index]
    x, _xv, op, y, _yv, _k, _v = spans[index][1]
    vals = []
    for name in (x, y):
        if name in VARIABLES:
            vals.append(operands[VARIABLES.index(name)])
            continue
        j = _definition(spans, index, int(name[1:]))
        vals.append(None if j is None else _resolve(spans, j, operands, memo))
    memo[index] = None if None in vals else OPS[op](*vals)  # type: ignore[operator]
    return memo[index]


def _definition(spans: list[tuple[int, tuple]], index: int, key: int) -> int | None:
    """Index of the most recent step before ``spans[index]`` that wrote ``key``, else None."""
    for j in range(index - 1, -1, -1):
        if spans[j][1][5] == key:
            return j
    return None


def _family_of(question: str | Problem, family: str | None) -> str:
    if isinstance(question, Problem):
        if family is not None and family != question.family:
            raise ValueError(f"family={family!r} contradicts the problem's family {question.family!r}")
        return question.family
    return check_family("copy" if family is None else family)


def expected_answer(question: str | Problem, generated_text: str, family: str | None = None) -> int | None:
    """The correct answer for ``generated_text``: the true value of the asked step *as written in
    its own thinking* (copy: op applied to the question's operand values; chain: also to the true
    values of the results it names, recursively, each from the most recent earlier step with that
    key; written operand values are never trusted); for a Problem whose text has no thinking steps,
    the reference answer. None if the asked step is absent (or names a result never written).
    ``family`` defaults to the Problem's, else copy."""
    family = _family_of(question, family)
    if isinstance(question, Problem):
        operands, asked = question.operands, question.asked
    else:
        parsed = parse_question(question)
        if parsed is None:
            return None
        operands, asked = parsed
    spans = step_spans(generated_text, family)
    if not spans and isinstance(question, Problem):
        return question.answer
    for i, (_start, step) in enumerate(spans):
        if step[5] == asked:
            return _resolve(spans, i, operands, {})
    return None


def check_answer(question_or_problem: str | Problem, generated_text: str, family: str | None = None) -> bool:
    """Exact check: the parsed answer names the asked key and carries its correct value
    (:func:`expected_answer`; ``family`` defaults to the Problem's, else copy)."""
    family = _family_of(question_or_problem, family)
    if isinstance(question_or_problem, Problem):
        asked = question_or_problem.asked
    else:
        parsed = parse_question(question_or_problem)
        if parsed is None:
            return False
        asked = parsed[1]
    ans = parse_answer(generated_text)
    if ans is None or ans[0] != asked:
        return False
    return ans[1] == expected_answer(question_or_problem, generated_text, family)


def find_critical_positions(tokens: Sequence[str], asked: int | None = None, family: str = "copy") -> list[int]:
    """Positions (into ``tokens``) of the value token right after each asked ``rK=`` key inside
    the thinking. ``asked`` defaults to the key named in the question part of ``tokens``.

    Chain: also the values of the asked result's dependency closure, read from the well-formed
    steps: each result a closure step names, at its most recent earlier definition (as
    :func:`expected_answer` resolves it), recursively; ascending."""
    check_family(family)
    w = list(tokens)
    if asked is None:
        parsed = parse_question(w[: w.index(THINK) + 1] if THINK in w else w)
        if parsed is None:
            return []
        asked = parsed[1]
    start = w.index(THINK) + 1 if THINK in w else 0
    end = w.index(END_THINK, start) if END_THINK in w[start:] else len(w)
    key = f"r{asked}="
    found = [i + 1 for i in range(start, end - 1) if w[i] == key]
    if family == "copy":
        return found
    spans = step_spans(w, family)
    first = next((i for i, (_s, step) in enumerate(spans) if step[5] == asked), None)
    out, todo, seen = set(found), [] if first is None else [first], set()
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        out.add(spans[i][0] + KEY_INDEX + 1)
        for name in (spans[i][1][0], spans[i][1][3]):
            if name not in VARIABLES:
                j = _definition(spans, i, int(name[1:]))
                if j is not None:
                    todo.append(j)
    return sorted(out)


def read_values(tokens: Sequence[str], family: str = "copy") -> list[int]:
    """Positions of the value tokens some later well-formed step reads (names as an operand, at
    its most recent earlier definition), ascending: what a chain trace needs kept to write its
    own operands. Always empty for copy traces."""
    if check_family(family) == "copy":
        return []
    spans = step_spans(tokens, family)
    out = set()
    for i, (_s, step) in enumerate(spans):
        for name in (step[0], step[3]):
            if name not in VARIABLES:
                j = _definition(spans, i, int(name[1:]))
                if j is not None:
                    out.add(spans[j][0] + KEY_INDEX + 1)
    return sorted(out)


def operand_copies(text: str | Sequence[str], operands: Sequence[int], family: str = "copy") -> list[bool]:
    """Per operand of each well-formed step (two per step, in order): was its value copied right?
    A variable's value must equal the question's; a chain result's, the value *written* at its
    most recent earlier definition (a copy of a wrong value is a right copy; never-written: wrong)."""
    spans = step_spans(text, family)
    out = []
    for i, (_s, (x, xv, _op, y, yv, _k, _v)) in enumerate(spans):
        for name, val in ((x, xv), (y, yv)):
            if name in VARIABLES:
                out.append(operands[VARIABLES.index(name)] == val)
            else:
                j = _definition(spans, i, int(name[1:]))
                out.append(j is not None and spans[j][1][6] == val)
    return out
