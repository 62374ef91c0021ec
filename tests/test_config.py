from __future__ import annotations

import dataclasses
import re

import pytest

from grpo_kit import config
from grpo_kit.config import Config, profile


def test_profiles_build_and_differ():
    tiny, smoke, stress = (profile(p) for p in ("tiny", "smoke", "stress"))
    assert tiny.model.model == "tiny" and tiny.data.dataset == "synthetic"
    assert smoke.model.model == "Qwen/Qwen3-0.6B" and smoke.lora.lora_r == 16 and smoke.cluster.world_size == 1
    assert stress.model.model == "Qwen/Qwen3-8B"
    assert (stress.sampling.prompts_per_step, stress.sampling.group_size, stress.sampling.max_new_tokens) == (32, 6, 512)
    assert stress.cluster.world_size > 1


def test_overrides_are_flat_and_validated():
    c = profile("tiny", group_size=8, lr=1e-3, lora_targets=["q_proj"])
    assert c.sampling.group_size == 8 and c.optim.lr == 1e-3 and c.lora.lora_targets == ("q_proj",)
    assert c.sampling.batch_size == 8 * c.sampling.prompts_per_step
    with pytest.raises(ValueError, match="unknown config field"):
        profile("tiny", group_sze=8)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"group_size": 1}, "group_size must be >= 2"),  # GRPO needs a group to compare within
        ({"clip_eps": 0.0}, "clip_eps must be > 0"),  # no trust region at all
        ({"lr": 0.0}, "lr must be > 0"),  # a run that cannot move
        ({"lr": -1e-4}, "lr must be > 0"),
        ({"loss_type": "ppo"}, "loss_type must be one of"),  # only TRL's three normalizers
        ({"policy_loss": "ppo"}, r"policy_loss must be one of \['cispo', 'grpo', 'gspo'"),  # names the registry
        ({"advantage": "gae"}, r"advantage must be one of \[.*'rloo'"),  # no critic, no GAE
        ({"engine": "sglang"}, "engine must be one of"),
        ({"stop": ("\n\n", "")}, "stop strings must be non-empty"),  # review: "" cut every multi-turn turn to one token
        ({"temperature": 0.0}, r"temperature must be in \[0.01, inf\)"),  # greedy is engine.greedy(), not a temperature
        ({"temperature": 0.005}, "vLLM samples below 0.01 at 0.01"),  # review finding: vLLM raises it to 0.01
        ({"temperature": float("inf")}, r"temperature must be in \[0.01, inf\)"),
        ({"lr": float("inf")}, "lr must be > 0 and finite"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm must be a number, got NaN"),  # clipping silently off
        # review finding: no field was type-checked ("false" is truthy; 2.5 evaluated every 5 iterations)
        ({"packing": "false"}, "packing must be True or False, got 'false'"),
        ({"pipelined": 0}, "pipelined must be True or False"),
        ({"eval_every": 2.5}, "eval_every must be a whole number, got 2.5"),
        ({"iterations": 2.5}, "iterations must be a whole number"),
        ({"prompts_per_step": True}, "prompts_per_step must be a number, got bool"),
        ({"group_size": "4"}, "group_size must be a number, got str"),
        ({"task": object()}, "task must be a string"),
        ({"stop": [1]}, "stop entry must be a string"),
        ({"run_dir": ""}, "run_dir must name a directory"),  # the store would be /store
        ({"profile": "smol"}, "would only relabel the 'tiny' profile"),
        ({"preflight_sizes": "1K:4K:16K"}, "a range is LO:HI"),  # failed only inside loop.run, after the engines
        ({"preflight_sizes": "256M:1K"}, "LO is above HI"),  # was silently one size
        ({"preflight_sizes": "", "preflight_min_busbw_gbps": 50.0}, "nothing would check the floor"),
        ({"kl_beta": -0.1}, "kl_beta must be >= 0"),
        # review findings: infinities passed (an infinite reward weight made rewards NaN), and a completion
        # budget as long as the context failed only in encode_prompts, after the cluster had started
        ({"kl_beta": float("inf")}, "kl_beta must be >= 0 and finite"),
        ({"weight_decay": float("inf")}, "weight_decay must be >= 0 and finite"),
        ({"reward_weights": (1.0, float("inf"))}, "reward_weights must be finite numbers"),
        ({"max_new_tokens": 256}, r"max_new_tokens \(256\) must be below max_model_len \(256\)"),
        ({"max_staleness": -1}, "max_staleness must be >= 0"),
        ({"world_size": 0}, "world_size must be >= 1"),
        ({"n_eval_workers": -1}, "n_eval_workers must be >= 0"),
        ({"eval_samples": -1}, "eval_samples must be >= 0"),  # 0 is greedy only
        ({"eval_temperature": 0.0}, r"eval_temperature must be in \[0.01"),  # greedy is the greedy completion
        ({"eval_sets": {"gsm8k": {"source": "x"}}}, r"eval_sets\['gsm8k'\] must be a task name"),  # no task named
        ({"eval_sets": ["gsm8k"]}, "eval_sets must be a dict"),
    ],
)
def test_bad_values_raise_clear_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        profile("tiny", **kw)


def test_values_are_normalized_to_their_fields_type():
    """An int in a float field is a float (kl_beta=0 from papermill and 0.0 are one run id), a whole
    float in an int field an int, numpy scalars plain Python ones."""
    import numpy as np

    from grpo_kit import checkpoint, tasks

    a, b = profile("smol", kl_beta=0, lr=1), profile("smol", kl_beta=0.0, lr=1.0)
    assert a == b and type(a.loss.kl_beta) is float and type(a.optim.lr) is float
    task = tasks.for_config(a)
    assert checkpoint.run_id_for(a, "/s", task) == checkpoint.run_id_for(b, "/s", task)
    c = profile("tiny", group_size=np.int64(4), eval_every=2.0, packing=np.bool_(True), temperature=np.float32(0.5))
    assert (c.sampling.group_size, c.run.eval_every, c.optim.packing) == (4, 2, True)
    assert [type(x) for x in (c.sampling.group_size, c.run.eval_every, c.optim.packing, c.sampling.temperature)] == [int, int, bool, float]
    assert Config.from_dict(c.to_dict()) == c


def test_command_line_spellings_mean_what_they_say():
    """Review findings: --set packing=false kept the truthy string 'false'; lora_targets='q_proj,v_proj'
    was one module name; a misspelled section of a config dict was ignored."""
    over = config.parse_overrides(["packing=false", "pipelined=OFF", "dynamic_sampling=yes", "store_url=none"])
    assert over == {"packing": False, "pipelined": False, "dynamic_sampling": True, "store_url": None}
    assert profile("tiny", lora_targets="q_proj, v_proj").lora.lora_targets == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match=r"unknown config section\(s\) \['samplng'\]"):
        Config.from_dict({**profile("tiny").to_dict(), "samplng": {"group_size": 4}})
    assert profile("tiny", profile="tiny") == profile("tiny")  # flat() round-trips


def test_tempered_sampling_needs_no_opt_in():
    """The trainer scores the tempered distribution the engines record (tests/test_trainer.py), so a
    temperature is a plain setting; the old opt-in is still accepted and changes nothing."""
    assert profile("tiny", temperature=0.7).sampling.temperature == 0.7
    old = profile("tiny", temperature=0.7, allow_tempered=True)
    assert Config.from_dict(old.to_dict()) == old and old.sampling.temperature == 0.7


def test_unknown_profile():
    with pytest.raises(ValueError, match="unknown profile 'huge'"):
        profile("huge")


def test_round_trip_and_flat_names_unique():
    c = profile("smoke", lr=3e-5)
    assert Config.from_dict(c.to_dict()) == c
    names = config.flat_field_names()
    assert len(names) == len(set(names)), "flat names must be unique across sections"
    assert set(c.flat()) == set(names) | {"profile"}


def test_configs_are_frozen_and_documented():
    c = profile("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.sampling.group_size = 3  # type: ignore[misc]
    import inspect

    for cls in (config.ModelConfig, config.DataConfig, config.PromptConfig, config.RewardConfig, config.SamplingConfig,
                config.EpisodeConfig, config.LossConfig, config.OptimConfig, config.LoRAConfig, config.ClusterConfig,
                config.RunConfig):
        src = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            # the field's line, then a docstring on the next line
            assert re.search(rf'^    {f.name}: .*\n\s+(r?""")', src, re.M), f"{cls.__name__}.{f.name} has no docstring"


def test_store_root_derived():
    assert profile("tiny", run_dir="runs/x").run.store_root == "runs/x/store"
    assert profile("tiny", store_url="s3://b/p").run.store_root == "s3://b/p"
