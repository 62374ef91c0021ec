"""Rollouts: the :class:`Rollout` record, the :class:`Engine` protocol, and engines by name (:data:`ENGINES`).

An engine samples ``n`` completions per problem under one adapter ``version`` (0 = the base model)
and returns one :class:`Rollout` per completion, grouped consecutively (``group_id = group_offset +
i`` for problem ``i``). Contract shared by :class:`~grpo_kit.hf_engine.HFEngine` and :class:`~grpo_kit.vllm_engine.VLLMEngine`:

- ``prompt_ids`` are the prompt rendered by :mod:`grpo_kit.prompts` (the model's chat template, or
  the plain prompt) and tokenized once; ``completion_ids`` are exactly the sampled tokens kept by the
  stop rules; nothing is re-tokenized, so the trainer scores what was sampled.
- A completion that stopped at EOS includes it as the last id, with its log-prob: the model is
  trained to stop. One that stopped at a stop string ends with the token that completed it
  (``Rollout.stop`` names the string). ``text`` is the decoded completion without the EOS token or
  the stop string and without special tokens. A completion cut at ``max_new_tokens`` has
  ``finish_reason == "length"``.
- ``logprobs[j]`` is ``log p(completion_ids[j])`` under the distribution actually sampled from:
  after temperature, with top-k and top-p off. At temperature 1.0 that is the policy itself,
  which :func:`grpo_kit.logprobs.token_logprobs` recomputes (the on-policy ratio is 1).
- Seeds: problem ``i`` of a call is sampled with :func:`group_seed` ``(seed, group_offset + i)``
  (vLLM: one seeded generator per request), so a retried call reproduces its batch. The HF engine
  samples a whole call from one generator seeded with ``group_seed(seed, group_offset)``: a retried
  call reproduces its batch, but a group's samples also depend on what else was in the call.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

from grpo_kit import data
from grpo_kit.config import MIN_TEMPERATURE, Config
from grpo_kit.prompts import cut_completion, prompt_format


@dataclass(kw_only=True)
class Scored:
    """What reward scoring and the loop add to a completion: the fields :class:`Rollout` and
    :class:`RolloutSummary` share after their own (keyword-only, all with defaults)."""

    stop: str | None = None
    """The stop string that ended the completion (None: EOS, or cut at ``max_new_tokens``)."""
    reward: float | None = None
    reward_reason: str | None = None
    correct: bool | None = None
    """The answer is right by the reward's strict rule (format and value)."""
    lenient_correct: bool | None = None
    """The answer is right by any rule the reward knows (e.g. the last number in the text)."""
    reward_components: dict | None = None
    """Each reward function's score (by component name; None where it did not apply or failed)."""
    reward_errors: int = 0
    """Reward functions that raised, timed out or returned garbage for this completion (scored 0)."""
    reward_extra: dict | None = None
    """What the reward functions logged for this completion with ``log_extra`` (column -> value,
    TRL's completions-table columns; :mod:`grpo_kit.tasks.base`). None: nothing logged."""
    iteration: int | None = None
    """Training iteration the rollout was generated for (set by the loop)."""
    episode: dict | None = None
    """A multi-turn episode's account (:func:`grpo_kit.episode.summary`): ``turns``, ``tool_calls``,
    ``tool_errors`` (by kind), ``end_reason``, ``model_tokens``, ``env_tokens``, ``env_reward``,
    ``error`` and ``messages`` (the conversation after the prompt, the environment's turns as
    ``"tool"`` messages). None for a single-turn completion (and then not serialized)."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (it crosses Dask and goes to JSONL)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:  # e.g. a field added to Rollout and not to RolloutSummary
            raise ValueError(f"unknown {cls.__name__} field(s): {sorted(unknown)}")
        return cls(**d)


@dataclass
class Rollout(Scored):
    """One sampled completion and what the trainer and the metrics need about it."""

    prompt_id: str
    """The problem's id."""
    group_id: int
    """Group (prompt) index within the batch: ``group_offset + i`` for the call's problem ``i``."""
    sample_idx: int
    """Index of this completion within its group (``0 .. n-1``)."""
    prompt_ids: list[int]
    """Prompt token ids exactly as the engine saw them."""
    completion_ids: list[int]
    """Sampled token ids; ends with the stop token when ``finish_reason == "stop"``."""
    logprobs: list[float]
    """Sampling log-prob of each completion token (same length as ``completion_ids``)."""
    version: int
    """Adapter version that produced it; 0 = base model, no adapter."""
    finish_reason: str
    """``"stop"`` (a stop token or stop string ended it) or ``"length"`` (cut at ``max_new_tokens``)."""
    text: str
    """Decoded completion, without the stop token or stop string and without special tokens."""
    gold: str | None
    """The problem's gold answer, carried along for the reward."""
    mask: list[int] | None = None
    """Per completion id: 1 sampled by the policy (trained on), 0 environment/template ids of a
    multi-turn episode (read, not trained on; see :func:`grpo_kit.episode.to_rollout`). None: all 1.
    Serialized only when set, so single-turn records are unchanged."""

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for k in ("mask", "episode", "reward_extra"):
            if d[k] is None:
                del d[k]
        for k in TOKEN_FIELDS:
            if k in d:
                d[k] = list(d[k])
        return d


TOKEN_FIELDS = ("prompt_ids", "completion_ids", "logprobs", "mask")
"""The :class:`Rollout` fields that make up its token payload (kept on the workers, see :class:`RolloutSummary`)."""


@dataclass
class RolloutSummary(Scored):
    """A scored :class:`Rollout` as the driver sees it: every field but the token ids and log-probs,
    which stay on the workers for the trainer ranks, and their counts instead."""

    prompt_id: str
    group_id: int
    sample_idx: int
    version: int
    finish_reason: str
    text: str
    gold: str | None
    prompt_tokens: int
    """``len(prompt_ids)``."""
    completion_tokens: int
    """Tokens the policy sampled: ``len(completion_ids)``, or ``sum(mask)`` in a multi-turn episode
    (its environment ids are in ``episode["env_tokens"]``)."""

    @staticmethod
    def of(rollout: dict[str, Any]) -> dict[str, Any]:
        """The summary (as plain JSON types) of a rollout in :meth:`Rollout.to_dict` form."""
        d = {k: v for k, v in rollout.items() if k not in TOKEN_FIELDS}
        mask = rollout.get("mask")
        d["prompt_tokens"] = len(rollout["prompt_ids"])
        d["completion_tokens"] = len(rollout["completion_ids"]) if mask is None else sum(mask)
        return d


@runtime_checkable
class Engine(Protocol):
    """What the loop needs from a rollout engine (:class:`grpo_kit.hf_engine.HFEngine`, ``VLLMEngine``)."""

    tokenizer: Any
    eos_token_id: int

    def generate(
        self,
        problems: Sequence[data.Problem],
        n: int,
        version: int,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        group_offset: int = 0,
    ) -> list[Rollout]:
        """``n`` sampled rollouts per problem, grouped consecutively, ``group_id = group_offset + i``."""
        ...

    def greedy(self, problems: Sequence[data.Problem], version: int, *, max_new_tokens: int) -> list[Rollout]:
        """One deterministic (argmax) rollout per problem, for evaluation."""
        ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- shared by the engines


def group_seed(seed: int, group_id: int) -> int:
    """A 62-bit seed for one group, well spread so that ``seed + j`` (vLLM's per-sample seeds) of
    different groups do not collide.

    >>> group_seed(0, 1) == group_seed(0, 1) != group_seed(0, 2)
    True
    """
    digest = hashlib.blake2b(f"{int(seed)}:{int(group_id)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def check_request(n: int, version: int, max_new_tokens: int, temperature: float, *, has_store: bool) -> None:
    """Reject bad arguments before any work (any temperature from :data:`~grpo_kit.config.MIN_TEMPERATURE`
    is fine: the log-probs are of the tempered distribution sampled from, and the trainer scores that
    one; vLLM samples a lower one at that floor)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0 (0 = base model), got {version!r}")
    if version > 0 and not has_store:
        raise ValueError(f"adapter version {version} requested but the engine has no AdapterStore (pass store=...)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not MIN_TEMPERATURE <= temperature < math.inf:
        raise ValueError(f"temperature must be in [{MIN_TEMPERATURE}, inf) (use greedy() for argmax decoding; vLLM "
                         f"samples a lower temperature at {MIN_TEMPERATURE}), got {temperature!r}")


def check_turn(prompt: Sequence[int], max_new_tokens: int, max_model_len: int, what: str) -> None:
    """Refuse a token-id prompt that is empty or cannot take ``max_new_tokens`` more, and a
    ``max_new_tokens`` below 1 (both engines' ``sample_ids`` and vLLM's turn batches)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{what}: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not prompt or len(prompt) + max_new_tokens > max_model_len:
        raise ValueError(f"{what}: a prompt of {len(prompt)} ids + max_new_tokens={max_new_tokens} does not fit "
                         f"max_model_len={max_model_len} (or the prompt is empty)")


def stop_token_ids(tokenizer, generation_config=None, model_config=None) -> list[int]:
    """The ids a completion ends at: the tokenizer's EOS plus those the model's generation config
    names (``generation_config.json``), or, where it names none or the model has none, those of its
    model config (``config.json``'s ``eos_token_id``, an int or a list; vLLM and transformers build
    the generation config from it when ``generation_config.json`` is missing). Both engines stop
    on every one of them."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    extra = getattr(generation_config, "eos_token_id", None)
    if extra is None and model_config is not None:
        extra = getattr(model_config, "eos_token_id", None)
        if extra is None and hasattr(model_config, "get_text_config"):  # multimodal: the decoder's
            extra = getattr(model_config.get_text_config(), "eos_token_id", None)
    for t in [extra] if isinstance(extra, int) else list(extra or []):
        if t not in ids:
            ids.append(t)
    if not ids:
        raise ValueError("the tokenizer has no eos_token and the model's generation config and config name none")
    return ids


def make_rollout(tokenizer, problem: data.Problem, prompt: list[int], ids: list[int], logprobs: list[float],
                 finish_reason: str, stop: Sequence[str], **fields) -> Rollout:
    """A :class:`Rollout` for one sampled completion, with the stop strings applied (the kept
    tokens and their log-probs, the text before the stop string)."""
    cut = cut_completion(tokenizer, ids, finish_reason, stop)
    return Rollout(
        prompt_id=problem.id, prompt_ids=list(prompt), completion_ids=list(ids[: cut.n_tokens]),
        logprobs=list(logprobs[: cut.n_tokens]), finish_reason=cut.finish_reason, text=cut.text, gold=problem.gold,
        stop=cut.stop, **fields,
    )


@dataclass
class Continuation:
    """One sampled continuation of a token-id prompt (a turn of a multi-turn episode, see
    :meth:`grpo_kit.hf_engine.HFEngine.sample_ids` and :mod:`grpo_kit.episode`)."""

    ids: list[int]
    """Sampled ids, cut by the stop rules: ends with the stop id, or with the token that completed a stop string."""
    logprobs: list[float]
    """Sampling log-prob of each id (the tempered distribution that was sampled from)."""
    finish_reason: str
    """``"stop"`` (a stop id or stop string) or ``"length"`` (``max_new_tokens`` reached)."""
    stop: str | None = None
    """The stop string that ended it (None: a stop id, or length)."""


# ----------------------------------------------------------------------------- engines by name

ENGINES = {"hf": "grpo_kit.hf_engine:HFEngine", "vllm": "grpo_kit.vllm_engine:VLLMEngine"}
"""Engine kinds (``SamplingConfig.engine``) -> their class, imported when first used. Each class has
an ``options(cfg, prompt_format)`` classmethod: its constructor's keyword arguments from a config."""

MAX_ENGINE_SEQS = 256
"""Cap on the sequences one engine runs at once (vLLM's ``max_num_seqs``); larger evaluations queue."""


def engine_class(kind: str) -> type:
    """The engine class registered as ``kind`` in :data:`ENGINES`."""
    import importlib

    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; known: {sorted(ENGINES)}")
    module, name = ENGINES[kind].split(":")
    return getattr(importlib.import_module(module), name)


def engine_options(cfg: Config, instruction: str = data.DEFAULT_INSTRUCTION) -> dict[str, Any]:
    """The keyword arguments of the run's engine (``cfg.sampling.engine``), from the config and the
    task's answer-format ``instruction`` (``cfg.prompt.instruction`` overrides it)."""
    return engine_class(cfg.sampling.engine).options(cfg, prompt_format(cfg, instruction))


def build_engine(kind: str, model_path: str, store=None, **kw):
    """A rollout engine of ``kind`` (:data:`ENGINES`) on ``model_path``, adapters from ``store``."""
    return engine_class(kind)(model_path, store=store, **kw)


def engine_batch_seqs(cfg: Config) -> int:
    """The largest batch one rollout worker is sent: its share of a generation batch or the held-out
    set, capped at :data:`MAX_ENGINE_SEQS`. The CPU engine sizes its KV cache for it.

    >>> from grpo_kit.config import profile
    >>> engine_batch_seqs(profile("tiny", eval_size=64)), engine_batch_seqs(profile("tiny", n_rollout_workers=2, eval_size=8))
    (96, 48)
    """
    s = cfg.sampling
    chunk = -(-s.prompts_per_step // max(1, min(cfg.cluster.n_rollout_workers, s.prompts_per_step))) * s.group_size
    return min(MAX_ENGINE_SEQS, max(chunk, cfg.data.eval_size if cfg.run.eval_every else 1))
