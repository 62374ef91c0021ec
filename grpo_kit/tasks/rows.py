"""Your own task from rows: a list of dicts, a ``datasets.Dataset``, a local JSONL/JSON/parquet/CSV
file or a hub id, with TRL-style reward functions. A TRL dataset needs no mapping: its ``prompt``
column holds text (TRL's standard format) or a conversation (its conversational format: a list of
``{"role", "content"}`` messages, a system message included), and every other column reaches the
rewards by name. A text prompt is sent as TRL sends it (as it is) under ``chat_template="raw"``;
the default ``"auto"`` puts it in the model's chat template (:mod:`grpo_kit.prompts`). Other rows name their question and gold columns (``question=``, ``gold=``)."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..data import Problem, check_messages
from .base import RewardFn, Task

_FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(source: Any, split: str = "train") -> list[dict]:
    """Rows as dicts from a list of dicts, a ``datasets.Dataset``, a file path or a hub id."""
    if isinstance(source, Mapping):  # a DatasetDict is a dict of splits
        raise TypeError("rows must be a sequence of dicts, a datasets.Dataset, a file path or a hub id, not one dict"
                        + (f" (a DatasetDict: pick a split, e.g. ds[{next(iter(source))!r}])"
                           if type(source).__name__ == "DatasetDict" and source else ""))
    if type(source).__name__ == "DataFrame":  # iterating a DataFrame gives its column names
        raise TypeError("rows must be a sequence of dicts, not a pandas DataFrame: pass df.to_dict('records') "
                        "or datasets.Dataset.from_pandas(df)")
    if isinstance(source, str | Path):
        import datasets

        path = Path(source).expanduser()
        if path.exists():
            kind = _FILE_KINDS.get(path.suffix)
            if kind is None:
                raise ValueError(f"{path}: expected one of {sorted(_FILE_KINDS)}")
            source = datasets.load_dataset(kind, data_files=str(path), split="train")
        elif "/" in str(source) and not str(source).startswith((".", "/")):
            source = datasets.load_dataset(str(source), split=split)
        else:
            raise FileNotFoundError(f"{source!r} is neither an existing file nor a hub id ('owner/name')")
    rows = list(source)
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, Mapping)), None)
    if bad is not None:
        raise TypeError(f"rows must be dicts: row {bad} is a {type(rows[bad]).__name__} ({rows[bad]!r:.60})")
    return [dict(r) for r in rows]


def in_heldout(key: str, fraction: float) -> bool:
    """Whether the row of ``key`` (its question, stripped) falls into the held-out ``fraction``: a
    hash of it decides, so the split is the same in every process and on every re-load."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def from_rows(
    rows: Any,
    rewards: Sequence[RewardFn] | RewardFn,
    *,
    name: str = "custom",
    question: str | None = None,
    gold: str | None = None,
    columns: Sequence[str] | None = None,
    heldout: Any = None,
    heldout_fraction: float = 0.1,
    weights: Sequence[float] | None = None,
    instruction: str = "",
    correct_at: float = 1.0,
    split: str = "train",
) -> Task:
    """A :class:`~grpo_kit.tasks.Task` over your rows.

    ``question`` names the prompt column (None: ``"prompt"``, TRL's name, where the rows have one,
    else ``"question"``). Its values are all text or all conversations (TRL decides by the first
    row; so does this, and a row of the other form is refused): a conversation is a non-empty list
    of messages, each a dict with a ``role`` (system, user, assistant, tool) and a string
    ``content`` (:func:`grpo_kit.data.check_messages`; keys that are None, as Arrow fills in a
    message's missing fields, are dropped), rendered with the chat template as it is; its rewards get
    the conversations as ``prompts`` and completions as ``[{"role": "assistant", "content": ...}]``.
    ``gold`` names the gold answer's column (None: ``"gold"`` where the rows have one, else no gold
    answer); reward functions get it as ``gold``. ``columns`` names the columns passed to them by
    their own names (None: all but the prompt). Held-out problems are ``heldout`` (rows in any form
    ``rows`` takes), or else a deterministic ``heldout_fraction`` of ``rows`` chosen by hashing each prompt.

    >>> t = from_rows([{"q": "Say hi", "a": "hi"}], lambda prompts, completions, **kw: [1.0] * len(completions),
    ...               question="q", gold="a", heldout_fraction=0)
    >>> t.load("train", 5)[0].question, t.load("train", 5)[0].gold
    ('Say hi', 'hi')
    >>> trl = from_rows([{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    ...                   "solution": "4"}], lambda completions, **kw: [0.0] * len(completions), heldout_fraction=0)
    >>> p = trl.load("train", 1)[0]
    >>> p.question, p.conversational, p.columns
    ('2+2?', True, {'solution': '4'})
    """
    if callable(rewards):
        rewards = [rewards]
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    train = _problems(load_rows(rows, split), name, "train", question, gold, columns)
    if heldout is not None:
        held = _problems(load_rows(heldout, "test"), name, "heldout", question, gold, columns)
    else:
        held = [p for p in train if in_heldout(_key(p), heldout_fraction)]
        ids = {p.id for p in held}
        train = [p for p in train if p.id not in ids]
    if not train:
        raise ValueError(f"task {name!r}: no training rows left (heldout_fraction={heldout_fraction})")

    def problems(which: str, n: int, seed: int) -> list[Problem]:
        if which == "heldout":
            if not held:
                raise ValueError(f"task {name!r} has no held-out rows: none of its {len(train)} rows fell into "
                                 f"heldout_fraction={heldout_fraction}; pass heldout= (rows of their own) or a "
                                 "larger heldout_fraction")
            return held[:n]
        pool = list(train)
        random.Random(seed).shuffle(pool)
        return pool[:n]

    return Task(name, problems, list(rewards), weights=weights, instruction=instruction, correct_at=correct_at)


def _key(p: Problem) -> str:
    """What the held-out split hashes: the question (stripped, as every prompt renders it: a review
    found ``"Q"`` and ``"Q\\n"`` in different splits), or the whole conversation."""
    return p.question.strip() if p.messages is None else json.dumps(p.messages, sort_keys=True)


def _conversation(value: Any, where: str) -> list[dict]:
    """A prompt cell as a checked conversation (keys that are None dropped, as Arrow adds them)."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"{where}: expected a list of messages, got {type(value).__name__} {value!r:.60}")
    msgs = [{k: v for k, v in m.items() if v is not None or k in ("role", "content")} if isinstance(m, Mapping) else m
            for m in value]
    try:
        check_messages(msgs)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return msgs


def _problems(rows: list[dict], name: str, split: str, question: str | None, gold: str | None,
              columns: Sequence[str] | None) -> list[Problem]:
    if not rows:
        raise ValueError(f"task {name!r}: no {split} rows")
    have = set(rows[0])
    if question is None and "prompt" not in have and "question" not in have:
        raise KeyError(f"task {name!r} ({split} rows): no 'prompt' column (TRL's) nor 'question'; name the prompt "
                       f"column with question=; the rows have {sorted(have)}")
    if question is None:
        question = "prompt" if "prompt" in have else "question"
    if gold is None and "gold" in have:
        gold = "gold"
    if gold not in (None, "gold") and "gold" in have:  # the rewards' ``gold`` argument is the named column's text
        raise ValueError(f"task {name!r} ({split} rows): gold={gold!r} names the gold answers, but the rows also have "
                         "a column named 'gold', which would not reach the rewards under that name; rename one")
    need = [c for c in (question, gold, *(columns or ())) if c is not None]
    missing = [c for c in need if c not in have]
    if missing:
        raise KeyError(f"task {name!r} ({split} rows): no column {missing[0]!r}; the rows have {sorted(have)}")
    # every other column by its own name, as TRL passes them (the gold column also as ``gold``)
    extra = list(columns) if columns is not None else [c for c in rows[0] if c not in (question, "gold")]
    conversational = isinstance(rows[0].get(question), list | tuple)  # TRL's is_conversational, on the first row
    out = []
    for i, r in enumerate(rows):
        q, where = r.get(question), f"task {name!r} ({split} row {i}): column {question!r}"
        messages = None
        if conversational:
            messages = _conversation(q, where + " (a conversation, as in row 0)")
            q = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        elif isinstance(q, list | tuple):
            raise ValueError(f"{where} holds a conversation but row 0's is text: the rows must all take one form")
        elif not isinstance(q, str) or not q.strip():
            raise ValueError(f"{where} must be a non-empty string or a list of messages, got {q!r:.60}")
        g = None if gold is None else r.get(gold)
        cols = {c: r.get(c) for c in extra}
        if gold == "gold":  # TRL passes the column as it is (4, a list, None); Problem.gold is its text
            cols["gold"] = g
        out.append(Problem(id=f"{name}-{split}-{i}", question=q, gold="" if g is None else str(g),
                           columns=cols, messages=messages))
    return out
