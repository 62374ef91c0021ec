"""Guess the number: the environment's rules, an adversarial table of what a policy may try, and
episodes played through the runner (a scripted binary search on SmolLM2's chat template)."""

from __future__ import annotations

import re

import pytest

from grpo_kit import models, tasks
from grpo_kit.episode import EpisodeConfig, EpisodeRunner
from grpo_kit.renderers import ChatRenderer
from grpo_kit.rollout import Continuation
from grpo_kit.tasks.guess import GuessNumber, problems


def play(env: GuessNumber, numbers) -> list[str]:
    return [env.guess(x) for x in numbers]


def fresh(secret: int, high: int = 100, max_guesses: int | None = None) -> GuessNumber:
    env = GuessNumber(high, max_guesses)
    assert env.reset(gold=str(secret), prompt="q", id="x") is None
    return env


def bisect(env: GuessNumber, lo: int = 1, hi: int = 100) -> int:
    while True:
        mid = (lo + hi) // 2
        answer = env.guess(mid)
        if answer.startswith("correct") or answer == "no guesses left":
            return mid
        lo, hi = (mid + 1, hi) if answer == "higher" else (lo, mid - 1)


def test_observations_depend_on_earlier_guesses_and_a_binary_search_always_wins():
    env = fresh(37)
    assert play(env, [50, 25, 37]) == ["lower", "higher", "correct"] and env.get_reward() == 1.0
    assert env.max_guesses == 7  # ceil(log2(101))
    for secret in range(1, 101):
        env = fresh(secret)
        bisect(env)
        assert env.get_reward() == 1.0 and len(env.guesses) <= 7, secret


# what a policy may try: (description, secret, guesses, reward)
ADVERSARIAL = [
    ("brute force past the budget", 60, list(range(1, 61)), 0.0),
    ("brute force that is lucky within the budget", 5, list(range(1, 8)), 1.0),
    ("out-of-range guesses use the budget", 99, [0, 101, -5, 10**9, 200, 300, 400, 99], 0.0),
    ("non-integers use the budget", 3, ["3", 3.0, None, [3], {"n": 3}, "three", 2.5, 3], 0.0),
    ("a bool is not a number", 1, [True], 0.0),  # True == 1: read as a guess it would find the number
    ("guessing on after the number was found changes nothing", 50, [50, 1, 2, 3, 4, 5, 6, 7, 8], 1.0),
    ("no guess at all", 42, [], 0.0),
]


@pytest.mark.parametrize("what,secret,guesses,reward", ADVERSARIAL, ids=[a[0] for a in ADVERSARIAL])
def test_adversarial_table(what, secret, guesses, reward):
    env = fresh(secret)
    answers = play(env, guesses)
    assert env.get_reward() == reward, (what, answers)
    if len(guesses) > 7 and reward == 0.0:
        assert answers[7:] == ["no guesses left"] * (len(guesses) - 7)


def test_a_bad_row_fails_reset_and_problems_are_seeded():
    with pytest.raises(ValueError, match="whole number"):
        GuessNumber().reset(gold="0")
    with pytest.raises(ValueError, match="whole number"):
        GuessNumber(high=10).reset(gold="11")
    a, b = problems("train", 20, 0), problems("train", 20, 0)
    assert a == b and problems("heldout", 20, 0) != a and {p.gold for p in a} <= {str(i) for i in range(1, 101)}
    task = tasks.resolve("guess_number")
    assert task.multi_turn and task.environment_factory() is not task.environment_factory()  # one per episode
    assert task.describe()["environment"].endswith("task.<locals>.make")


class Bisector:
    """An engine that plays a binary search in Hermes tool calls from the conversation so far (or,
    with ``cheat``, answers the secret in text without calling the tool)."""

    def __init__(self, tokenizer, cheat: str | None = None):
        self.tokenizer, self.cheat, self.max_model_len = tokenizer, cheat, 2048
        self.stop_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def reply(self, text: str) -> str:
        if self.cheat:
            return self.cheat
        lo, hi = 1, 100
        for g, answer in re.findall(r'"number": (\d+)\}\}</tool_call><\|im_end\|>\n<\|im_start\|>(?:tool|user)\n(\w+)', text):
            lo, hi = (int(g) + 1, hi) if answer == "higher" else (lo, int(g) - 1) if answer == "lower" else (lo, hi)
        if text.rstrip().endswith("correct<|im_end|>\n<|im_start|>assistant") or "\ncorrect<|im_end|>" in text:
            return "Found it."
        return f'<tool_call>{{"name": "guess", "arguments": {{"number": {(lo + hi) // 2}}}}}</tool_call>'

    def sample_ids(self, prompts, *, seeds, max_new_tokens, version=0, temperature=1.0, stop=()):
        out = []
        for p, limit in zip(prompts, max_new_tokens, strict=True):
            ids = self.tokenizer.encode(self.reply(self.tokenizer.decode(p)), add_special_tokens=False) + self.stop_ids
            out.append(Continuation(ids[:limit], [-0.5] * len(ids[:limit]), "stop" if len(ids) <= limit else "length"))
        return out


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.resolve_model("smollm2-135m"))


def test_episodes_of_a_binary_search_find_every_number_and_text_alone_scores_zero(smol_tok):
    task = tasks.resolve("guess_number")
    probs = task.load("train", 12, 0)
    cfg = EpisodeConfig(max_turns=9, max_turn_tokens=40, max_episode_tokens=900)
    lives = EpisodeRunner(Bisector(smol_tok), ChatRenderer(smol_tok), environment_factory=task.environment_factory,
                          cfg=cfg).play(probs, 1)
    for lv, p in zip(lives, probs, strict=True):
        ep = lv.ep
        assert ep.env_reward == 1.0 and ep.end_reason == "answered" and 2 <= ep.turns <= 8, (p.gold, ep.messages)
        assert lv.env.guesses[-1] == int(p.gold) and ep.tool_errors == {}
    # the policy writes the number (and "correct") without guessing: the environment's reward is 0
    cheats = EpisodeRunner(Bisector(smol_tok, cheat="correct #### 42"), ChatRenderer(smol_tok),
                           environment_factory=task.environment_factory, cfg=cfg).run(probs, 1)
    scores = task.scorer().score_problems(probs, [c.messages[-1]["content"] for c in cheats],
                                          {"env_reward": [c.env_reward for c in cheats]})
    assert [s.reward for s in scores] == [0.0] * len(probs) and not any(s.correct for s in scores)


def test_env_reward_scores_a_missing_or_non_finite_environment_reward_zero():
    """None (the episode ended in an error) and NaN (a user environment's arithmetic) both score 0:
    either as unscorable would give the episode advantage 0 where it earned the penalty."""
    from grpo_kit.tasks.base import env_reward

    assert env_reward(["q"] * 5, ["c"] * 5, env_reward=[None, 1.0, float("nan"), float("inf"), 0.5]) == [0.0, 1.0, 0.0, 0.0, 0.5]
