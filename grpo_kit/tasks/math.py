"""Final answers checked with math-verify, on any dataset with a final-answer column.

math-verify (HF) parses a completion's final answer (``\\boxed{}``, LaTeX, fractions, plain
numbers) and compares it with the gold symbolically. Its own timeouts use ``SIGALRM``, which works
only in a main thread, while Dask runs tasks in worker threads: here they are turned off
(``parsing_timeout=None``, ``timeout_seconds=None``) and the time is bounded at process level
instead. :class:`Verifier` keeps one child process (``python -c``, started with
:class:`subprocess.Popen`: no fork of a threaded process, and allowed in a daemonic Dask worker,
where ``multiprocessing`` children are not) that answers one JSON line per check; a check that runs
past ``timeout_s`` gets the child killed (SIGKILL) and scores 0 with the reason, and the next check
starts a new child (about a second, for the imports).

GSM8K's ``#### <n>`` marker is read as a final-answer mark like ``\\boxed{}``: when a completion has
one, math-verify gets the rest of that line (the first marker, as :mod:`grpo_kit.reward` reads it),
unless that line starts with a number whose commas are not thousands separators (``1,2,3``,
``1,2345``), which scores 0 as in :mod:`grpo_kit.reward` (math-verify would read 1.2 and 1234).
A gold may be a number string (GSM8K's), a ``\\boxed{}`` solution or bare LaTeX.

The default source is GSM8K at ``../shared/data/gsm8k`` (train for training, test held out), since
no copy of MATH is on these machines; any JSONL/parquet/CSV file, row list or hub id with a
question and a final-answer column works (:func:`task`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .. import data
from ..reward import MARKER, RewardResult, stray_commas, unreadable_number
from ..sandbox import readable
from .base import Task, text_of

DEFAULT_SOURCE = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
"""GSM8K beside the project (``../shared/data/gsm8k``); the hub's ``openai/gsm8k`` where it is absent."""
INSTRUCTION = "Put the final answer in \\boxed{}."
MAX_CHARS = 100_000
"""Completions longer than this are rejected unread, as by :func:`grpo_kit.reward.gsm8k_reward`."""

# The child: one JSON request a line on stdin, one JSON answer a line on the original stdout (math-verify
# and sympy may print; their output goes to stderr). Gold parses are cached: a group shares its gold.
_SERVER = r'''
import json, os, sys, functools, logging, resource
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway sympy number raises MemoryError, answered as an error
out = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
logging.disable(logging.WARNING)
from math_verify import parse, verify
@functools.lru_cache(maxsize=4096)
def gold_parse(g):
    return parse(g, parsing_timeout=None)
print(json.dumps({"ready": True}), file=out)
for line in sys.stdin:
    req = json.loads(line)
    try:
        g = gold_parse(req["gold"])
        p = parse(req["pred"], parsing_timeout=None)
        ok = bool(g) and bool(p) and verify(g, p, timeout_seconds=None)
        try:  # a number only from math-verify's sympy answer: its text fallback is what it could not read,
            value = float(p[0]) if p and not isinstance(p[0], str) else None  # and float() reads "１８"
        except Exception:
            value = None
        ans = {"ok": ok, "pred": str(p[-1]) if p else None, "value": value, "gold": str(g[-1]) if g else None}
    except Exception as e:
        ans = {"ok": False, "error": ("%s: %s" % (type(e).__name__, e))[:200]}
    print(json.dumps(ans), file=out)
'''


class Verifier:
    """A math-verify child process, reused across calls and restarted after a timeout. Thread-safe
    (calls are serialized); one per process through :func:`verifier`."""

    def __init__(self, start_timeout_s: float = 120.0):
        self.start_timeout_s = start_timeout_s
        self.starts = 0
        """Children started so far (more than one: restarted after a timeout or a crash)."""
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._lock = threading.Lock()

    def _start(self) -> None:
        self.starts += 1
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
        self._buf = b""
        if self._readline(time.monotonic() + self.start_timeout_s) is None:
            self.close()
            raise RuntimeError(f"math-verify child did not start within {self.start_timeout_s:g} s (is math-verify installed?)")

    def _readline(self, deadline: float) -> dict | None:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not readable([fd], left):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, 9)
            except ProcessLookupError:
                pass
            self._proc.wait()
            self._proc = None

    def check(self, pred: str, gold: str, timeout_s: float = 5.0) -> dict:
        """``{"ok", "pred", "value", "gold"}`` or ``{"ok": False, "error": ...}`` (``"timed out"`` past ``timeout_s``)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write((json.dumps({"pred": pred, "gold": gold}) + "\n").encode())
                self._proc.stdin.flush()
            except BrokenPipeError:
                self.close()
                return {"ok": False, "error": "math-verify child died"}
            ans = self._readline(time.monotonic() + timeout_s)
            if ans is None:
                died = self._proc.poll() is not None
                self.close()
                return {"ok": False, "error": "math-verify child died" if died else f"timed out after {timeout_s:g} s"}
            return ans


@functools.cache
def verifier() -> Verifier:
    """This process's :class:`Verifier` (one per Dask worker process)."""
    return Verifier()


_HEADING = re.compile(r"[^\W\d_]{2,}")
"""A word at the start of a ``####`` line's text: a Markdown heading, not an answer."""


def marker_at(text: str) -> int:
    """Where the answer marker is: the first ``####`` whose line goes on with an answer (anything but
    a word of two letters or more after spaces and Markdown marks: ``x + 1`` is an answer), or -1. A
    Markdown heading (``#### Step 1: ...``, ``#### Solution``) is not a marker: chat models write
    them, and the ``\\boxed{}`` answer the instruction asks for would otherwise be replaced by the
    heading's text.

    >>> marker_at("#### Step 1\\n5 + 13 = 18\\n#### 18"), marker_at("#### Solution\\n\\\\boxed{18}")
    (24, -1)
    """
    at = text.find(MARKER)
    while at >= 0:
        rest = text[at + len(MARKER):].split("\n", 1)[0].strip().lstrip("*`_").lstrip()
        if rest and _HEADING.match(rest) is None:
            return at
        at = text.find(MARKER, at + len(MARKER))
    return -1


def final_answer(text: str) -> str:
    """What math-verify reads: the rest of the line after the answer marker (:func:`marker_at`) when
    there is one, else ``text``.

    >>> final_answer("48 + 24 = 72\\n#### 72\\nQuestion: ...")
    '72'
    >>> final_answer("so the answer is $\\\\frac{1}{2}$")
    'so the answer is $\\\\frac{1}{2}$'
    """
    at = marker_at(text)
    if at < 0:
        return text
    return text[at + len(MARKER):].lstrip().split("\n", 1)[0].strip().strip("*`")


_LAST_NUMBER = re.compile(r"\d[\d.,]*\s*\S?")


def read_span(text: str) -> str:
    """Where math-verify finds the answer of a completion without a ``####`` line, for the unreadable-
    character check: the last ``\\boxed{...}``, else the last ``$...$``, else the last number with the
    character after it (so ``m²`` or ``½`` elsewhere in the reasoning does not void a right answer,
    while ``18½`` and ``18 ½`` in the answer do).

    >>> [read_span(t) for t in ("x² = 81 so x = \\\\boxed{9}.", "½ of 36 is $18$", "she has 18 ½ cups", "9 m² in all")]
    ['\\\\boxed{9}', '$18$', '18 ½', '9 m']
    """
    at = text.rfind("\\boxed")
    if at >= 0:
        depth, i = 0, text.find("{", at)
        for j in range(max(i, at), len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0 and j >= i >= 0:
                return text[at: j + 1]
        return text[at:]
    dollars = [i for i, ch in enumerate(text) if ch == "$"]
    if len(dollars) >= 2:
        return text[dollars[-2]: dollars[-1] + 1]
    numbers = list(_LAST_NUMBER.finditer(text))
    return numbers[-1].group() if numbers else ""


def answer_spans(text: str) -> str:
    """What the unreadable-character check reads in a completion without a marker: :func:`read_span`,
    or, where the text has a ``$`` and no ``\\boxed``, every number with the character after it
    (dollar amounts make the last ``$...$`` a span between two of them, and math-verify then reads
    the answer from anywhere: ``18½`` was read as 18 with ``$2 and $3`` elsewhere in the text).

    >>> answer_spans("She pays $2 and $3, so the answer is 18½."), answer_spans("½ of 36 is 18, so \\\\boxed{18}")
    ('2 a 3, s 18½', '\\\\boxed{18}')
    """
    if "$" in text and "\\boxed" not in text:
        return " ".join(m.group() for m in _LAST_NUMBER.finditer(text))
    return read_span(text)


def _gold_text(gold: str) -> str:
    g = final_answer(str(gold)).strip()
    # A bare answer ("1000", "\\frac{1}{2}", "(1, 2)"): math-verify reads all of it as LaTeX only between
    # delimiters; without them it would take the last number of "1+x".
    if "\\boxed" not in g and "$" not in g:
        g = f"${g}$"
    return g


_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
"""A word (two letters or more, not a LaTeX command's name): "72 dollars" is read as math-verify
reads text, its last number; "2^{5}", "x = 5" or "(1, 2)" are read whole between ``$`` delimiters."""
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def _as_float(v) -> float | None:
    return v if isinstance(v, float) and math.isfinite(v) else None


BATCH_TIMEOUT_S = 45.0
"""Default ``batch_timeout_s`` of :func:`math_reward`: checks run one after another (one verifier), so a
batch of slow answers would otherwise pass the scorer's 60 s bound and score 0 whole."""


def math_reward(prompts: Sequence[str], completions: Sequence[str], gold: Sequence[str], timeout_s: float = 5.0,
                batch_timeout_s: float | None = BATCH_TIMEOUT_S, **_) -> list[RewardResult]:
    """1.0 when math-verify finds the completion's final answer equal to the gold, else 0.0 with the
    reason (TRL's signature). Each check is bounded by ``timeout_s`` (see :class:`Verifier`); a
    completion not checked within ``batch_timeout_s`` of the call is not checked: its score is None
    ("not run", unscorable unless another reward scores it), so the call returns within about
    ``batch_timeout_s + timeout_s`` plus a restart, inside the scorer's per-batch bound (60 s).

    >>> [r.score for r in math_reward(["q"] * 3, ["so \\\\boxed{\\\\frac{1}{2}}", "#### 0.5", "it is 2"], ["0.5"] * 3)]
    [1.0, 1.0, 0.0]
    """
    v = verifier()
    out = []
    deadline = None if batch_timeout_s is None else time.monotonic() + batch_timeout_s
    for c, g in zip(completions, gold, strict=True):
        c = text_of(c)  # TRL's conversational form too; anything else raises TypeError
        if deadline is not None and time.monotonic() > deadline:
            out.append(RewardResult(None, None, f"not run: the batch's {batch_timeout_s:g} s (batch_timeout_s) ran out"))
            continue
        if len(c) > MAX_CHARS:
            out.append(RewardResult(0.0, None, f"input too long ({len(c)} chars > {MAX_CHARS})"))
            continue
        if not c.strip():
            out.append(RewardResult(0.0, None, "empty completion"))
            continue
        pred, marked = final_answer(c), marker_at(c) >= 0
        if unreadable_number(pred if marked else answer_spans(c)):
            out.append(RewardResult(0.0, None, f"unreadable number in the answer: {pred[:20]!r}"))
            continue
        if marked and stray_commas(pred):  # "#### 1,2345": math-verify would read 1234
            out.append(RewardResult(0.0, None, f"malformed number after {MARKER!r}: {pred[:20]!r}"))
            continue
        bare = pred.replace("\\boxed", " ").replace("$", " ")  # "#### 12 or \\boxed{13}" hedges too
        if marked and _WORD.search(bare) and len(_NUMBER.findall(bare)) > 1:
            # "#### 12 or 13": math-verify would read the last
            out.append(RewardResult(0.0, None, f"more than one number among words after {MARKER!r}: {pred[:40]!r}"))
            continue
        if marked and "\\boxed" not in pred and "$" not in pred and not _WORD.search(pred):
            pred = f"${pred}$"  # a bare expression, read whole as the gold is ("2^{5}" is 32, not 2)
        ans = v.check(pred, _gold_text(g), timeout_s)
        parsed = _as_float(ans.get("value"))
        if parsed is None and ans.get("pred") is not None:  # a symbolic answer ("x + 1", an interval): its
            parsed = ans["pred"]  # text as math-verify writes it votes in maj@k (None would abstain)
        if "error" in ans:
            out.append(RewardResult(0.0, None, f"math-verify: {ans['error']}"))
        elif ans["pred"] is None:
            out.append(RewardResult(0.0, None, "no final answer found", "math-verify"))
        elif ans["ok"]:
            out.append(RewardResult(1.0, parsed, "correct", "math-verify", True, True))
        else:
            out.append(RewardResult(0.0, parsed, f"wrong answer {ans['pred']} != {ans['gold']}", "math-verify"))
    return out


def task(source: str | Path | None = None, question: str = "question", answer: str = "answer",
         heldout_fraction: float = 0.1, timeout_s: float = 5.0, instruction: str = INSTRUCTION) -> Task:
    """Math answers checked by math-verify.

    ``source``: None for GSM8K (``../shared/data/gsm8k``, else the hub's ``openai/gsm8k``), or a
    GSM8K-layout directory (``train.jsonl``/``test.jsonl``), or any rows
    :func:`grpo_kit.tasks.rows.load_rows` reads, with ``question`` and ``answer`` naming the columns;
    the answer column holds a final answer, a ``\\boxed{}`` solution or a solution ending in ``#### <n>``.
    Rows from one file are split by hashing the question (``heldout_fraction`` held out).
    """
    src = source if source is not None else (DEFAULT_SOURCE if DEFAULT_SOURCE.is_dir() else data.GSM8K_HUB_ID)

    def problems(split: str, n: int, seed: int) -> list[data.Problem]:
        if src == data.GSM8K_HUB_ID or Path(src).is_dir():
            return list(data.load_gsm8k(str(src), "test" if split == "heldout" else "train", limit=n))
        from .rows import in_heldout, load_rows

        out = []
        for i, row in enumerate(load_rows(src)):
            for col in (question, answer):
                if col not in row:
                    raise KeyError(f"{src}: no column {col!r} (columns: {sorted(row)})")
            if in_heldout(str(row[question]).strip(), heldout_fraction) == (split == "heldout"):
                out.append(data.Problem(id=f"math-{i}", question=str(row[question]), gold=final_answer(str(row[answer])),
                                        solution=str(row[answer])))
            if len(out) >= n:
                break
        return out

    reward = functools.partial(math_reward, timeout_s=timeout_s)
    return Task("math", problems, [reward], names=["math_verify"], instruction=instruction)
