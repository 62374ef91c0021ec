"""A TRL ``GRPOConfig`` carried over to a :class:`~grpo_kit.config.Config`.

:func:`from_trl` reads every field of a ``trl.GRPOConfig`` (TRL 1.16; ``transformers.TrainingArguments``
fields included) and sorts it into one of three kinds:

- **mapped** (:data:`RENAMES` and the coupled ones in :func:`from_trl`): carried into the kit's field
  of the same meaning, *whatever its value*, TRL's defaults included (``learning_rate`` 1e-6,
  ``beta`` 0, ``loss_type`` ``"dapo"``, ``max_completion_length`` 512, ...): what a GRPOConfig says,
  the run does. The profile supplies everything a GRPOConfig does not name (model, data, cluster).
- **what the kit does anyway** (:data:`KIT_VALUES`): accepted at the values that describe the
  kit's own behaviour (``top_p=1.0``, ``num_iterations=1``, ``mask_truncated_completions=False``, ...),
  refused at any other; and :data:`ANY_VALUE`: how TRL's own process computes (mixed precision,
  device, padding, checkpointing), never what is trained, accepted at any value.
- **everything else**: accepted at its default (it then changes nothing TRL would have done that the
  kit does not, except the few :data:`DEFAULT_DIFFERENCES` it warns about), refused otherwise.

Every refusal is collected first, and one ``ValueError`` lists them all with the reason for each.
TRL's semantics that a GRPOConfig implies rather than names are set too: the ratio's old log-probs
are the trainer's own (``old_logp_source="trainer"``, as TRL computes them) and the advantage is
TRL's group-normalized one (``advantage="grpo"``). Keyword ``overrides`` (the kit's names, or the
TRL names of :data:`RENAMES`) are applied last.

The same TRL names are accepted as overrides wherever the kit takes flat overrides
(``config.profile("tiny", beta=0.04, num_generations=8)``, ``Config.override``): :func:`kit_names`
renames the one-to-one ones of :data:`RENAMES`; the coupled ones (``importance_sampling_level``,
a TRL-only ``loss_type``) need :func:`from_trl`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import warnings
from collections.abc import Mapping
from typing import Any

RENAMES: dict[str, str] = {
    "num_generations": "group_size",
    "max_completion_length": "max_new_tokens",
    "temperature": "temperature",
    "beta": "kl_beta",
    "epsilon": "clip_eps",
    "epsilon_high": "clip_eps_high",
    "learning_rate": "lr",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
    "per_device_train_batch_size": "micro_batch",
    "scale_rewards": "adv_scale",
    "seed": "seed",
    "vllm_gpu_memory_utilization": "gpu_memory_utilization",
    "vllm_importance_sampling_mode": "importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "importance_sampling_cap",
}
"""TRL names with a kit field of the same meaning, one to one (the value converted by :func:`kit_value`)."""

KIT_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "top_p": ((1.0,), "the engines sample the full distribution (top_p=1, top_k=0, min_p=0)"),
    "top_k": ((0, None), "the engines sample the full distribution (top_p=1, top_k=0, min_p=0)"),
    "min_p": ((None, 0.0), "the engines sample the full distribution (top_p=1, top_k=0, min_p=0)"),
    "repetition_penalty": ((1.0,), "the engines sample the model's own distribution (no repetition penalty)"),
    "generation_kwargs": ((None, {}), "the engines take no extra sampling arguments"),
    "num_iterations": ((1,), "one optimizer step per generated batch (no PPO epochs)"),
    "mask_truncated_completions": ((False,), "truncated completions are trained on (no truncation mask)"),
    "delta": ((None,), "no two-sided clip (INTELLECT-2's delta)"),
    "top_entropy_quantile": ((1.0,), "every sampled token is trained (no entropy mask)"),
    "entropy_coef": ((0.0,), "no entropy bonus"),
    "use_adaptive_entropy": ((False,), "no entropy bonus"),
    "off_policy_mask_threshold": ((None,), "no off-policy sequence mask"),
    "sync_ref_model": ((False,), "the KL reference is the base model (the adapter disabled), never synced"),
    "multi_objective_aggregation": (("sum_then_normalize",), "the weighted reward sum is normalized (no per-reward normalization)"),
    "vllm_importance_sampling_clip_min": ((None,), "the engine-mismatch weight has no lower bound"),
    "shuffle_dataset": ((True,), "prompts are drawn in a seeded random order"),
    "remove_unused_columns": ((False,), "reward functions get every column"),
    "optim": (("adamw_torch", "adamw_torch_fused"), "the optimizer is torch's AdamW"),
    "adam_beta1": ((0.9,), "torch's AdamW at its default betas (0.9, 0.999)"),
    "adam_beta2": ((0.999,), "torch's AdamW at its default betas (0.9, 0.999)"),
    "adam_epsilon": ((1e-8,), "torch's AdamW at its default eps (1e-8)"),
    "lr_scheduler_type": (("constant", "linear"), "the learning rate is constant"),  # linear: TRL's default, warned
    "warmup_steps": ((0,), "the learning rate is constant (no warmup)"),
}
"""TRL fields the kit does not set but whose values here describe what it does: ``{name: (accepted
values, what the kit does)}``; another value is refused with that reason."""

ANY_VALUE = frozenset({
    "bf16", "tf32", "use_cpu", "local_rank", "gradient_checkpointing", "gradient_checkpointing_kwargs",
    "pad_to_multiple_of", "disable_tqdm", "accelerator_config", "dataloader_pin_memory", "debug",
    "disable_dropout",  # the engines never drop, and the trainer scores without dropout (LoRA's: lora_dropout)
    "gradient_accumulation_steps",  # through generation_batch_size (see from_trl)
    "vllm_importance_sampling_cap",  # TRL's deprecated alias: its __post_init__ copies it to _clip_max
    "use_transformers_paged",  # deprecated alias of use_transformers_continuous_batching (checked there)
})
"""TRL fields accepted at any value: how TRL's own process computes (bf16/tf32 autocast, device,
padding, gradient checkpointing), never what is trained (the kit's ``dtype`` and the hardware decide),
fields ``GRPOConfig.__post_init__`` derives, and aliases of fields checked under their own name."""

DEFAULT_DIFFERENCES = {
    "lr_scheduler_type": ("linear", "TRL's default lr_scheduler_type='linear' decays the learning rate to 0 "
                          "over max_steps; the kit's learning rate is constant (lr_scheduler_type='constant' says so)"),
}
"""TRL defaults the kit does not reproduce but accepts (so that ``GRPOConfig()`` carries over):
``{name: (value, warning)}``, warned about once per :func:`from_trl` call."""

TRL_ONLY_LOSSES = {
    "bnpo": "bnpo normalizes by the tokens of each local micro-batch; the kit normalizes by counts all-reduced "
            "over the whole batch (use loss_type='dapo', which bnpo equals with one micro-batch on one rank)",
    "sapo": "SAPO's soft gate is not a kit policy loss (register one: grpo_kit.algorithms.register_policy_loss)",
    "luspo": "LUSPO is not a kit policy loss (register one: grpo_kit.algorithms.register_policy_loss)",
    "vespo": "VESPO is not a kit policy loss (register one: grpo_kit.algorithms.register_policy_loss)",
}
"""TRL ``loss_type`` values the kit refuses, with why (``grpo``, ``dapo``, ``dr_grpo`` map as they are;
``cispo`` maps to ``policy_loss="cispo"`` with ``loss_type="dapo"``)."""


def kit_value(trl_name: str, value: Any) -> Any:
    """A :data:`RENAMES` value in the kit's terms (``scale_rewards`` True/False are ``"group"``/``"none"``;
    ``max_grad_norm`` None disables the clip, as 0 does here).

    >>> kit_value("scale_rewards", False), kit_value("max_grad_norm", None), kit_value("beta", 0.04)
    ('none', 0.0, 0.04)
    """
    if trl_name == "scale_rewards":
        return {True: "group", False: "none"}.get(value, value)
    if trl_name == "max_grad_norm" and value is None:
        return 0.0
    return value


def kit_names(overrides: Mapping[str, Any], policy_loss: str | None = None) -> dict[str, Any]:
    """``overrides`` with the TRL names of :data:`RENAMES` renamed to the kit's (other names kept as
    they are); a TRL name given beside its kit name raises. ``policy_loss``: the one the config ends
    with (an override's, else the config's), for TRL's ``epsilon_high``, whose meaning it changes: with
    ``cispo`` TRL caps the ratio itself at ``epsilon_high`` (the kit's cap is ``1 + clip_eps_high``).

    >>> kit_names({"beta": 0.04, "num_generations": 8, "lr": 1e-5})
    {'kl_beta': 0.04, 'group_size': 8, 'lr': 1e-05}
    >>> kit_names({"epsilon_high": 5.0}, policy_loss="cispo")
    {'clip_eps_high': 4.0}
    """
    out: dict[str, Any] = {}
    for k, v in overrides.items():
        if k in RENAMES and RENAMES[k] == k:
            out[k] = kit_value(k, v)  # same name, TRL's values (max_grad_norm=None: no clip)
        elif k in RENAMES:
            kit = RENAMES[k]
            if kit in overrides:
                raise ValueError(f"{k}= is TRL's name for {kit}=; give one of them, not both")
            out[kit] = kit_value(k, v)
            if k == "epsilon_high" and policy_loss == "cispo" and v is not None:
                if not v > 1:
                    raise ValueError(f"epsilon_high={v!r} with cispo: TRL caps the ratio at epsilon_high itself, "
                                     "so it must be > 1 (ScaleRL's 5.0); the kit's clip_eps_high is that cap minus 1")
                out[kit] = v - 1
        else:
            out[k] = v
    return out


def _plain(value: Any) -> Any:
    """A field value compared with its default: enums by value, TrainingArguments' list forms of
    ``report_to`` and ``debug`` as their declared defaults."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)) and len(value) == 0:
        return None
    if value in ("none", "", ["none"]):
        return None
    return value


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    d = _default(f)
    try:
        return _plain(value) == _plain(d)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not the default
        return False


PEFT_ANY_VALUE = frozenset({"task_type", "peft_type", "peft_version", "auto_mapping", "base_model_name_or_path",
                            "revision", "inference_mode", "runtime_config"})
"""``peft.LoraConfig`` fields that say where an adapter came from or how peft runs it, not its shape."""


def _from_peft(lora: Any, out: dict[str, Any], refuse) -> None:
    """A ``peft.LoraConfig`` (what TRL's ``GRPOTrainer(peft_config=...)`` takes) into ``out``: ``r``,
    ``lora_alpha``, ``lora_dropout``, ``target_modules``; any other field off its default is refused."""
    from grpo_kit.config import LoRAConfig

    if not dataclasses.is_dataclass(lora) or isinstance(lora, type):
        raise TypeError(f"peft_config must be a peft.LoraConfig instance, got {type(lora).__name__}")
    mapped = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}
    for f in dataclasses.fields(lora):
        v = getattr(lora, f.name)
        if f.name in mapped:
            out[mapped[f.name]] = v
        elif f.name == "target_modules":
            if v == "all-linear":  # every linear layer but the head: the kit's seven projections on Llama/Qwen shapes
                out["lora_targets"] = LoRAConfig.__dataclass_fields__["lora_targets"].default
            elif isinstance(v, (list, tuple, set, frozenset)) and v:
                out["lora_targets"] = tuple(sorted(v)) if isinstance(v, (set, frozenset)) else tuple(v)
            else:
                refuse("peft_config.target_modules", f"{v!r}: name the modules (peft would pick them per architecture)")
        elif f.name not in PEFT_ANY_VALUE and not _is_default(f, v):
            refuse(f"peft_config.{f.name}", f"{v!r}: the kit's adapters are plain LoRA (r, lora_alpha, lora_dropout, "
                   "target_modules)")


def from_trl(args: Any, profile: str = "tiny", *, peft_config: Any = None, **overrides: Any) -> Any:
    """The :func:`~grpo_kit.config.profile` ``profile`` with a ``trl.GRPOConfig``'s settings carried
    over (module docstring), then ``overrides`` (kit or :data:`RENAMES` names) applied. ``peft_config``:
    the ``peft.LoraConfig`` a TRL run hands ``GRPOTrainer``, carried into the LoRA fields.

    Raises one ``ValueError`` listing every field set to a value the kit cannot honour.
    """
    from grpo_kit import config

    if not dataclasses.is_dataclass(args) or isinstance(args, type):
        raise TypeError(f"from_trl takes a trl.GRPOConfig instance, got {type(args).__name__}")
    flds = {f.name: f for f in dataclasses.fields(args)}
    kit_fields = set(config.flat_field_names())
    # TRL-named overrides change the GRPOConfig before it is read, so that coupled settings (epsilon
    # and epsilon_high with the loss, max_steps) mean what they mean in TRL
    # (loss_type too: TRL's names a superset of the kit's, cispo and the refused ones included)
    trl_over = {k: overrides.pop(k) for k in list(overrides) if k in flds and (k not in kit_fields or k == "loss_type")}
    if trl_over:
        args = with_trl_overrides(args, trl_over)
    val = {name: getattr(args, name) for name in flds}
    refused: dict[str, str] = {}
    handled: set[str] = set()
    # TRL's ratio and advantage, and its freshness: each batch sampled by the weights being trained
    # (TRL's generation, in-process or vLLM with the weights synced each step); a pipelined batch here is
    # a version behind, corrected only by the engine-mismatch weight
    out: dict[str, Any] = {"old_logp_source": "trainer", "advantage": "grpo", "pipelined": False}

    def refuse(name: str, why: str) -> None:
        refused[name] = f"{refused[name]}; {why}" if name in refused else why

    for name, kit in RENAMES.items():
        if name in val:
            out[kit] = kit_value(name, val[name])
            handled.add(name)
    if "max_completion_length" in val:  # in TRL's tool episodes it bounds the whole completion (and is dr_grpo's length)
        out.update(max_episode_tokens=val["max_completion_length"], max_turn_tokens=None)

    # the loss: TRL's loss_type names the normalizer and, for cispo, the policy loss; the sampling
    # level picks the ratio (GSPO's sequence ratio); the clip's meaning depends on both
    loss_type, level = val.get("loss_type", "dapo"), val.get("importance_sampling_level", "token")
    eps = val.get("epsilon", 0.2)
    eps_high = val.get("epsilon_high")
    handled |= {"loss_type", "importance_sampling_level"}
    if loss_type in TRL_ONLY_LOSSES:
        refuse("loss_type", f"{loss_type!r}: {TRL_ONLY_LOSSES[loss_type]}")
    elif loss_type == "cispo":
        if level != "token":
            refuse("importance_sampling_level", f"{level!r} with loss_type='cispo': the kit's cispo weighs tokens")
        # TRL's cispo caps the ratio itself at epsilon_high (its epsilon_max, 5.0 recommended); the kit's at 1 + clip_eps_high
        high = eps if eps_high is None else eps_high
        if high <= 1:
            refuse("epsilon_high", f"{eps_high!r} with loss_type='cispo': TRL caps the ratio at epsilon_high itself "
                   f"(then {high}, below 1); set epsilon_high > 1 (ScaleRL's 5.0)")
        else:
            out.update(policy_loss="cispo", loss_type="dapo", clip_eps_high=high - 1)
    elif loss_type in config.LOSS_TYPES:
        out["loss_type"] = loss_type
        if level == "sequence":  # GSPO: TRL clips the sequence ratio at epsilon/epsilon_high as given
            out.update(policy_loss="gspo", clip_eps_high=eps if eps_high is None else eps_high)
        elif level == "token":
            out["policy_loss"] = "grpo"
        else:
            refuse("importance_sampling_level", f"{level!r}: TRL knows 'token' and 'sequence'")
    else:
        refuse("loss_type", f"{loss_type!r} is not a TRL loss_type this kit knows")

    # the batch: TRL's generation batch (per_device * processes * steps_per_generation completions)
    # is the kit's batch when each generation batch makes one optimizer step
    handled |= {"generation_batch_size", "steps_per_generation"}
    spg, ga = val.get("steps_per_generation"), val.get("gradient_accumulation_steps", 1)
    gbs, group = val.get("generation_batch_size"), val.get("num_generations", 8)
    if spg is not None and spg != ga:
        refuse("steps_per_generation", f"{spg} with gradient_accumulation_steps={ga}: TRL then makes {spg / ga:g} "
               "optimizer steps per generated batch; here each batch makes one (set generation_batch_size to the "
               "optimizer step's batch, or leave both unset)")
    elif gbs is not None:
        out["prompts_per_step"] = max(gbs // group, 1)

    # the engines: use_vllm picks the engine. TRL corrects the engine mismatch only with vLLM (its
    # transformers generation runs in the trainer's process, on the policy being trained); here either
    # engine samples apart from the trainer, a version behind when pipelined, so the setting holds for both
    handled |= {"use_vllm", "vllm_importance_sampling_correction", "vllm_max_model_length", "model_init_kwargs"}
    out["engine"] = "vllm" if val.get("use_vllm") else "hf"
    out["importance_sampling_correction"] = bool(val.get("vllm_importance_sampling_correction", True))
    if val.get("vllm_max_model_length") is not None:
        out["max_model_len"] = val["vllm_max_model_length"]
    if val.get("vllm_importance_sampling_clip_max") is None:
        out.pop("importance_sampling_cap")
        if out["importance_sampling_correction"]:
            refuse("vllm_importance_sampling_clip_max", "None: the engine-mismatch weight needs an upper bound here")

    init = val.get("model_init_kwargs") or {}
    init = json.loads(init) if isinstance(init, str) else dict(init)
    dtype = init.pop("dtype", init.pop("torch_dtype", None))
    if dtype is not None:
        dtype = str(dtype).removeprefix("torch.")
        if dtype in config.DTYPES:
            out["dtype"] = dtype
        else:
            refuse("model_init_kwargs", f"dtype {dtype!r}: the kit's dtype is one of {config.DTYPES}")
    if init:
        refuse("model_init_kwargs", f"{init}: the kit loads the model itself (only dtype carries over)")

    # the KL: TRL's default multiplies it by the (differentiable) ratio; the kit's k3 is plain
    handled.add("use_bias_correction_kl")
    if val.get("beta", 0.0) != 0 and val.get("use_bias_correction_kl", False):
        refuse("use_bias_correction_kl", "True with beta != 0: the kit's KL term is the plain k3 estimate (DeepSeek-V3.2's "
               "ratio-weighted one is not implemented); set use_bias_correction_kl=False to train with it")

    # how long, where, what else
    handled |= {"max_steps", "num_train_epochs", "output_dir", "reward_weights", "max_tool_calling_iterations",
                "report_to"}
    if val.get("max_steps", -1) > 0:
        out["iterations"] = val["max_steps"]  # TRL ignores num_train_epochs then
    elif "num_train_epochs" in flds and not _is_default(flds["num_train_epochs"], val["num_train_epochs"]):
        refuse("num_train_epochs", f"{val['num_train_epochs']:g}: the kit counts iterations, not epochs; set max_steps")
    elif "iterations" not in overrides:
        warnings.warn(f"max_steps is unset: TRL would train {val.get('num_train_epochs', 3.0):g} epochs of the dataset; "
                      f"the run takes the {profile!r} profile's iterations (set max_steps, or iterations=)", stacklevel=3)
    if val.get("output_dir") not in (None, "trainer_output"):  # "trainer_output" is TRL's placeholder
        out["run_dir"] = str(val["output_dir"])
    if val.get("reward_weights") is not None:
        out["reward_weights"] = tuple(val["reward_weights"])
    if val.get("max_tool_calling_iterations") is not None:  # TRL: the first turn, then up to N more after tool calls
        out["max_turns"] = int(val["max_tool_calling_iterations"]) + 1
    elif "max_completion_length" in val:  # TRL's None: no turn limit, only the episode's token budget
        out["max_turns"] = int(val["max_completion_length"])  # (every turn samples at least one of its tokens)
    trackers = [] if _plain(val.get("report_to")) is None else val["report_to"]
    trackers = [trackers] if isinstance(trackers, str) else list(trackers)
    if "report_to" in kit_fields:
        out["report_to"] = tuple(trackers)
    elif trackers:
        refuse("report_to", f"{trackers}: experiment trackers are not in this kit yet")

    if peft_config is not None:
        _from_peft(peft_config, out, refuse)

    # continuous batching: a generation backend the kit does not have
    if val.get("use_transformers_continuous_batching"):
        refuse("use_transformers_continuous_batching", "True: the kit's engines are vLLM and transformers generate")
    handled.add("use_transformers_continuous_batching")

    for name, f in flds.items():
        if name in handled or name in ANY_VALUE:
            continue
        v = val[name]
        shown = v.value if isinstance(v, enum.Enum) else v
        if name in KIT_VALUES:
            ok, why = KIT_VALUES[name]
            if _plain(v) not in [_plain(o) for o in ok]:
                refuse(name, f"{shown!r}: {why}")
        elif not _is_default(f, v):
            refuse(name, f"{shown!r}: no counterpart here")
    if refused:
        lines = "\n".join(f"  {k}={why}" for k, why in sorted(refused.items()))
        raise ValueError(f"{len(refused)} GRPOConfig setting(s) grpo-kit cannot carry over (remove them, or "
                         f"use the kit's field where one is named):\n{lines}")
    for name, (value, msg) in DEFAULT_DIFFERENCES.items():
        if name in val and _plain(val[name]) == value:
            warnings.warn(msg, stacklevel=3)  # the caller of config.from_trl
    kit = kit_names(overrides, overrides.get("policy_loss", out.get("policy_loss")))
    if out.get("policy_loss") == "gspo" and eps_high is None and "clip_eps" in kit and "clip_eps_high" not in kit:
        kit["clip_eps_high"] = kit["clip_eps"]  # TRL's epsilon_high None: the clip is symmetric, as with epsilon=
    return config.profile(profile, **{**out, **kit})


DERIVED_BATCH = ("generation_batch_size", "steps_per_generation")
"""The GRPOConfig fields ``__post_init__`` derives from the batch fields when neither is set."""


def with_trl_overrides(args: Any, over: Mapping[str, Any]) -> Any:
    """``args`` made again with the TRL-named overrides ``over``, as if set in the GRPOConfig: TRL's
    ``__post_init__`` derives the generation batch from them, checks them and copies its deprecated
    aliases. The two batch fields it derived are left to it again: both when ``steps_per_generation``
    equals ``gradient_accumulation_steps`` (TRL's own choice, where neither was set), else
    ``steps_per_generation`` only (a generation batch set apart from the optimizer step's is kept)."""
    changes = dict(over)
    if not any(k in over for k in DERIVED_BATCH):
        if args.steps_per_generation == args.gradient_accumulation_steps:
            changes.update(generation_batch_size=None, steps_per_generation=None)
        else:
            changes["steps_per_generation"] = None
    elif not all(k in over for k in DERIVED_BATCH):  # one given: TRL derives the other from it
        changes.update({k: None for k in DERIVED_BATCH if k not in over})
    return dataclasses.replace(args, **changes)
