"""The synthetic reasoning task of the embedded testbed.

A question names five operand values and asks for one step result:
``<bos> a 6 b 6 c 0 d 4 e 8 find r2 <think>``. The thinking trace computes steps in order,
``x xv op y yv gives rK= v ;`` (``rK=`` is one token, ``v`` the next), with random filler words
between steps (each gap capped). The answer ``</think> r2= v <eos>`` must copy the value written
right after the asked key, often hundreds of tokens back: the only long-range dependency.
Everything is word-level; one word is one token (see ``tokenizer.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

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

# Systematic arithmetic slips (training data of a helper whose errors are of capability, not of
# context): ``rule(op, xv, yv, value) -> written value``. ``"times-high"``: a product whose first
# operand is 6 or more is written one too high (13% of steps: 1/3 of the ops x 4/10 of the values);
# ``"times-mid"``: the same from 5 up (17% of steps).
SLIPS: dict[str, object] = {
    "times-high": lambda op, xv, yv, v: (v + 1) % 10 if op == "times" and xv >= 6 else v,
    "times-mid": lambda op, xv, yv, v: (v + 1) % 10 if op == "times" and xv >= 5 else v,
}
QUESTION_TOKENS = 14  # <bos> + 10 operand tokens + find rK + <think>

VOCAB: tuple[str, ...] = (
    (PAD, UNK, BOS, EOS, THINK, END_THINK, SEP, FIND, GIVES)
    + VARIABLES + DIGITS + tuple(OPS) + QUERY_KEYS + RESULT_KEYS + FILLER
)

# Loss roles of target tokens (trainers map them to weights).
ROLE_PROMPT, ROLE_FILLER, ROLE_STRUCTURE, ROLE_OPERAND, ROLE_STEP_VALUE = 0, 1, 2, 3, 4
ROLE_ANSWER_KEY, ROLE_ANSWER_VALUE = 5, 6


@dataclass(frozen=True)
class Step:
    """One computed step: ``x xv op y yv gives rK= v ;``."""

    key: int
    x: str
    op: str
    y: str
    value: int


@dataclass(frozen=True)
class Problem:
    """One problem with its reference trace.

    ``tokens`` is the full reference text as words, ``roles`` the loss role of each word and
    ``critical_positions`` the index (into ``tokens``) of the value token the answer copies.
    """

    name: str
    operands: tuple[int, ...]
    asked: int
    steps: tuple[Step, ...]
    tokens: tuple[str, ...]
    roles: tuple[int, ...]
    critical_positions: tuple[int, ...]

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
) -> Problem:
    """Generate one problem, deterministic in ``seed``.

    The thinking length is drawn uniformly from ``[min_think, max_think]``; it has
    ``round(L / 37)`` steps (1..24). Filler gaps are capped at ``max_gap`` words, raised only
    when a long target length cannot be met otherwise. ``slip`` (a key of :data:`SLIPS`, training
    data only) makes the trace write some step values wrong, the way a weaker model would; the
    answer copies the value as written and ``Step.value`` holds it too (the random stream, hence
    the problem, is the same as without the slip).
    """
    if slip is not None and slip not in SLIPS:
        raise ValueError(f"slip={slip!r} is not a known rule; use one of {sorted(SLIPS)} or None")
    rng = random.Random(seed)
    length = rng.randint(min_think, max_think)
    n_steps = min(MAX_KEY, max(1, round(length / 37)))
    operands = tuple(rng.randrange(10) for _ in VARIABLES)
    if rng.random() < early_prob:
        asked = rng.randint(1, min(3, n_steps))
    else:
        asked = rng.randint(1, n_steps)
    steps = []
    for k in range(1, n_steps + 1):
        x, y = rng.choice(VARIABLES), rng.choice(VARIABLES)
        op = rng.choice(tuple(OPS))
        xv, yv = operands[VARIABLES.index(x)], operands[VARIABLES.index(y)]
        value = OPS[op](xv, yv)  # type: ignore[operator]
        if slip is not None:
            value = SLIPS[slip](op, xv, yv, value)  # type: ignore[operator]
        steps.append(Step(k, x, op, y, value))
    gaps = _gaps(rng, max(0, length - STEP_TOKENS * n_steps), n_steps + 1, max_gap)

    tokens = question_tokens(operands, asked)
    roles = [ROLE_PROMPT] * len(tokens)
    critical: list[int] = []
    for step, gap in zip(steps, gaps):
        tokens += [rng.choice(FILLER) for _ in range(gap)]
        roles += [ROLE_FILLER] * gap
        xv, yv = operands[VARIABLES.index(step.x)], operands[VARIABLES.index(step.y)]
        tokens += [step.x, str(xv), step.op, step.y, str(yv), GIVES, f"r{step.key}=", str(step.value), SEP]
        roles += [ROLE_STRUCTURE, ROLE_OPERAND, ROLE_STRUCTURE, ROLE_STRUCTURE, ROLE_OPERAND]
        roles += [ROLE_STRUCTURE, ROLE_STRUCTURE, ROLE_STEP_VALUE, ROLE_STRUCTURE]
        if step.key == asked:
            critical.append(len(tokens) - 2)
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
    )


def make_drill(
    seed: int | str, min_pairs: int = 4, max_pairs: int = MAX_KEY, max_gap: int = 30, recalls: tuple[int, int] = (3, 8)
) -> tuple[list[str], list[int]]:
    """A pure retrieval drill (training only): shuffled ``rK= v ;`` pairs (random values, not
    trained), then recall queries ``rK= v ;`` that must copy the value written after ``rK=``
    earlier (trained like answers), then the usual answer. Returns ``(tokens, roles)``."""
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
        tokens += [rng.choice(FILLER) for _ in range(gap)] + [f"r{i + 1}=", str(values[i]), SEP]
        roles += [ROLE_FILLER] * gap + [ROLE_FILLER, ROLE_ANSWER_VALUE, ROLE_FILLER]
    tokens += [END_THINK, f"r{asked}=", str(values[asked - 1]), EOS]
    roles += [ROLE_STRUCTURE, ROLE_ANSWER_KEY, ROLE_ANSWER_VALUE, ROLE_STRUCTURE]
    return tokens, roles


# Named sets (``problem_set``'s first argument; a set's namespace is the part before any ``:``):
#   ``dev`` / ``test`` / ``val``  choices, checkpoint selection, validation (problem ``i`` seeded by
#                                 ``"{set}:{i}"``: the same problem whatever the length range is, the
#                                 committed numbers' sets);
#   ``gate``                      the PRM gates and AUROC tools (``GATE``);
#   ``confirm``                   the final tables only (``CONFIRM``): refused outside
#                                 :func:`final_tables`, which only the table commands enter;
#   ``train...``                  refused: training draws its own ``"train:..."`` seeds.
# ``gate`` and ``confirm`` seed problem ``i`` by ``"{set}:{min_think}-{max_think}:{i}"``, so other
# length ranges give other problems (``dev``/``test`` share them across ranges:
# :func:`shared_questions` measures it).
GATE = "gate"
CONFIRM = "confirm"
FRESH_NAMESPACES: tuple[str, ...] = (GATE, CONFIRM)
FINAL_ONLY: tuple[str, ...] = (CONFIRM,)
_FINAL_TABLES: contextvars.ContextVar[bool] = contextvars.ContextVar("final_tables", default=False)


@contextlib.contextmanager
def final_tables() -> Iterator[None]:
    """Inside this block (and only there) :func:`problem_set` serves the ``confirm`` namespace.
    Only the commands that produce final tables enter it, on their explicit ``--final``
    (``dynts eval --final``, ``dynts demo --final``); ``tests/test_namespaces.py`` checks that no
    other module does."""
    token = _FINAL_TABLES.set(True)
    try:
        yield
    finally:
        _FINAL_TABLES.reset(token)


def namespace(name_or_seed: str | int) -> str:
    """The namespace of a set name: the part before any ``:`` (``"confirm:chain"`` -> ``"confirm"``)."""
    return str(name_or_seed).split(":", 1)[0]


def problem_set(name_or_seed: str | int, n: int, min_think: int = 150, max_think: int = 900, **kw: object) -> list[Problem]:
    """``n`` fixed problems; problem ``i`` of set ``s`` is seeded by the string ``"{s}:{i}"``
    (``gate`` and ``confirm``: ``"{s}:{min_think}-{max_think}:{i}"``, the namespaces above).

    Training draws from the ``"train:..."`` namespace, so named sets stay fresh.
    """
    base = str(name_or_seed)
    if base.startswith("train"):
        raise ValueError("the 'train' namespace is reserved for training data")
    space = namespace(base)
    if space in FINAL_ONLY and not _FINAL_TABLES.get():
        raise ValueError(
            f"problem_set({base!r}): the {space!r} namespace is read only by the final tables; "
            f"choose, gate and tune on set=dev, set=test or set={GATE}, or produce a final table with "
            "dynts eval --final / dynts demo --final")
    if space in FRESH_NAMESPACES:
        extra = "".join(f",{k}={v}" for k, v in sorted(kw.items()))
        seeds = [f"{base}:{min_think}-{max_think}{extra}:{i}" for i in range(n)]
    else:
        seeds = [f"{base}:{i}" for i in range(n)]
    return [make_problem(s, min_think=min_think, max_think=max_think, name=s, **kw) for s in seeds]  # type: ignore[arg-type]


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


def parse_steps(text: str | Sequence[str]) -> list[tuple[str, int, str, str, int, int, int]]:
    """Well-formed steps ``(x, xv, op, y, yv, key, v)`` in the thinking of ``text``."""
    w = thinking_words(text)
    out = []
    for i in range(len(w) - STEP_TOKENS + 1):
        x, xv, op, y, yv, g, k, v, s = w[i : i + STEP_TOKENS]
        if (x in VARIABLES and y in VARIABLES and op in OPS and g == GIVES and k in RESULT_KEYS
                and s == SEP and xv in DIGITS and yv in DIGITS and v in DIGITS):
            out.append((x, int(xv), op, y, int(yv), int(k[1:-1]), int(v)))
    return out


def expected_answer(question: str | Problem, generated_text: str) -> int | None:
    """The correct answer for ``generated_text``: the true value of the asked step *as written in
    its own thinking* (op applied to the question's operand values); for a Problem whose text has
    no thinking steps, the reference answer. None if the asked step is absent."""
    if isinstance(question, Problem):
        operands, asked = question.operands, question.asked
    else:
        parsed = parse_question(question)
        if parsed is None:
            return None
        operands, asked = parsed
    steps = parse_steps(generated_text)
    if not steps and isinstance(question, Problem):
        return question.answer
    for x, _xv, op, y, _yv, key, _v in steps:
        if key == asked:
            return OPS[op](operands[VARIABLES.index(x)], operands[VARIABLES.index(y)])  # type: ignore[operator]
    return None


def check_answer(question_or_problem: str | Problem, generated_text: str) -> bool:
    """Exact check: the parsed answer names the asked key and carries its correct value."""
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
    return ans[1] == expected_answer(question_or_problem, generated_text)


def find_critical_positions(tokens: Sequence[str], asked: int | None = None) -> list[int]:
    """Positions (into ``tokens``) of the value token right after each asked ``rK=`` key inside
    the thinking. ``asked`` defaults to the key named in the question part of ``tokens``."""
    w = list(tokens)
    if asked is None:
        parsed = parse_question(w[: w.index(THINK) + 1] if THINK in w else w)
        if parsed is None:
            return []
        asked = parsed[1]
    start = w.index(THINK) + 1 if THINK in w else 0
    end = w.index(END_THINK, start) if END_THINK in w[start:] else len(w)
    key = f"r{asked}="
    return [i + 1 for i in range(start, end - 1) if w[i] == key]

