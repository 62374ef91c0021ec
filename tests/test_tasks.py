"""Tasks as plug-ins: the contract (grpo_kit/tasks/base.py), the registry, rows -> task, and a
notebook-style task and reward run end to end through the Dask loop (real LocalCluster)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import pickle
import time
from fractions import Fraction

import cloudpickle
import pytest
from conftest import GSM8K_DIR

from grpo_kit import config, loop, tasks
from grpo_kit.data import Problem
from grpo_kit.reward import RewardResult
from grpo_kit.tasks import Scorer, Task


def _const(v):
    def reward(prompts, completions, **kw):
        return [v] * len(completions)

    reward.__name__ = f"const_{v}"
    return reward


def _raises(prompts, completions, **kw):
    raise ZeroDivisionError("boom")


def _hangs(prompts, completions, **kw):
    time.sleep(30)
    return [1.0] * len(completions)


def _short(prompts, completions, **kw):
    return [1.0]


def _exits(prompts, completions, **kw):
    raise SystemExit(3)


async def _cancelled(prompts, completions, **kw):
    raise asyncio.CancelledError()


def _by_item(items):
    def reward(prompts, completions, **kw):
        return list(items)

    return reward


def _problems(n=3):
    return [Problem(id=f"p{i}", question=f"q{i}", gold=str(i), columns={"word": f"w{i}"}) for i in range(n)]


# ----------------------------------------------------------------------------- Scorer


def test_gsm8k_reward_leaves_an_unreadable_gold_unscored_not_the_call():
    """Review finding (2026-12-03): one gold the reward cannot read ("5.", a missing gold from rows)
    failed the call, and every completion of the chunk scored 0."""
    from grpo_kit.tasks import gsm8k

    got = gsm8k.hash_reward(["a", "b", "c"], ["#### 72", "#### 5", "#### 3"], ["72", "5.", None])
    assert [r.score for r in got] == [1.0, None, None]
    assert got[1].reason.startswith("unreadable gold") and got[2].reason.startswith("unreadable gold")
    probs = [Problem("a", "Q?", "72"), Problem("b", "Q2?", "5.")]
    scored = gsm8k.task().scorer().score_problems(probs, ["#### 72", "#### 5"])
    assert scored[0].reward == 1.0


def test_from_rows_errors_name_the_bad_input():
    """Review finding (2026-12-03): a list of strings or a DataFrame failed inside dict(); a DatasetDict
    was "not one dict"; whitespace variants of one question landed in both splits; no held-out row
    said "pass heldout_fraction > 0" when it was 0.1."""
    import datasets
    import pandas as pd

    with pytest.raises(TypeError, match="row 0 is a str"):
        tasks.from_rows(["What is 1 + 1?"], _const(1.0))
    with pytest.raises(TypeError, match="not a pandas DataFrame"):
        tasks.from_rows(pd.DataFrame({"prompt": ["a"]}), _const(1.0))
    with pytest.raises(TypeError, match=r"DatasetDict: pick a split, e.g. ds\['train'\]"):
        tasks.from_rows(datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a"}])}), _const(1.0))
    with pytest.raises(ValueError, match="none of its 4 rows fell into heldout_fraction=0.1"):
        tasks.from_rows([{"prompt": f"Q{i}"} for i in range(4) if i != 1] + [{"prompt": "Q9"}], _const(1.0)).load("heldout", 1)
    rows = [{"prompt": f"What is {i} + 15?" + "\n" * k} for i in range(40) for k in (0, 1)]
    t = tasks.from_rows(rows, _const(1.0), heldout_fraction=0.3)
    held = {p.question.strip() for p in t.load("heldout", 100)}
    assert held and held.isdisjoint(p.question.strip() for p in t.load("train", 100))


def test_weighted_components_and_accuracy_from_the_first_reward():
    sc = Scorer([_const(1.0), _const(0.5)], [1.0, 0.2], ["a", "b"])
    out = sc.score_problems(_problems(2), ["x", "y"])
    assert [s.reward for s in out] == [pytest.approx(1.1)] * 2
    assert out[0].components == {"a": 1.0, "b": 0.5}
    assert all(s.correct and s.lenient_correct and s.errors == 0 for s in out)


def test_columns_reach_the_reward_aligned_with_completions():
    seen = {}

    def reward(prompts, completions, gold, word, **kw):
        seen.update(prompts=prompts, gold=gold, word=word)
        return [float(c == w) for c, w in zip(completions, word, strict=True)]

    out = Scorer([reward], [1.0], ["r"]).score_problems(_problems(3), ["w0", "no", "w2"])
    assert seen == {"prompts": ["q0", "q1", "q2"], "gold": ["0", "1", "2"], "word": ["w0", "w1", "w2"]}
    assert [s.reward for s in out] == [1.0, 0.0, 1.0]


def _raises_unprintable(prompts, completions, **kw):
    raise KeyError(int("f" * 4000, 16))


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (_raises, "raised ZeroDivisionError: boom"),  # a bug in the function: recorded, not silent
        (_hangs, "timed out"),  # a hang: bounded by timeout_s
        (_short, "returned 1 values, expected a list of 2"),  # the wrong number of scores
        (_by_item([float("inf"), 1.0]), "not a finite number"),  # inf for the first completion only
        (lambda prompts, completions, **k: {"a": 1.0, "b": 1.0}, "returned dict"),  # sized, iterable, not a list
        (lambda prompts, completions, **k: (x for x in [1.0, 1.0]), "returned generator"),  # no length
        (_by_item(["1.0", 1.0]), "not a number"),  # a string is not a score
        (_by_item([10**400, 1.0]), "not a number a float holds"),  # review: OverflowError escaped the scorer
        (_by_item([Fraction(10**400, 3), 1.0]), "not a number a float holds"),
        (_exits, "raised SystemExit"),  # review: BaseException escaped, failing the chunk
        (_cancelled, "raised CancelledError"),
        (lambda prompts, completions, **k: 3.0, "returned float"),  # not a list at all
        # review: str() of this error raises (an int past the 4,300-digit limit, from a hex answer)
        (_raises_unprintable, "raised KeyError: (its message could not be made: ValueError)"),
    ],
)
def test_a_bad_reward_scores_zero_with_a_reason_and_the_others_still_count(bad, why):
    sc = Scorer([_const(1.0), bad], [1.0, 1.0], ["good", "bad"], timeout_s=5.0)  # 1 s flaked for the good one
    t0 = time.time()
    out = sc.score_problems(_problems(2), ["x", "y"])
    assert time.time() - t0 < 20
    first = out[0]
    assert first.reward == 1.0 and first.components["bad"] is None
    assert first.errors == 1 and why in first.reason, first.reason
    assert first.correct  # accuracy reads the first reward, which worked


@pytest.mark.parametrize("skip", [None, float("nan")], ids=["None", "NaN"])
def test_none_or_nan_means_does_not_apply_and_is_not_an_error(skip):
    """TRL turns None into NaN and counts both as "did not apply": a completion no function scored is
    unscorable (reward None); one that another function scored counts the skipped component 0."""
    out = Scorer([_by_item([skip, 1.0])], [1.0], ["r"]).score_problems(_problems(2), ["x", "y"])
    assert [s.reward for s in out] == [None, 1.0]
    assert [s.errors for s in out] == [0, 0] and out[0].components == {"r": None}
    assert [s.correct for s in out] == [False, True]
    two = Scorer([_by_item([skip, 1.0]), _by_item([0.5, skip])], [1.0, 2.0], ["a", "b"]).score_problems(_problems(2), ["x", "y"])
    assert [s.reward for s in two] == [1.0, 1.0]  # 2 * 0.5, and 1.0 + the skipped 0


def test_a_failed_reward_is_never_unscorable():
    """A completion the only function fails on scores 0 (an error), not None: otherwise a policy that
    breaks its reward would escape the penalty (the advantage of an unscorable completion is 0)."""
    def boom(prompts, completions, **kw):
        raise RuntimeError("no")

    for fn in (boom, _by_item([float("inf"), None])):
        out = Scorer([fn], [1.0], ["r"]).score_problems(_problems(2), ["x", "y"])
        assert out[0].reward == 0.0 and out[0].errors == 1, out


@pytest.mark.parametrize("kind", ["numpy", "torch", "tuple"])
def test_a_reward_may_return_any_sequence_of_numbers_trl_iterates(kind):
    import numpy as np
    import torch

    make = {"numpy": np.array, "torch": torch.tensor, "tuple": tuple}[kind]

    def r(prompts, completions, **kw):
        return make([1.0, 0.25])

    out = Scorer([r], [1.0], ["r"]).score_problems(_problems(2), ["x", "y"])
    assert [s.reward for s in out] == [1.0, 0.25] and [s.errors for s in out] == [0, 0]


def test_reward_results_give_their_own_correctness_and_reason():
    def r(prompts, completions, **kw):
        return [RewardResult(0.5, 3.0, "lenient", "last", False, True)] * len(completions)

    [s] = Scorer([r], [1.0], ["r"]).score_problems(_problems(1), ["x"])
    assert (s.reward, s.correct, s.lenient_correct, s.reason) == (0.5, False, True, "lenient")


def test_the_first_rewards_parsed_answer_is_what_maj_at_k_votes_on():
    from grpo_kit.tasks.gsm8k import hash_reward

    # the task's own extraction (RewardResult.parsed) of the first reward; later rewards never vote
    sc = Scorer([hash_reward, _const(1.0)], [1.0, 1.0], ["answer", "c"])
    out = sc.score_problems(_problems(3), ["#### 0", "#### 12", "no number here"])
    assert [s.answer for s in out] == [0.0, 12.0, None]
    # a first reward that returns plain floats extracts nothing
    assert [s.answer for s in Scorer([_const(1.0), hash_reward], [1.0, 1.0], ["c", "a"]).score_problems(
        _problems(1), ["#### 0"])] == [None]


def test_scorer_with_a_locally_defined_function_round_trips_through_cloudpickle():
    bonus = 0.25

    def local_reward(prompts, completions, **kw):  # as defined in a notebook cell
        return [bonus + len(c) for c in completions]

    sc = tasks.Task("t", lambda *a: _problems(), [local_reward]).scorer()
    sc.score_problems(_problems(1), ["ab"])  # creates its thread pool, which must not travel
    back = pickle.loads(cloudpickle.dumps(sc))
    assert back.score_problems(_problems(1), ["abc"])[0].reward == 3.25


# ----------------------------------------------------------------------------- TRL's calling convention


def _msg(text):
    """A completion as TRL hands it to rewards on conversational data."""
    return [{"role": "assistant", "content": text}]


def _conversation(question, system="Think first, then answer in \\boxed{}."):
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_trl_accuracy_and_think_format_rewards_run_unchanged_on_conversational_rows():
    """TRL's shipped rewards, unchanged, on a TRL conversational dataset taken as it is (no
    mapping): in trl 1.16.0 both read ``completion[0]["content"]``, which the scorer's
    conversational completions give; the engine's texts go in as they come out."""
    from trl.rewards import accuracy_reward, think_format_reward

    rows = [{"prompt": _conversation("half?"), "solution": "$\\frac{1}{2}$"},
            {"prompt": _conversation("half?"), "solution": "$\\frac{1}{2}$"},
            {"prompt": _conversation("half?"), "solution": "$0.5$"},
            {"prompt": _conversation("?"), "solution": "no answer here"}]
    task = tasks.from_rows(rows, [accuracy_reward, think_format_reward], heldout_fraction=0)
    task = tasks.Task(task.name, task.problems, task.rewards, weights=[1.0, 0.5], names=["accuracy", "format"])
    probs = task.load("train", 4)
    probs = sorted(probs, key=lambda p: p.id)
    texts = ["<think>\nhalf\n</think>\nSo $\\boxed{\\frac{1}{2}}$",  # right, well formed
             "<think>\nthree\n</think>\nSo $\\boxed{3}$",  # wrong, well formed
             "no think tag: $\\boxed{\\frac{1}{2}}$",  # right (0.5 = 1/2), not formed
             "<think>\nx\n</think>\n$\\boxed{1}$"]  # a gold math-verify cannot parse
    log = tasks.RewardLog(4)
    out = task.scorer().score_problems(probs, texts, log=log)
    assert [s.components["accuracy"] for s in out] == [1.0, 0.0, 1.0, None]  # None: TRL skips the row
    # accuracy_reward logs its parses with log_extra, as it does for TRL's completions table
    assert log.extra["solution"] == [r["solution"] for r in rows]
    assert log.extra["gold_parsed"][3] == "[unparseable]" and log.extra["answer_parsed"][3] == "[skipped]"
    assert "3" in log.extra["answer_parsed"][1] and log.metrics == {}
    assert [s.components["format"] for s in out] == [1.0, 1.0, 0.0, 1.0]
    assert [s.reward for s in out] == [1.5, 0.5, 1.0, 0.5]
    assert [s.correct for s in out] == [True, False, True, False]
    assert all(s.errors == 0 for s in out), [s.reason for s in out]
    # the same figures as TRL's own call (grpo_trainer's _calculate_rewards: keywords only, prompts the
    # conversations, completions [{"role": "assistant", "content": text}])
    prompts = [r["prompt"] for r in rows]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    for fn, name in ((accuracy_reward, "accuracy"), (think_format_reward, "format")):
        assert fn(prompts=prompts, completions=completions, completion_ids=None,
                  solution=[r["solution"] for r in rows]) == [s.components[name] for s in out]
    # on text rows the same rewards fail (TRL's do too: they index completion[0]["content"]), recorded
    text_task = tasks.from_rows([{"prompt": "half?", "solution": "$0.5$"}], [accuracy_reward], heldout_fraction=0)
    [s] = text_task.scorer().score_problems(text_task.load("train", 1), ["$\\boxed{0.5}$"])
    assert s.errors == 1 and "raised TypeError" in s.reason


def test_trl_length_and_repetition_rewards_read_the_completion_ids():
    from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment

    overlong = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    repeats = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    ids = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8], [7] * 12]  # 5 tokens: free; 8: in the cache; 12: over
    sc = Scorer([overlong, repeats], [1.0, 1.0], ["overlong", "repeats"])
    out = sc.score_problems(_problems(3), ["a", "b", "c"], completion_ids=ids)
    assert [s.components["overlong"] for s in out] == [0.0, -0.5, -1.0]  # (10 - 4 - 8) / 4 = -0.5
    assert [s.components["repeats"] for s in out] == [0.0, 0.0, pytest.approx(-1 + 1 / 11)]  # 1 distinct bigram of 11
    assert all(s.errors == 0 for s in out)
    # without token ids (a caller that has none) they fail with the reason, and only they
    [s] = Scorer([_const(1.0), overlong], [1.0, 1.0], ["c", "overlong"]).score_problems(_problems(1), ["a"])
    assert s.reward == 1.0 and s.errors == 1 and "overlong: raised TypeError" in s.reason


def test_rewards_written_as_trl_and_unsloth_docs_write_them():
    seen = {}

    def reward_len(completions, **kwargs):  # TRL's GRPOTrainer docs
        return [-abs(20 - len(c)) for c in completions]

    def correctness(prompts, completions, answer, **kwargs):  # Unsloth's GRPO notebooks, on text rows
        seen.update(prompts=prompts, answer=answer, ids=kwargs["completion_ids"])
        return [2.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]

    probs = [Problem(id=f"p{i}", question=f"q{i}", gold=None, columns={"answer": str(i)}) for i in range(2)]
    out = Scorer([correctness, reward_len], [1.0, 0.1], ["correct", "len"]).score_problems(
        probs, [" 0 ", "x" * 25], completion_ids=[[5], [6, 7]])
    assert [s.components["correct"] for s in out] == [2.0, 0.0]
    assert [s.components["len"] for s in out] == [-17.0, -5.0]
    assert seen == {"prompts": ["q0", "q1"], "answer": ["0", "1"], "ids": [[5], [6, 7]]}


def _extract_xml_answer(text: str) -> str:  # Unsloth's GRPO notebook
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def unsloth_correctness(prompts, completions, answer, **kwargs) -> list[float]:  # Unsloth's, verbatim in form
    responses = [completion[0]["content"] for completion in completions]
    q = prompts[0][-1]["content"]
    assert isinstance(q, str)
    extracted = [_extract_xml_answer(r) for r in responses]
    return [2.0 if r == a else 0.0 for r, a in zip(extracted, answer, strict=True)]


def trl_format_reward(completions, **kwargs):  # TRL's GRPOTrainer docs, conversational
    import re

    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, c) else 0.0 for c in contents]


@pytest.mark.parametrize("form", ["text", "conversational"])
def test_docs_rewards_and_the_kits_own_on_both_row_formats(form):
    """Each row format gets completions in its own form (text, or TRL's messages); the docs' rewards
    written for that form score right, and the kit's own rewards (hash_reward) take either."""
    from grpo_kit.tasks.gsm8k import hash_reward

    prompt = (lambda q: _conversation(q)) if form == "conversational" else (lambda q: q)
    rows = [{"prompt": prompt(f"{a} + 2?"), "answer": str(a + 2)} for a in range(3)]
    rewards = [unsloth_correctness, trl_format_reward] if form == "conversational" else \
        [_by_answer, lambda completions, **kw: [-abs(20 - len(c)) for c in completions]]
    task = tasks.from_rows(rows, [*rewards, hash_reward], gold="answer", heldout_fraction=0)
    probs = sorted(task.load("train", 3), key=lambda p: p.id)
    texts = ["<think>2+0</think><answer>2</answer>", "<think>no</think><answer>4</answer> #### 3", "#### 4"]
    out = task.scorer().score_problems(probs, texts)
    assert all(s.errors == 0 for s in out), [s.reason for s in out]
    comps = [list(s.components.values()) for s in out]
    if form == "conversational":
        assert [c[0] for c in comps] == [2.0, 0.0, 0.0]  # <answer> is 2 (right), 4 (wrong), none
        assert [c[1] for c in comps] == [1.0, 0.0, 0.0]  # the trailing text breaks the second's format
    else:
        assert [c[0] for c in comps] == [1.0, 0.0, 0.0]
        assert [c[1] for c in comps] == [-abs(20 - len(t)) for t in texts]
    assert [c[2] for c in comps] == [0.0, 1.0, 1.0]  # hash_reward: "#### <gold>" for golds 2, 3, 4


def _by_answer(prompts, completions, answer, **kwargs):  # a text-row reward reading the column by name
    assert all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions)
    return [float(_extract_xml_answer(c) == a) for c, a in zip(completions, answer, strict=True)]


def test_kit_rewards_in_the_old_positional_form_still_bind():
    """The kit's own signature, ``(prompts, completions, gold, ...)``, binds by keyword too (the
    built-in tasks' rewards are tested through their scorers in test_math_task, test_code_task, ...)."""
    sc = tasks.resolve("synthetic", n_digits=2).scorer()
    [right, wrong] = sc.score_problems(_problems(2)[1:] * 2, ["#### 1", "#### 7"])
    assert (right.reward, right.correct, wrong.reward, wrong.correct) == (1.0, True, 0.0, False)


def test_async_reward_functions_are_awaited():
    import asyncio

    async def judge(completions, gold, **kwargs):  # e.g. an LLM judge over HTTP
        await asyncio.sleep(0.01)
        return [float(c == g) for c, g in zip(completions, gold, strict=True)]

    async def broken(completions, **kwargs):
        await asyncio.sleep(0)
        raise RuntimeError("judge down")

    out = Scorer([judge, broken], [1.0, 1.0], ["judge", "broken"]).score_problems(_problems(2), ["0", "5"])
    assert [s.components["judge"] for s in out] == [1.0, 0.0]
    assert all(s.errors == 1 and "raised RuntimeError: judge down" in s.reason for s in out)


@pytest.mark.parametrize("name", ["completion_ids", "trainer_state", "prompts"])
def test_a_column_named_like_a_reward_argument_is_refused(name):
    probs = [Problem(id="p", question="q", gold="1", columns={name: 3})]
    with pytest.raises(ValueError, match=f"{name}.*clash"):
        Scorer([_const(1.0)], [1.0], ["c"]).score_problems(probs, ["x"])
    with pytest.raises(ValueError, match=f"{name}.*clash"):
        Scorer([_const(1.0)], [1.0], ["c"]).score(["q"], ["x"], {name: [3]})


def test_completion_ids_must_align_with_completions():
    with pytest.raises(ValueError, match="1 completion_ids for 2 completions"):
        Scorer([_const(1.0)], [1.0], ["c"]).score_problems(_problems(2), ["x", "y"], completion_ids=[[1]])


# ----------------------------------------------------------------------------- registry and config


class Scored:
    """An environment that owns its reward (TRL's ``get_reward``)."""

    def reset(self, **kwargs):
        self.n = 2.0

    def get_reward(self) -> float:
        return self.n


class Unscored:
    def reset(self, **kwargs):
        return None


def test_an_environments_get_reward_is_one_more_reward_as_in_trl():
    """Review finding: with reward functions given, the environment's ``get_reward`` was dropped (TRL
    adds it, weight 1), and an environment without one and no reward function scored every
    episode 0 in silence (TRL refuses: "No reward source provided")."""
    from grpo_kit.tasks.base import env_reward

    def fmt(completions, **kw):
        return [1.0] * len(completions)

    probs = lambda split, n, seed: []  # noqa: E731 - never drawn here
    for factory in (Scored, lambda: Scored()):  # a class, or a function that makes one
        t = Task("t", probs, [fmt], environment_factory=factory, weights=[0.5])
        assert list(t.rewards) == [fmt, env_reward] and list(t.weights) == [0.5, 1.0]
        out = t.scorer().score(["q"] * 2, ["a", "b"], {"env_reward": [2.0, 0.0]})
        assert [r.reward for r in out] == [0.5 + 2.0, 0.5 + 0.0]
    assert Task("t", probs, [fmt], environment_factory=Scored, names=["fmt"]).names == ["fmt", "Scored"]
    assert list(Task("t", probs, environment_factory=Scored).rewards) == [env_reward]
    assert list(Task("t", probs, [env_reward], environment_factory=Scored).rewards) == [env_reward]  # not twice
    assert list(Task("t", probs, [fmt], environment_factory=Unscored).rewards) == [fmt]
    with pytest.raises(ValueError, match="no reward source"):
        Task("t", probs, environment_factory=Unscored)
    with pytest.raises(ValueError, match="weights must be finite numbers"):  # an infinite weight made rewards NaN
        Task("t", probs, [fmt], weights=[math.inf])


def test_builtin_tasks_resolve_by_name_and_bad_names_are_clear():
    assert tasks.resolve("synthetic", n_digits=2).load("train", 2)[0].id.startswith("add-")
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        tasks.resolve("nope")
    with pytest.raises(ImportError, match="no_such_module"):
        tasks.resolve("no_such_module:task")
    with pytest.raises(TypeError, match="not a grpo_kit.tasks.Task"):
        tasks.resolve("builtins:dict", x=4)
    with pytest.raises(TypeError, match="bad options"):
        tasks.resolve("synthetic", colour="red")


def test_for_config_adds_reward_functions_and_checks_weights():
    cfg = config.profile("tiny", reward_functions=("tests.test_tasks:_raises",))
    t = tasks.for_config(cfg)
    assert t.describe()["rewards"] == ["grpo_kit.tasks.gsm8k:hash_reward", "tests.test_tasks:_raises"]
    assert t.describe()["weights"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2"):
        tasks.for_config(config.profile("tiny", reward_functions=("tests.test_tasks:_raises",), reward_weights=(1.0,)))
    with pytest.raises(ValueError, match="package.module:fn"):
        config.profile("tiny", reward_functions=("not a path",))


def test_auto_task_follows_the_dataset():
    assert config.profile("tiny").data.task_name == "synthetic"
    assert config.profile("tiny", dataset="../shared/data/gsm8k").data.task_name == "gsm8k"
    assert config.profile("tiny", task="code").data.task_name == "code"


# ----------------------------------------------------------------------------- rows


def test_from_rows_maps_columns_and_names_a_missing_one(tmp_path):
    rows = [{"prompt": f"Rhyme with {w}{i}", "target": w, "level": i} for i, w in enumerate(["cat", "dog", "sun", "tree"] * 10)]
    t = tasks.from_rows(rows, _const(1.0), question="prompt", gold="target", name="rhyme", heldout_fraction=0.25)
    train, held = t.load("train", 100), t.load("heldout", 100)
    assert len(train) + len(held) == 40 and held
    assert train[0].columns.keys() == {"target", "level"}
    assert {p.question for p in train}.isdisjoint({p.question for p in held})
    with pytest.raises(KeyError, match="no column 'answer'.*'level', 'prompt', 'target'"):
        tasks.from_rows(rows, _const(1.0), question="prompt", gold="answer")
    # a column named gold beside gold= naming another: its values would silently not reach the rewards as gold
    with pytest.raises(ValueError, match="gold='target' names the gold answers, but the rows also have a column named 'gold'"):
        tasks.from_rows([{**r, "gold": "verified"} for r in rows], _const(1.0), gold="target").load("train", 5)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from_file = tasks.from_rows(str(path), _const(1.0), question="prompt", gold="target", name="rhyme", heldout_fraction=0.25)
    assert [p.question for p in from_file.load("heldout", 100)] == [p.question for p in held]
    import datasets

    from_ds = tasks.from_rows(datasets.Dataset.from_list(rows), _const(1.0), question="prompt", gold="target",
                              name="rhyme", heldout_fraction=0.25)
    assert from_ds.load("train", 5, seed=3) == t.load("train", 5, seed=3)


def test_from_rows_rejects_empty_questions():
    with pytest.raises(ValueError, match="row 1.*non-empty string"):
        tasks.from_rows([{"question": "a", "gold": 1}, {"question": "", "gold": 2}], _const(1.0))


def test_a_trl_dataset_needs_no_mapping(tmp_path):
    """TRL's formats as they are: a ``prompt`` column of text or of conversations (a system message
    included), any other columns by name; from a list, a JSONL file and a datasets.Dataset, whose
    Arrow structs fill a message's missing keys with None (dropped again here)."""
    import datasets

    rows = [{"prompt": _conversation(f"What is {i} + 1?"), "solution": str(i + 1), "level": i} for i in range(20)]
    rows[3]["prompt"] = [*rows[3]["prompt"], {"role": "assistant", "content": "Let me see.", "name": "helper"}]
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    built = [tasks.from_rows(src, _const(1.0), heldout_fraction=0.25)
             for src in (rows, str(path), datasets.Dataset.from_list(rows))]
    loads = [t.load("train", 100) + t.load("heldout", 100) for t in built]
    assert loads[0] == loads[1] == loads[2]  # the None-filled keys dropped: the same problems
    by_id = {p.id: p for p in loads[0]}
    p0, p3 = by_id["custom-train-0"], by_id["custom-train-3"]
    assert p0.messages == rows[0]["prompt"] and p0.question == "What is 0 + 1?" and p0.gold == ""
    assert p0.columns == {"solution": "1", "level": 0}  # every column but the prompt, by name; no gold column
    assert p3.messages[-1] == {"role": "assistant", "content": "Let me see.", "name": "helper"}
    assert p3.question == "What is 3 + 1?"  # the last user message
    assert built[0].load("heldout", 100)  # the held-out split hashes whole conversations
    seen = {}

    def reward(prompts, completions, solution, **kw):
        seen.update(prompts=prompts, completions=completions, solution=solution, kw=set(kw))
        return [0.0] * len(completions)

    built[0].rewards[0] = reward
    built[0].scorer().score_problems([p0], ["2"])
    assert seen["prompts"] == [rows[0]["prompt"]] and seen["completions"] == [[{"role": "assistant", "content": "2"}]]
    assert seen["solution"] == ["1"] and seen["kw"] == {"completion_ids", "gold", "level", "trainer_state",
                                                        "log_extra", "log_metric"}
    # standard (text) rows: the prompt column by TRL's name, and the old mapping still works
    text = tasks.from_rows([{"prompt": "Say hi", "gold": "hi"}], _const(1.0), heldout_fraction=0).load("train", 1)[0]
    assert (text.question, text.gold, text.messages, text.columns) == ("Say hi", "hi", None, {"gold": "hi"})
    # a gold column reaches the rewards as it is, as TRL passes it (it was made text: 4 became "4")
    seen_gold = {}

    def sees_gold(completions, gold, **kw):
        seen_gold["gold"] = gold
        return [1.0] * len(completions)

    raw = [{"prompt": "2+2?", "gold": 4}, {"prompt": "list?", "gold": ["a", "b"]}, {"prompt": "none?", "gold": None}]
    probs = sorted(tasks.from_rows(raw, sees_gold, heldout_fraction=0).load("train", 3), key=lambda p: p.id)
    tasks.from_rows(raw, sees_gold, heldout_fraction=0).scorer().score_problems(probs, ["x"] * 3)
    assert seen_gold["gold"] == [4, ["a", "b"], None] and [p.gold for p in probs] == ["4", "['a', 'b']", ""]
    mapped = tasks.from_rows([{"q": "Say hi", "a": "hi"}], _const(1.0), question="q", gold="a",
                             heldout_fraction=0).load("train", 1)[0]
    assert (mapped.question, mapped.gold, mapped.messages) == ("Say hi", "hi", None)
    with pytest.raises(KeyError, match="no 'prompt' column.*question=.*'q'"):
        tasks.from_rows([{"q": "Say hi"}], _const(1.0))


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        ([], "row 1.*non-empty list"),  # an empty conversation
        ([{"role": "user"}], "row 1.*expected a dict with 'role' and 'content'"),
        ([{"role": "narrator", "content": "x"}], "row 1.*unknown role 'narrator'"),
        ([{"role": "system", "content": "x"}], "row 1.*needs a user message"),
        ("What is 1 + 1?", "row 1.*expected a list of messages"),  # text after a conversation in row 0
    ],
)
def test_malformed_trl_rows_are_refused_naming_the_row(prompt, why):
    rows = [{"prompt": _conversation("What is 2 + 2?")}, {"prompt": prompt}]
    with pytest.raises(ValueError, match=why):
        tasks.from_rows(rows, _const(1.0))
    if isinstance(prompt, list) and prompt:  # and a conversation after text in row 0
        with pytest.raises(ValueError, match="row 1.*conversation but row 0's is text"):
            tasks.from_rows([{"prompt": "What is 2 + 2?"}, {"prompt": prompt}], _const(1.0))


# ----------------------------------------------------------------------------- trainer_state, log_extra, log_metric


def test_trainer_state_log_extra_and_log_metric_as_trl_passes_them():
    states = []

    def schedule(completions, trainer_state, log_extra, log_metric, **kw):  # reads the step, logs both ways
        states.append(trainer_state)
        log_extra("length", [len(c) for c in completions])
        log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
        log_metric("progress", 1.0)  # twice in a batch: both values count in the mean
        return [1.0] * len(completions)

    def logs_then_raises(completions, log_extra, log_metric, **kw):  # a failed function logs nothing
        log_metric("lost", 5.0)
        log_extra("lost", [1] * len(completions))
        raise RuntimeError("after logging")

    def bad_log(completions, log_extra, **kw):
        log_extra("short", [1])  # not one value per completion: this function fails, with the reason
        return [1.0] * len(completions)

    def odd_values(completions, log_extra, log_metric, **kw):
        log_extra("objs", [object(), float("nan")])  # not JSON: kept as str; NaN: None
        log_metric("nan", float("nan"))  # not a finite number: the function fails
        return [1.0] * len(completions)

    sc = tasks.Task("t", lambda *a: _problems(), [schedule, logs_then_raises, bad_log, odd_values]).scorer(max_steps=10)
    log = tasks.RewardLog(2)
    out = sc.score_problems(_problems(2), ["ab", "abc"], state=sc.progress(4, version=3), log=log)
    assert states == [tasks.TrainingProgress(global_step=4, max_steps=10, version=3, mode="train")]
    with pytest.raises(dataclasses.FrozenInstanceError):
        states[0].global_step = 5
    assert log.extra == {"length": [2, 3]} and log.metrics == {"progress": [0.4, 1.0]}
    assert [log.row(i) for i in range(2)] == [{"length": 2}, {"length": 3}]
    assert out[0].errors == 3 and "logs_then_raises: raised RuntimeError" in out[0].reason
    assert out[0].components == {"schedule": 1.0, "logs_then_raises": None, "bad_log": None, "odd_values": None}
    solo = tasks.Task("t", lambda *a: _problems(), [bad_log]).scorer().score_problems(_problems(2), ["a", "b"])
    assert "log_extra('short'): expected a list of 2 values (one per completion), got 1 values" in solo[0].reason
    quiet = tasks.RewardLog(2)
    odd = tasks.Task("t", lambda *a: _problems(), [odd_values]).scorer().score_problems(_problems(2), ["a", "b"], log=quiet)
    assert "log_metric('nan')" in odd[0].reason and quiet.extra == {}
    quiet.log_extra("objs", [object(), float("nan")])
    assert quiet.extra["objs"][0].startswith("<object object") and quiet.extra["objs"][1] is None
    # outside a run: step 0, no max_steps
    seen = []
    Scorer([lambda completions, trainer_state, **kw: seen.append(trainer_state) or [0.0]], [1.0], ["s"]).score(
        ["q"], ["x"], {})
    assert seen == [tasks.TrainingProgress(0, None, None, "train")]


def test_reward_metric_means_average_every_logged_value():
    from grpo_kit.metrics import reward_metric_means

    chunks = [{"reward_metrics": {"a": [1.0, 2.0], "b": [4.0]}}, {"reward_metrics": {"a": [6.0]}}, {}]
    assert reward_metric_means(chunks) == {"a": 3.0, "b": 4.0}  # TRL: sum / count over the logging step
    assert reward_metric_means([{"reward_metrics": {}}]) == {}


# ----------------------------------------------------------------------------- end to end


def test_a_notebook_defined_task_and_reward_train_through_the_dask_loop(tmp_path, capfd):
    """Rows and reward functions defined here (as in a notebook cell) reach the workers by
    cloudpickle; a reward that raises is scored 0 and counted; scoring runs on the reward worker.
    The run starts its own LocalCluster, whose workers inherit this process's (captured) stdout:
    what they print goes to ``<run_dir>/logs`` instead."""
    digits = [{"q": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(100, 160) for b in range(200, 203)]
    calls_seen = []

    def mentions_answer(prompts, completions, answer, **kw):  # closes over nothing the workers lack
        print("NOISE from a reward on a worker", flush=True)
        return [1.0 if a in c else 0.0 for c, a in zip(completions, answer, strict=True)]

    task = tasks.from_rows(digits, [mentions_answer, _raises], question="q", gold="answer", name="mentions",
                           weights=[1.0, 0.5], instruction="Give the final answer as '#### <integer>'.")
    cfg = config.profile("tiny", engine="hf", iterations=2, eval_every=2, eval_size=8, prompts_per_step=4, group_size=4,
                         max_new_tokens=40, run_dir=str(tmp_path / "run"), collective_timeout_s=60, n_reward_workers=1)
    res = loop.run(cfg, task=task, progress=False, callbacks=[calls_seen.append])
    seen = capfd.readouterr()
    assert "NOISE" not in seen.out + seen.err, seen  # the workers' output went to their log files
    worker_logs = tmp_path / "run" / "logs"
    assert "NOISE from a reward on a worker" in (worker_logs / "reward-0.log").read_text()
    assert {p.name for p in worker_logs.iterdir()} == {"rollout-0.log", "trainer-0.log", "reward-0.log"}
    assert [r["iteration"] for r in res.records] == [0, 1] and len(calls_seen) == 2
    n = cfg.sampling.prompts_per_step * cfg.sampling.group_size
    for r in res.records:
        assert set(r["reward_components"]) == {"mentions_answer", "_raises"}
        assert r["reward_components"]["_raises"] is None
        assert r["reward_errors"] == n  # every completion: one failed component
        assert r["reward_workers"] == 1
        assert math.isclose(r["reward_mean"], r["reward_components"]["mentions_answer"])
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["task"]
    assert recorded["name"] == "mentions"
    here = _raises.__module__
    assert recorded["rewards"] == [
        f"{here}:test_a_notebook_defined_task_and_reward_train_through_the_dask_loop.<locals>.mentions_answer",
        f"{here}:_raises",
    ]
    assert res.summary["acc_after"] is not None
    rows = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert all("_raises: raised ZeroDivisionError" in r["reward_reason"] for r in rows)


def test_rows_no_reward_applies_to_are_unscorable_through_the_loop(tmp_path):
    """TRL's multi-task pattern: a reward that returns None on the rows it does not apply to. A
    completion no reward scored is recorded with reward None, counted in ``unscorable``, left out of
    ``reward_mean`` and trains with advantage 0 (``samples_nonzero_adv`` counts scored ones only)."""
    rows = [{"q": f"What is {a} + {b}?", "answer": str(a + b), "kind": "skip" if a % 2 else "sum"}
            for a in range(100, 140) for b in range(200, 202)]

    def mentions_sum(prompts, completions, answer, kind, **kw):
        return [None if k == "skip" else float(a in c or len(c) % 2 == 0)  # spread in most groups
                for c, a, k in zip(completions, answer, kind, strict=True)]

    task = tasks.from_rows(rows, [mentions_sum], question="q", gold="answer", name="mixed")
    cfg = config.profile("tiny", engine="hf", iterations=2, eval_every=0, prompts_per_step=6, group_size=4,
                         max_new_tokens=24, run_dir=str(tmp_path / "run"), collective_timeout_s=60, n_reward_workers=0)
    res = loop.run(cfg, task=task, progress=False)
    out = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    skipped = [r for r in out if r["reward"] is None]
    assert skipped and all(r["reward_errors"] == 0 and r["reward_components"] == {"mentions_sum": None} for r in skipped)
    assert len(skipped) < len(out)
    for rec in res.records:
        mine = [r for r in out if r["iteration"] == rec["iteration"]]
        scored = [r["reward"] for r in mine if r["reward"] is not None]
        assert rec["unscorable"] == len(mine) - len(scored) > 0
        assert math.isclose(rec["reward_mean"], sum(scored) / len(scored))
        assert rec["samples_nonzero_adv"] <= len(scored)


def test_task_objects_and_task_options_do_not_mix():
    cfg = config.profile("tiny", task_options={"n_digits": 2})
    with pytest.raises(ValueError, match="task_options apply to a task named in the config"):
        tasks.for_config(cfg, Task("t", lambda *a: _problems(), [_const(1.0)]))




CLUSTER_SHAPE = {"n_rollout_workers": 1, "n_trainer_workers": 1, "n_reward_workers": 1}
"""The ``client`` fixture's cluster (conftest.py): scoring on a reward worker of its own."""


def _conversational_arithmetic() -> Task:
    """A TRL conversational dataset (system message included) and rewards written as TRL's docs
    write them, plus TRL's shipped think_format_reward, for the end-to-end run below."""
    from trl.rewards import think_format_reward

    rows = [{"prompt": [{"role": "system", "content": "Add the numbers."},
                        {"role": "user", "content": f"What is {a} + {b}?"}], "solution": str(a + b)}
            for a in range(100, 140) for b in range(200, 202)]

    def correct(completions, solution, trainer_state, log_extra, log_metric, **kwargs):
        texts = [completion[0]["content"] for completion in completions]
        log_metric("step", trainer_state.global_step)  # reaches the record of that iteration
        log_extra("marked", ["####" in t for t in texts])
        return [1.0 if f"#### {s}" in t else 0.0 for t, s in zip(texts, solution, strict=True)]

    return tasks.from_rows(rows, [correct, think_format_reward], name="conv-add", weights=[1.0, 0.1],
                           instruction="Give the final answer as '#### <integer>'.")


@pytest.mark.slow
@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason="needs ../shared/data/gsm8k")
@pytest.mark.parametrize(
    ("task", "model", "extra"),
    [
        ("gsm8k", "tiny", {"dataset": str(GSM8K_DIR), "max_model_len": 512}),
        ("math", "tiny", {"dataset": str(GSM8K_DIR), "max_model_len": 512}),  # math-verify on GSM8K's gold numbers
        ("code", "smollm2-135m", {"max_model_len": 1024}),  # HumanEval's prompts are long in the tiny model's tokens
        ("conversational", "tiny", {"iterations": 2, "eval_every": 2}),  # a TRL dataset and rewards, unchanged
    ],
)
def test_builtin_tasks_train_through_the_dask_loop(task, model, extra, client, tmp_path):
    obj = _conversational_arithmetic() if task == "conversational" else None
    kw = {"engine": "hf", "iterations": 1, "eval_every": 1, "eval_size": 2, "prompts_per_step": 2, "group_size": 2,
          "max_new_tokens": 24, "train_size": 64, "run_dir": str(tmp_path / "run"), "collective_timeout_s": 60, **extra}
    cfg = config.profile("tiny", model=model, **({} if obj else {"task": task}), **kw)
    res = loop.run(cfg, client, progress=False, task=obj)
    assert [r["iteration"] for r in res.records] == list(range(cfg.run.iterations))
    for rec in res.records:
        assert rec["reward_errors"] == 0 and rec["reward_workers"] == 1
    name = obj.name if obj else task
    assert json.loads((tmp_path / "run" / "config.json").read_text())["task"]["name"] == name
    rows = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * cfg.run.iterations and all(r["reward_reason"] for r in rows)
    prefix = {"gsm8k": "gsm8k-train-", "math": "gsm8k-train-", "code": "humaneval-", "conversational": "conv-add-train-"}[task]
    assert all(r["prompt_id"].startswith(prefix) for r in rows), rows[0]["prompt_id"]
    assert (res.summary["acc_after"] is not None) == bool(cfg.run.eval_every)
    if obj:
        _check_conversational_run(obj, res, rows, tmp_path / "run")


def _check_conversational_run(task, res, rows, run_dir):
    """The conversation was the prompt (its plain rendering's tokens: the tiny model has no chat
    template), trainer_state's step and log_metric reached each iteration's record, log_extra each
    completion's row and the samples."""
    from tokenizers import Tokenizer  # the tiny model's own, without importing transformers here (30 s)

    from grpo_kit import tiny
    from grpo_kit.prompts import PromptFormat

    assert [r["reward_metrics"] for r in res.records] == [{"step": 0.0}, {"step": 1.0}]
    # evaluation's rewards log too: trainer_state's step there is the evaluated version
    evals = [e for r in res.records for e in r.get("evals", [])]
    assert sorted((e["version"], e["reward_metrics"]) for e in evals) == [(0, {"step": 0.0}), (2, {"step": 2.0})]
    assert all(set(r["reward_components"]) == {"correct", "think_format_reward"} for r in res.records)
    tok = Tokenizer.from_file(str(tiny.ensure_tiny_model() / "tokenizer.json"))
    fmt = PromptFormat(instruction=task.instruction)
    convs = {p.id: p.messages for split in ("train", "heldout") for p in task.load(split, 100)}
    for r in rows:  # the system message's line included
        assert r["prompt_tokens"] == len(tok.encode(fmt.plain(convs[r["prompt_id"]]), add_special_tokens=False).ids)
        assert r["reward_extra"] == {"marked": "####" in r["text"]}
        a, b = (int(x) for x in convs[r["prompt_id"]][-1]["content"].removeprefix("What is ").rstrip("?").split(" + "))
        assert r["reward_components"]["correct"] == float(f"#### {a + b}" in r["text"])
        assert r["reward_components"]["think_format_reward"] == 0.0  # the tiny model writes no <think> block
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["extra"] == {"marked": "####" in s["completion"]} for s in samples)
    # the report renders these records and samples: tests/test_report.py


def test_a_format_bonus_the_task_does_not_take_is_warned_of():
    """Review finding: reward.format_bonus and lenient_credit reach the #### reward of the synthetic,
    gsm8k and calculator tasks only; for another task they were accepted and silently ignored."""
    import warnings as w

    from grpo_kit import config, tasks

    with pytest.warns(UserWarning, match="reward.format_bonus and reward.lenient_credit .* task 'guess_number'"):
        tasks.for_config(config.profile("smol", task="guess_number"))
    with w.catch_warnings():
        w.simplefilter("error")
        tasks.for_config(config.profile("smol"))  # the synthetic task takes both
        tasks.for_config(config.profile("tiny", task="guess_number"))  # neither set
