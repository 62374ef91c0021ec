"""The calculator task (grpo_kit/tasks/calculator.py): its questions, its tool, and its reward, attacked."""

from __future__ import annotations

import json
import time

import pytest

from grpo_kit import config, models, tasks
from grpo_kit.tasks import calculator
from grpo_kit.tools import HermesParser, PlainParser, ToolBox

GOLD = "9716"  # 347 * 28


def _score(completion: str, gold: str = GOLD):
    task = tasks.resolve("calculator")
    return task.scorer().score(["What is 347 * 28?"], [completion], {"gold": [gold]})[0]


# Only the final answer is rewarded: its first '#### <integer>', strictly right. Tools earn nothing.
REWARD_TABLE = [
    ("#### 9716", 1.0),
    ("#### 9,716", 1.0),  # thousands separators are read as such
    ("#### **9716**", 1.0),
    ("#### 9716.0", 1.0),  # compared as numbers
    ("#### 9715", 0.0),
    ("#### -9716", 0.0),
    ("9716", 0.0),  # the right number without the marker: strict, no credit
    ("The answer is 9716.", 0.0),
    ("#### 97,16", 0.0),  # a comma that separates no thousands is rejected, not read as 9716
    ("#### 1,2", 0.0),
    ("#### 9,7,1,6", 0.0),
    ("#### 9716e0", 0.0),
    ("#### 0x25F4", 0.0),  # 9716 in hex: not a decimal integer answer
    ("#### 1 9716", 0.0),  # several numbers: only the first after the marker is graded, so listing cannot hedge
    ("#### 9716 9715 9714", 1.0),  # (and the first one here is right)
    ("#### 9716 \u00bd", 0.0),  # a mixed number with a vulgar fraction is not 9716 (review: it was)
    ("#### 1\n#### 9716", 0.0),  # the first marker is graded, not a later correction
    ("Result: 9716\n", 0.0),  # a tool result pasted without calling and without the marker
    ("Result: 9716\n#### 9716", 1.0),  # ... with the right answer: the answer is what is scored
    ("Result: 9716\n#### 1234", 0.0),  # a faked tool answer does not make a wrong answer right
    ("<call>multiply(347, 28)</call>", 0.0),  # a final turn that still calls the tool has no answer
    ("", 0.0),
    ("#### " + "9" * 200_000, 0.0),  # over the length bound: rejected unread
]


@pytest.mark.parametrize("completion, expected", REWARD_TABLE, ids=[repr(c[:40]) for c, _ in REWARD_TABLE])
def test_reward_table(completion, expected):
    t0 = time.perf_counter()
    s = _score(completion)
    assert time.perf_counter() - t0 < 5.0  # milliseconds; a huge product would take minutes
    assert s.reward == expected
    assert s.correct is (expected == 1.0)  # accuracy is strict correctness


def _call(text: str, parser=None):
    box = ToolBox([calculator.multiply], timeout_s=5.0)
    calls = (parser or PlainParser()).parse(text)
    t0 = time.perf_counter()
    results = box.call_all(calls)
    assert time.perf_counter() - t0 < 5.0  # nothing hangs or grinds through a huge product (the tool's limit is 5 s)
    return results


# (call text, expected content or None, expected error kind)
TOOL_TABLE = [
    ("<call>multiply(347, 28)</call>", "9716", None),
    ("<call>multiply(a=347, b=28)</call>", "9716", None),
    ("<call>multiply(-12, 12)</call>", "-144", None),
    ("<call>multiply(10**18, 2)</call>", None, "malformed"),  # an expression, never evaluated
    ("<call>multiply(10**10**10, 2)</call>", None, "malformed"),
    ("<call>multiply(" + "9" * 5000 + ", 2)</call>", None, "malformed"),  # past Python's int literal bound
    ("<call>multiply(" + "9" * 19 + ", 2)</call>", None, "raised"),  # past the tool's own bound
    ("<call>multiply(0x" + "f" * 100_000 + ", 0x" + "f" * 100_000 + ")</call>", None, "raised"),  # huge, cheap to parse
    ("<call>multiply('347', 28)</call>", None, "raised"),  # not an integer
    ("<call>multiply(3.5, 2)</call>", None, "raised"),
    ("<call>multiply(True, 2)</call>", None, "raised"),
    ("<call>multiply([1, 2], 2)</call>", None, "raised"),
    ("<call>multiply(347)</call>", None, "bad_arguments"),
    ("<call>multiply(1, 2, 3)</call>", None, "bad_arguments"),
    ("<call>multiply(a=1, c=2)</call>", None, "bad_arguments"),
    ("<call>add(347, 28)</call>", None, "unknown_tool"),
    ("<call>__import__('os').system('true')</call>", None, "malformed"),
    ("<call>multiply(347, 28)", None, "malformed"),  # never closed
]


@pytest.mark.parametrize("text, content, error", TOOL_TABLE, ids=[repr(t[:40]) for t, _, _ in TOOL_TABLE])
def test_tool_table(text, content, error):
    (r,) = _call(text)
    assert r.error == error, r.content
    if content is not None:
        assert r.content == content
    else:
        assert "error" in json.loads(r.content)


def test_tool_through_hermes_json_is_bounded_too():
    big = json.dumps({"name": "multiply", "arguments": {"a": int("9" * 4000), "b": 2}})
    (r,) = _call(f"<tool_call>{big}</tool_call>", HermesParser())
    assert r.error == "raised" and "digits" in r.content
    (r,) = _call('<tool_call>{"name": "multiply", "arguments": {"a": 347, "b": 28}}</tool_call>', HermesParser())
    assert (r.error, r.content) == (None, "9716")


def test_multiply_rejects_int_subclasses_and_bounds_before_multiplying():
    class Sneaky(int):
        pass

    with pytest.raises(TypeError):
        calculator.multiply(Sneaky(3), 2)
    with pytest.raises(ValueError):
        calculator.multiply(10**calculator.MAX_OPERAND_DIGITS, 1)
    assert calculator.multiply(10**calculator.MAX_OPERAND_DIGITS - 1, -1) == -(10**calculator.MAX_OPERAND_DIGITS - 1)


def test_questions_are_seeded_disjoint_and_multi_digit():
    train = calculator.problems("train", 400, seed=3)
    assert [p.id for p in train] == [p.id for p in calculator.problems("train", 400, seed=3)]
    held = calculator.problems("heldout", 200, seed=0)
    assert not {p.id for p in train} & {p.id for p in held}
    for p in train + held:
        a, b = p.columns["a"], p.columns["b"]
        assert 100 <= a <= 999 and 10 <= b <= 99 and p.question == f"What is {a} * {b}?" and p.gold == str(a * b)
    assert len({p.id for p in train}) == 400
    with pytest.raises(ValueError):
        calculator.problems("heldout", 100, n_digits=1, factor_digits=1)
    n = calculator.available("train", 2, 1)  # what a caller may ask of a shape, and no more
    assert len(calculator.problems("train", n, n_digits=2, factor_digits=1)) == n
    with pytest.raises(ValueError, match="calculator.available"):
        calculator.problems("train", n + 1, n_digits=2, factor_digits=1)
    # review finding (2026-12-03): the "tool" demo's own 23 * 41 was a held-out question, its answer in its prompt
    assert calculator.is_heldout(23, 41)
    held = calculator.problems("heldout", calculator.available("heldout", 2, 2), n_digits=2, factor_digits=2, demos=["tool"])
    assert "mul-23-41" not in {p.id for p in held} and "mul-41-23" not in {p.id for p in held}
    train = calculator.problems("train", calculator.available("train", 1, 1), n_digits=1, factor_digits=1, demos=["direct"])
    assert not {"mul-7-8", "mul-8-7"} & {p.id for p in train}


def test_registered_and_configured():
    t = tasks.resolve("calculator", n_digits=4, factor_digits=3)
    assert t.multi_turn and [f.__name__ for f in t.tools] == ["multiply"] and t.environment_factory is None
    assert len(t.load("train", 3)[0].columns["a"].__str__()) == 4
    cfg = config.profile("tiny-tools")
    task = tasks.for_config(cfg)
    assert task.name == "calculator" and task.multi_turn
    assert tasks.for_config(cfg.override(n_digits=2)).load("train", 1)[0].columns["a"] < 100  # n_digits from the config
    assert cfg.model.model == "tiny-tools" and cfg.episode.max_turns >= 2


def test_demos_come_before_each_question_as_earlier_turns():
    """``demos``: worked examples as turns of each question's conversation, the same questions drawn;
    the chat rendering shows the call, the tool's answer and the final answers before the question,
    and an episode's completion (what the reward reads) holds none of them."""
    from test_episode import FakeEngine
    from transformers import AutoTokenizer

    from grpo_kit.episode import EpisodeRunner, summary
    from grpo_kit.renderers import ChatRenderer

    smol_tok = AutoTokenizer.from_pretrained(models.resolve_model("smollm2-135m"))

    plain = calculator.problems("train", 5, seed=2, n_digits=2)
    shown = tasks.resolve("calculator", n_digits=2, demos="direct, tool").load("train", 5, 2)
    assert [p.id for p in shown] == [p.id for p in plain] and all(p.messages is None for p in plain)
    for p in shown:
        assert [m["role"] for m in p.messages] == ["user", "assistant", "user", "assistant", "tool", "assistant", "user"]
        assert p.messages[-1]["content"] == p.question and p.question == plain[shown.index(p)].question
    with pytest.raises(ValueError, match="unknown demo 'calc'"):
        tasks.resolve("calculator", demos=["tool", "calc"])
    assert tasks.resolve("calculator", demos="").load("train", 1)[0].messages is None

    task = tasks.resolve("calculator", n_digits=2, demos="tool")
    p = task.load("heldout", 1)[0]
    a, b = p.columns["a"], p.columns["b"]
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
    # the demo holds one tool answer: a second one is the episode's own
    engine = FakeEngine(smol_tok, lambda text, turn: f"#### {a * b}" if text.count("<|im_start|>tool") > 1
                        else f"<tool_call>{call}</tool_call>")
    (ep,) = EpisodeRunner(engine, ChatRenderer(smol_tok), tools=task.tools).run([p], 1)
    prompt = smol_tok.decode(ep.prompt_ids)
    assert prompt.index("What is 23 * 41?") < prompt.index("943") < prompt.index(p.question)
    assert ep.end_reason == "answered" and ep.tool_calls == 1 and not ep.tool_errors
    after = summary(ep)["messages"]  # the completion the rewards get: the episode's own turns, none of the demos'
    assert [m["role"] for m in after] == ["assistant", "tool", "assistant"] and after[1]["content"] == str(a * b)
    score = task.scorer().score_problems([p], [after])[0]
    assert score.correct
