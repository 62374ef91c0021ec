"""A TRL ``GRPOConfig`` carried over (``config.from_trl``): TRL 1.16's own class, installed by setup.sh."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest

from grpo_kit import algorithms, config
from grpo_kit.config import Config
from grpo_kit.trl_config import DEFAULT_DIFFERENCES, RENAMES, kit_value

GRPOConfig = pytest.importorskip("trl").GRPOConfig


def trl_args(**kw):
    """A GRPOConfig that builds on any machine (TRL's bf16 default needs a GPU, or use_cpu), with a
    length (max_steps; unset, the kit warns that the profile's iterations replace TRL's epochs) and
    completions that fit the tiny profiles' context (TRL's default 512 does not: refused)."""
    return GRPOConfig(use_cpu=True, **{"max_steps": 10, "max_completion_length": 64, **kw})


def from_trl(args, profile="smoke", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning the test does not expect fails it
        return config.from_trl(args, profile, **kw)


def test_importing_trl_leaks_no_environment_into_the_suite():
    """``import trl`` (this module's, at collection) sets ``VLLM_LOGGING_LEVEL=ERROR``; conftest puts the
    environment back, so the engines and JupyterLab kernels later tests start log vLLM's start-up."""
    import os

    from conftest import ENV_AT_START

    assert os.environ.get("VLLM_LOGGING_LEVEL") == ENV_AT_START.get("VLLM_LOGGING_LEVEL")


def test_trl_defaults_round_trip():
    args = GRPOConfig(use_cpu=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config.from_trl(args, "smoke")
    # the defaults the kit does otherwise: a decaying learning rate, and epochs (max_steps unset)
    assert sorted(str(w.message)[:40] for w in caught) == [
        "TRL's default lr_scheduler_type='linear'", "max_steps is unset: TRL would train 3 ep"]
    assert Config.from_dict(cfg.to_dict()) == cfg  # a valid Config, as config.json stores it
    flat = cfg.flat()
    for trl_name, kit in RENAMES.items():  # every one-to-one name, checked against the GRPOConfig attribute
        assert flat[kit] == kit_value(trl_name, getattr(args, trl_name)), trl_name
    # TRL 1.16's defaults, as the kit now holds them
    assert (cfg.sampling.group_size, cfg.sampling.max_new_tokens, cfg.loss.kl_beta, cfg.optim.lr) == (8, 512, 0.0, 1e-6)
    assert (cfg.loss.loss_type, cfg.loss.policy_loss, cfg.loss.clip_eps, cfg.loss.clip_eps_high) == ("dapo", "grpo", 0.2, None)
    assert cfg.loss.adv_scale == args.scale_rewards == "group"
    assert cfg.run.seed == args.seed == 42
    assert cfg.optim.micro_batch == args.per_device_train_batch_size == 8
    assert cfg.sampling.prompts_per_step == args.generation_batch_size // args.num_generations == 1
    assert cfg.sampling.engine == "hf" and not args.use_vllm  # TRL generates with transformers by default
    assert cfg.loss.importance_sampling_correction is args.vllm_importance_sampling_correction is True
    assert (cfg.loss.importance_sampling_mode, cfg.loss.importance_sampling_cap) == ("sequence_mask", 3.0)
    assert (cfg.loss.old_logp_source, cfg.loss.advantage) == ("trainer", "grpo")  # TRL's ratio and advantage
    assert not cfg.run.pipelined and cfg.run.depth == 0  # TRL samples with the weights it trains (review finding)
    # what a GRPOConfig does not say stays the profile's (max_steps=-1 and output_dir unset included)
    smoke = config.profile("smoke")
    assert (cfg.model, cfg.data, cfg.cluster) == (smoke.model, smoke.data, smoke.cluster)
    assert (cfg.run.iterations, cfg.run.run_dir, cfg.profile) == (smoke.run.iterations, smoke.run.run_dir, "smoke")


def test_each_mapping(tmp_path):
    args = trl_args(
        num_generations=4, max_completion_length=64, temperature=0.7, beta=0.04, use_bias_correction_kl=False,
        epsilon=0.1, epsilon_high=0.28, learning_rate=1e-5, weight_decay=0.01, max_grad_norm=0.5,
        per_device_train_batch_size=4, gradient_accumulation_steps=3, scale_rewards=False, seed=7,
        use_vllm=True, vllm_gpu_memory_utilization=0.5, vllm_max_model_length=512,
        vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0, max_steps=12, output_dir=str(tmp_path / "out"),
        reward_weights=[1.0, 0.5], max_tool_calling_iterations=2, model_init_kwargs={"dtype": "bfloat16"},
        lr_scheduler_type="constant", top_p=1.0, gradient_checkpointing=False, bf16=False,  # what the kit does
    )
    cfg = from_trl(args, "tiny")
    s, lo, o = cfg.sampling, cfg.loss, cfg.optim
    assert (s.group_size, s.max_new_tokens, s.temperature) == (4, 64, 0.7)
    assert (lo.kl_beta, lo.clip_eps, lo.clip_eps_high, lo.adv_scale) == (0.04, 0.1, 0.28, "none")
    assert (o.lr, o.weight_decay, o.max_grad_norm, o.micro_batch) == (1e-5, 0.01, 0.5, 4)
    assert s.prompts_per_step == 4 * 3 // 4  # per_device x gradient_accumulation_steps completions per step
    assert (s.engine, s.gpu_memory_utilization, cfg.model.max_model_len, cfg.model.dtype) == ("vllm", 0.5, 512, "bfloat16")
    assert (lo.importance_sampling_correction, lo.importance_sampling_mode, lo.importance_sampling_cap) == (
        False, "token_truncate", 2.0)
    assert (cfg.run.iterations, cfg.run.seed, cfg.run.run_dir) == (12, 7, str(tmp_path / "out"))
    assert cfg.reward.reward_weights == (1.0, 0.5)
    assert cfg.episode.max_turns == 3  # the first turn, then up to 2 after tool calls
    assert cfg.model.model == "tiny"  # the profile's
    # overrides (the kit's names or TRL's) come last
    over = from_trl(args, "tiny", kl_beta=0.1, num_generations=6, iterations=3)
    assert (over.loss.kl_beta, over.sampling.group_size, over.run.iterations) == (0.1, 6, 3)


@pytest.mark.parametrize(
    "args, over, policy_loss, clip",
    [  # review finding: TRL-named overrides were mapped one to one, past the loss they are coupled with
        ({"loss_type": "cispo", "epsilon_high": 5.0}, {"epsilon_high": 3.0}, "cispo", (0.2, 2.0)),  # TRL caps at 3
        ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, {"epsilon": 3e-4}, "gspo", (3e-4, 3e-4)),
        ({}, {"loss_type": "cispo", "epsilon_high": 4.0}, "cispo", (0.2, 3.0)),
        ({}, {"max_steps": 7}, "grpo", (0.2, 0.2)),
        # review finding: the kit's name for epsilon left GSPO's upper clip pinned at TRL's 0.2
        ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, {"clip_eps": 3e-4}, "gspo", (3e-4, 3e-4)),
        ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_high": 4e-4}, {"clip_eps": 3e-4},
         "gspo", (3e-4, 4e-4)),
    ],
)
def test_trl_named_overrides_change_the_grpo_config_first(args, over, policy_loss, clip):
    cfg = from_trl(trl_args(lr_scheduler_type="constant", **args), "tiny", **over)
    lo = cfg.loss
    assert (lo.policy_loss, (lo.clip_eps, lo.clip_eps if lo.clip_eps_high is None else lo.clip_eps_high)) == (policy_loss, clip)
    assert cfg.run.iterations == over.get("max_steps", 10)
    # the same TRL name as a profile override: converted for the loss the config ends with
    assert config.profile("tiny", policy_loss="cispo", epsilon_high=5.0).loss.clip_eps_high == 4.0
    with pytest.raises(ValueError, match="epsilon_high=0.28 with cispo"):
        config.profile("tiny", policy_loss="cispo", epsilon_high=0.28)


@pytest.mark.parametrize(
    "kw, loss_type, policy_loss, clip",
    [
        ({"loss_type": "grpo"}, "grpo", "grpo", (0.2, 0.2)),  # TRL's three normalizers, as they are
        ({"loss_type": "dapo"}, "dapo", "grpo", (0.2, 0.2)),
        ({"loss_type": "dr_grpo"}, "dr_grpo", "grpo", (0.2, 0.2)),
        # GSPO: TRL clips the sequence ratio at epsilon/epsilon_high as given, not at GSPO_CLIP
        ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, "grpo", "gspo", (0.2, 0.2)),
        ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
         "grpo", "gspo", (3e-4, 4e-4)),
        # CISPO: TRL caps the ratio at epsilon_high itself, the kit at 1 + clip_eps_high; TRL's token mean
        ({"loss_type": "cispo", "epsilon_high": 5.0}, "dapo", "cispo", (0.2, 4.0)),
    ],
)
def test_loss_types_map(kw, loss_type, policy_loss, clip):
    cfg = from_trl(trl_args(lr_scheduler_type="constant", **kw))
    assert (cfg.loss.loss_type, cfg.loss.policy_loss) == (loss_type, policy_loss)
    if policy_loss == "gspo":
        assert algorithms.gspo_clip_range(cfg.loss) == pytest.approx(clip)
    else:
        high = cfg.loss.clip_eps if cfg.loss.clip_eps_high is None else cfg.loss.clip_eps_high
        assert (cfg.loss.clip_eps, high) == pytest.approx(clip)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"loss_type": "bnpo"}, "loss_type='bnpo': bnpo normalizes by the tokens of each local micro-batch"),
        ({"loss_type": "sapo"}, "loss_type='sapo': SAPO"),
        ({"loss_type": "luspo"}, "loss_type='luspo': LUSPO"),
        ({"loss_type": "vespo"}, "loss_type='vespo': VESPO"),
        ({"loss_type": "cispo"}, "epsilon_high=None with loss_type='cispo'"),  # TRL would cap the ratio at 0.2
        ({"loss_type": "cispo", "epsilon_high": 5.0, "importance_sampling_level": "sequence"},
         "importance_sampling_level='sequence' with loss_type='cispo'"),
    ],
)
def test_loss_types_refused(kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        from_trl(trl_args(lr_scheduler_type="constant", **kw))


def test_unmapped_non_defaults_are_refused_in_one_error():
    args = trl_args(
        logging_steps=1, top_p=0.9, num_iterations=2, mask_truncated_completions=True, beta=0.04,
        num_train_epochs=1, max_steps=-1, steps_per_generation=4, optim="adafactor", lr_scheduler_type="cosine",
        push_to_hub=False,  # TRL's default: not listed
    )
    with pytest.raises(ValueError) as e:
        from_trl(args)
    text = str(e.value)
    listed = re.findall(r"^  (\w+)=", text, flags=re.M)
    assert listed == sorted([
        "logging_steps", "top_p", "num_iterations", "mask_truncated_completions", "use_bias_correction_kl",
        "num_train_epochs", "steps_per_generation", "optim", "lr_scheduler_type",
    ]), text
    assert text.startswith("9 GRPOConfig setting(s) grpo-kit cannot carry over")
    assert "top_p=0.9: the engines sample the full distribution" in text
    assert "use_bias_correction_kl=True with beta != 0" in text
    assert "num_train_epochs=1: the kit counts iterations, not epochs; set max_steps" in text
    # with max_steps, TRL ignores num_train_epochs too; the KL's bias correction off is the kit's KL
    ok = from_trl(trl_args(num_train_epochs=1, max_steps=5, beta=0.04, use_bias_correction_kl=False,
                           lr_scheduler_type="constant"))
    assert (ok.run.iterations, ok.loss.kl_beta) == (5, 0.04)


def test_a_peft_lora_config_carries_over():
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["v_proj", "q_proj"], task_type="CAUSAL_LM")
    cfg = from_trl(trl_args(lr_scheduler_type="constant"), "tiny", peft_config=lora)
    assert (cfg.lora.lora_r, cfg.lora.lora_alpha, cfg.lora.lora_targets) == (16, 32, ("q_proj", "v_proj"))  # a set in peft
    linear = from_trl(trl_args(lr_scheduler_type="constant"), "tiny", peft_config=peft.LoraConfig(target_modules="all-linear"))
    assert linear.lora.lora_targets == config.LoRAConfig().lora_targets
    with pytest.raises(ValueError) as e:  # one error for both configs' refusals
        from_trl(trl_args(lr_scheduler_type="constant", top_k=50), "tiny",
                 peft_config=peft.LoraConfig(use_dora=True, target_modules=None))
    assert re.findall(r"^  ([\w.]+)=", str(e.value), flags=re.M) == [
        "peft_config.target_modules", "peft_config.use_dora", "top_k"], str(e.value)


def test_report_to_is_carried_or_refused():
    args = trl_args(report_to="tensorboard", lr_scheduler_type="constant")
    if "report_to" in config.flat_field_names():  # the trackers' field
        assert "tensorboard" in from_trl(args).flat()["report_to"]
    else:
        with pytest.raises(ValueError, match=re.escape("report_to=['tensorboard']: experiment trackers")):
            from_trl(args)


def test_trl_named_batch_overrides_mean_what_they_mean_in_the_grpo_config():
    """Review finding: TRL-named overrides patched the values read after ``GRPOConfig.__post_init__``,
    so the generation batch TRL derives from them kept the old size (per_device_train_batch_size=32
    trained 1 prompt per step where TRL trains 4), TRL's own checks were skipped and its deprecated
    aliases dropped."""
    base = trl_args(lr_scheduler_type="constant")
    for over in ({"per_device_train_batch_size": 32}, {"gradient_accumulation_steps": 4},
                 {"generation_batch_size": 32, "gradient_accumulation_steps": 4},
                 {"steps_per_generation": 4, "gradient_accumulation_steps": 4}):
        set_in_trl = trl_args(lr_scheduler_type="constant", **over)
        assert from_trl(base, "tiny", **over) == from_trl(set_in_trl, "tiny"), over
        assert from_trl(base, "tiny", **over).sampling.prompts_per_step == set_in_trl.generation_batch_size // 8 == 4
    with pytest.raises(ValueError, match="must be divisible by num_generations"):  # TRL's own check, as in TRL
        from_trl(base, "tiny", num_generations=16)
    with pytest.warns(Warning):  # TRL's deprecation warning for its alias, which it copies
        cap = config.from_trl(base, "tiny", vllm_importance_sampling_cap=1.5).loss.importance_sampling_cap
    assert cap == 1.5
    explicit = trl_args(lr_scheduler_type="constant", generation_batch_size=16)  # set by the user: kept
    with pytest.raises(ValueError, match="steps_per_generation=2 with gradient_accumulation_steps=1"):
        from_trl(explicit, "tiny")
    assert from_trl(explicit, "tiny", gradient_accumulation_steps=2).sampling.prompts_per_step == 2


def test_trl_episode_budget_and_turn_limit_carry_over():
    """Review finding: in TRL's tool episodes ``max_completion_length`` bounds the whole completion (and
    is dr_grpo's length), and ``max_tool_calling_iterations=None`` means no turn limit; the kit kept
    the profile's episode budget (64 on tiny-tools) and turn limit."""
    cfg = from_trl(trl_args(lr_scheduler_type="constant", max_completion_length=200, max_tool_calling_iterations=3,
                            loss_type="dr_grpo"), "tiny-tools")
    ep = cfg.episode
    assert (ep.max_episode_tokens, ep.max_turn_tokens, ep.max_turns, cfg.sampling.max_new_tokens) == (200, None, 4, 200)
    assert from_trl(trl_args(lr_scheduler_type="constant", max_completion_length=96), "tiny-tools").episode.max_turns == 96
    assert from_trl(trl_args(lr_scheduler_type="constant"), "tiny-tools", max_turns=3).episode.max_turns == 3


def test_trl_names_as_overrides():
    c = config.profile("tiny", beta=0.04, num_generations=4, learning_rate=1e-5, scale_rewards=False,
                       max_completion_length=32)
    assert (c.loss.kl_beta, c.sampling.group_size, c.optim.lr, c.loss.adv_scale, c.sampling.max_new_tokens) == (
        0.04, 4, 1e-5, "none", 32)
    assert c.override(epsilon=0.1).loss.clip_eps == 0.1
    # TRL's None (no clip) under the name TRL and the kit share, as a from_trl override
    assert from_trl(trl_args(lr_scheduler_type="constant"), max_grad_norm=None).optim.max_grad_norm == 0.0
    with pytest.raises(ValueError, match="beta= is TRL's name for kl_beta="):
        config.profile("tiny", beta=0.04, kl_beta=0.1)
    with pytest.raises(ValueError, match="unknown config field"):
        config.profile("tiny", importance_sampling_level="sequence")  # coupled: from_trl only


def test_from_trl_takes_a_config_instance():
    with pytest.raises(TypeError, match="takes a trl.GRPOConfig instance"):
        config.from_trl({"beta": 0.1})
    assert set(DEFAULT_DIFFERENCES) <= {f.name for f in dataclasses.fields(GRPOConfig)}
