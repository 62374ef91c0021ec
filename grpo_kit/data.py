"""Questions with verifiable answers: GSM8K and a seeded synthetic arithmetic task.

Both produce :class:`Problem` records. :func:`format_prompt` is the plain prompt (the tiny
model's); chat models' prompts come from :mod:`grpo_kit.prompts`. The synthetic task is column addition written as a
short worked trace in GSM8K's answer format::

    Question: What is 347 + 285?        (prompt)
    7+5=12                                (completion: one line per column, units first,
    4+8+1=13                               the carry from the column before added as "+c")
    3+2+1=6
    #### 632

:func:`demonstration` writes such a trace; with ``slip_rate > 0`` it forgets an incoming carry
with that probability (and carries the slip through to a consistently wrong answer). That is how
the tiny profile's base model learns a *habit* that reward can correct: it knows how to carry but
does so only part of the time, so sampled groups disagree and GRPO has signal.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .reward import gold_value

DEFAULT_INSTRUCTION = "Give the final answer as '#### <integer>'."
"""The answer-format instruction (a config field and notebook parameter: ``instruction``)."""
PROMPT_TEMPLATE = "Question: {question}\n{instruction}\nAnswer:\n"
"""The plain (no chat template) prompt; :mod:`grpo_kit.prompts` renders chat models' prompts."""

GSM8K_HUB_ID = "openai/gsm8k"


@dataclass(frozen=True)
class Problem:
    id: str
    """Stable identifier (``gsm8k-train-17``, ``add-347-285``)."""
    question: str
    """The question text, without the template."""
    gold: str
    """The gold answer as a plain number string (commas removed)."""
    solution: str | None = None
    """A reference solution (GSM8K's ends in ``#### <gold>``), when known."""
    columns: dict = field(default_factory=dict, hash=False)
    """The row's other columns (a code problem's ``test`` and ``entry_point``, ...): passed to the
    task's reward functions by name, TRL-style. JSON-serializable values only."""
    messages: list[dict] | None = field(default=None, hash=False)
    """A conversational prompt (TRL's conversational format: ``{"role", "content"}`` messages, a
    system message included), rendered as it is by :mod:`grpo_kit.prompts`; its rewards get the
    conversation as ``prompts`` and each completion as ``[{"role": "assistant", "content": ...}]``.
    ``question`` is then its last user message (ids, samples, held-out hashing). None: a text prompt."""

    def __post_init__(self) -> None:
        if self.messages is not None:
            check_messages(self.messages)

    @property
    def conversational(self) -> bool:
        """Whether the prompt is a conversation (:attr:`messages`), as TRL's ``is_conversational`` decides."""
        return self.messages is not None

    @property
    def prompt(self) -> str:
        return format_prompt(self.question)


ROLES = ("system", "user", "assistant", "tool")
"""The roles a conversational prompt's messages may take."""


def check_messages(messages) -> None:
    """Raise ``ValueError`` unless ``messages`` is a conversational prompt: a non-empty list of
    dicts, each with a ``role`` of :data:`ROLES` and a string ``content``, with a user message whose
    text is not empty.

    >>> check_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])
    >>> check_messages([{"role": "robot", "content": "hi"}])
    Traceback (most recent call last):
    ...
    ValueError: message 0: unknown role 'robot' (expected one of system, user, assistant, tool)
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(f"a conversational prompt must be a non-empty list of messages, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i}: expected a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i}: unknown role {m['role']!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i}: content must be a string (multimodal content blocks are not "
                             f"supported), got {type(m['content']).__name__}")
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise ValueError("a conversational prompt needs a user message; it has roles "
                         f"{[m['role'] for m in messages]}")
    if not users[-1]["content"].strip():
        raise ValueError("the conversation's last user message is empty")


def format_prompt(question: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The plain prompt for one question.

    >>> format_prompt("What is 2 + 2?").splitlines()[0]
    'Question: What is 2 + 2?'
    """
    return PROMPT_TEMPLATE.format(question=question.strip(), instruction=instruction)


# ----------------------------------------------------------------------------- GSM8K

_GOLD_RE = re.compile(r"####\s*(.+?)\s*$")


class MalformedRow(ValueError):
    """A GSM8K row without the fields or the ``#### <number>`` line it must have."""


def parse_gold(answer: str) -> str:
    """The number on a GSM8K answer's ``#### `` line, commas removed.

    >>> parse_gold("Natalia sold 48/2 = 24 clips.\\n#### 1,072")
    '1072'
    """
    last = answer.strip().splitlines()[-1] if answer.strip() else ""
    m = _GOLD_RE.search(last)
    if not m:
        raise MalformedRow("no '#### <number>' line at the end of the answer")
    gold = m.group(1).replace(",", "").replace("$", "").strip()
    try:  # the reward's own reader (float() took "5.", "1e3", "1_000", "nan", which then failed every
        gold_value(gold)  # reward call holding the row: a review, 2026-12-03)
    except (ValueError, TypeError):
        raise MalformedRow(f"'#### {m.group(1)}' is not a number the '####' reward reads") from None
    return gold


def _gsm8k_rows(source: str, split: str) -> Iterator[dict]:
    """Rows of one split from the hub, a directory of JSONL/parquet files or one file."""
    import datasets

    path = Path(source).expanduser()  # "~/gsm8k" is a path (it was sent to the hub)
    if source == GSM8K_HUB_ID or (not path.exists() and "/" in source and not source.startswith((".", "/"))):
        ds = datasets.load_dataset(source, "main", split=split)
    else:
        if path.is_dir():
            # "train.jsonl" or HF shards "train-00000-of-00001.parquet"; not OpenAI's "train_socratic.jsonl"
            # (the same questions again, with other solutions: every problem would count twice)
            files = sorted(p for p in path.iterdir() if re.fullmatch(rf"{split}(-\d+-of-\d+)?", p.stem)
                           and p.suffix in (".jsonl", ".json", ".parquet"))
            if not files:
                raise FileNotFoundError(f"no {split}.jsonl or {split}*.parquet in {path}")
            if len({f.suffix for f in files}) > 1:  # one split in two formats: every row twice, or json read as parquet
                raise ValueError(f"{path} holds the {split} split in more than one format ({[f.name for f in files]}): "
                                 "keep one")
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"GSM8K source {source!r} is neither {GSM8K_HUB_ID!r} nor an existing path")
        kind = "parquet" if files[0].suffix == ".parquet" else "json"
        ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    yield from ds


def load_gsm8k(source: str, split: str = "train", *, skip_malformed: bool = False, limit: int | None = None):
    """GSM8K problems from ``openai/gsm8k`` or local JSONL / parquet files.

    A malformed row raises :class:`MalformedRow` naming the row, or with ``skip_malformed`` is
    skipped; the returned :class:`LoadedProblems` counts what was skipped.
    """
    out, skipped = [], []
    for i, row in enumerate(_gsm8k_rows(source, split)):
        if limit is not None and len(out) >= limit:
            break
        try:
            q, a = row.get("question"), row.get("answer")
            if not isinstance(q, str) or not isinstance(a, str) or not q.strip():
                raise MalformedRow("missing 'question' or 'answer'")
            gold = parse_gold(a)
        except MalformedRow as e:
            if not skip_malformed:
                raise MalformedRow(f"{source} [{split}] row {i}: {e}") from None
            skipped.append(i)
            continue
        out.append(Problem(id=f"gsm8k-{split}-{i}", question=q, gold=gold, solution=a))
    return LoadedProblems(out, skipped)


class LoadedProblems(list):
    """A list of problems that also remembers which rows were skipped as malformed."""

    def __init__(self, problems, skipped=()):
        super().__init__(problems)
        self.skipped = list(skipped)


# ----------------------------------------------------------------------------- synthetic arithmetic


@dataclass(frozen=True)
class AdditionProblem:
    terms: tuple[int, ...]

    @property
    def answer(self) -> int:
        return sum(self.terms)

    def to_problem(self) -> Problem:
        q = "What is " + " + ".join(str(t) for t in self.terms) + "?"
        key = "-".join(str(t) for t in self.terms)
        return Problem(id=f"add-{key}", question=q, gold=str(self.answer), solution=demonstration(self.terms))


def _is_heldout(terms: tuple[int, ...], heldout_mod: int = 10) -> bool:
    """Deterministic split by a hash of the operands: no problem is in both splits."""
    h = hashlib.sha256(",".join(map(str, terms)).encode()).digest()
    return h[0] % heldout_mod == 0


def synthetic_problems(n: int, *, split: str = "train", seed: int = 0, n_digits: int = 3, n_terms: int = 2) -> list[Problem]:
    """``n`` distinct seeded addition problems from one split ("train" or "heldout").

    The splits share no question by construction (a hash of the operands, in order, decides); a held-out
    question's operands in the other order may be a training one (``What is 347 + 285?`` beside
    ``What is 285 + 347?``: a 2026-12-03 review counted 7 of 256 held-out 3-digit questions).

    >>> [p.question for p in synthetic_problems(2, seed=1, n_digits=2)]
    ['What is 80 + 58?', 'What is 60 + 30?']
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    lo, hi = 10 ** (n_digits - 1), 10**n_digits - 1
    space = (hi - lo + 1) ** n_terms
    want_heldout = split == "heldout"
    cap = space // 10 if want_heldout else space - space // 10
    if n > 0.5 * cap:
        raise ValueError(f"asked for {n} distinct {split} problems but only about {cap} exist with n_digits={n_digits}")
    rng = random.Random(f"{seed}-{split}-{n_digits}-{n_terms}")
    seen, out = set(), []
    while len(out) < n:
        terms = tuple(rng.randint(lo, hi) for _ in range(n_terms))
        if terms in seen or _is_heldout(terms) != want_heldout:
            continue
        seen.add(terms)
        out.append(AdditionProblem(terms).to_problem())
    return out


def parse_terms(question: str) -> tuple[int, ...]:
    """The operands of a synthetic question.

    >>> parse_terms("What is 12 + 30?")
    (12, 30)
    """
    m = re.fullmatch(r"What is ([\d +]+)\?", question.strip())
    if not m:
        raise ValueError(f"not a synthetic addition question: {question!r}")
    return tuple(int(t) for t in m.group(1).split("+"))


def demonstration(terms: tuple[int, ...], *, slip_rate: float = 0.0, rng: random.Random | None = None) -> str:
    """A worked column-addition trace ending in ``#### <sum>``.

    With ``slip_rate`` > 0, each incoming carry is forgotten with that probability; the trace
    then stays self-consistent and ends in the wrong total.

    >>> print(demonstration((347, 285)))
    7+5=12
    4+8+1=13
    3+2+1=6
    #### 632
    >>> print(demonstration((347, 285), slip_rate=1.0, rng=random.Random(0)))
    7+5=12
    4+8=12
    3+2=5
    #### 522
    """
    rng = rng or random.Random(0)
    width = max(len(str(t)) for t in terms)
    digits = [str(t).zfill(width) for t in terms]
    lines, written, carry = [], [], 0
    for col in range(width - 1, -1, -1):
        column = [int(d[col]) for d in digits]
        if carry and slip_rate > 0 and rng.random() < slip_rate:
            carry = 0
        total = sum(column) + carry
        lhs = "+".join(str(x) for x in column) + (f"+{carry}" if carry else "")
        lines.append(f"{lhs}={total}")
        if col == 0:
            written.insert(0, str(total))
        else:
            written.insert(0, str(total % 10))
            carry = total // 10
    answer = int("".join(written))
    return "\n".join(lines) + f"\n#### {answer}"
