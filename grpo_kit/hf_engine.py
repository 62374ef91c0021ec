"""The transformers engine: :class:`HFEngine`, sampling with ``generate`` under the adapter version
of each call (PEFT). It keeps the contract of :mod:`grpo_kit.rollout` (exact token ids, sampling
log-probs of the tempered distribution, per-call seeds) and is the reference the vLLM engine
(:mod:`grpo_kit.vllm_engine`) is checked against."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

from grpo_kit import data
from grpo_kit.config import Config
from grpo_kit.prompts import PromptFormat, cut_completion, encode_prompts
from grpo_kit.rollout import Continuation, Rollout, check_request, check_turn, group_seed, make_rollout, stop_token_ids


class HFEngine:
    """Sampling with transformers ``generate``; the LoRA adapter of each call's ``version`` comes from
    ``store`` (PEFT). The reference engine: slower than vLLM, no extra dependency.

    The model's own ``generation_config`` sampling defaults are dropped (hub checkpoints often set
    top_k / top_p / temperature); every call sets temperature, ``top_k=0`` and ``top_p=1.0``.
    Log-probs are taken from ``generate``'s ``scores`` (the processed logits that were sampled from).
    """

    @classmethod
    def options(cls, cfg: Config, fmt: PromptFormat) -> dict[str, Any]:
        """This engine's keyword arguments from a run's config (see :data:`ENGINES`)."""
        return {"dtype": cfg.model.dtype, "max_model_len": cfg.model.max_model_len, "prompt_format": fmt,
                "stop": cfg.sampling.stop}

    def __init__(
        self,
        model_path: str,
        *,
        store=None,
        dtype: str = "float32",
        max_model_len: int = 256,
        device: str | None = None,
        prompt_format: PromptFormat | None = None,
        stop: Sequence[str] = (),
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.model_path = str(model_path)
        self.store = store
        self.prompt_format, self.stop = prompt_format or PromptFormat(), tuple(stop)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype))
        context = getattr(model.config, "max_position_embeddings", None)
        if context is not None and max_model_len > context:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {context} tokens")
        self.max_model_len = max_model_len
        self.stop_ids = stop_token_ids(self.tokenizer, model.generation_config, model.config)
        self.eos_token_id = self.stop_ids[0]
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.eos_token_id
        model.generation_config = GenerationConfig(
            bos_token_id=model.generation_config.bos_token_id,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_token_id,
        )
        self._base = model.to(self.device).eval()
        self._model = self._base  # becomes a PeftModel on the first adapter
        self._loaded: str | None = None  # name of the resident adapter (None: none loaded yet)
        self._loaded_key: tuple | None = None  # (version, publish attempt) it was loaded from
        self._adapters = 0  # adapters loaded so far: each gets a name of its own

    # ---- adapters --------------------------------------------------------------------------------

    def _activate(self, version: int) -> None:
        """Load adapter ``version`` unless the one loaded is that version's current publish: keyed by
        (version, attempt), read fresh, so a version taken back and published anew is never served
        from the old weights."""
        if version == 0:
            return
        key = (version, self.store.attempt(version))  # VersionNotFoundError for an unpublished version
        if key == self._loaded_key:
            return
        from peft import PeftModel

        path = self.store.fetch(version)
        self._adapters += 1
        name, old = f"v{version}-{self._adapters}", self._loaded
        if old is None:
            self._model = PeftModel.from_pretrained(self._base, path, adapter_name=name).eval()
        else:
            self._loaded_key = None  # a failure below leaves the active adapter unknown: reload next call
            self._model.load_adapter(path, adapter_name=name)
            self._model.set_adapter(name)
            self._model.delete_adapter(old)  # keep one adapter resident
        self._loaded, self._loaded_key = name, key

    def _policy(self, version: int):
        """The model and a context manager that selects ``version`` (0: adapter disabled)."""
        import contextlib

        self._activate(version)
        if version == 0 and self._loaded is not None:
            return self._model.disable_adapter()
        return contextlib.nullcontext()

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
        sampling = {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}
        return self._run(problems, n, version, max_new_tokens, sampling, group_seed(seed, group_offset), group_offset)

    def greedy(self, problems: Sequence[data.Problem], version: int, *, max_new_tokens: int) -> list[Rollout]:
        check_request(1, version, max_new_tokens, 1.0, has_store=self.store is not None)
        if not problems:
            return []
        return self._run(problems, 1, version, max_new_tokens, {"do_sample": False}, None, 0)

    def _run(self, problems, n, version, max_new_tokens, sampling, seed, group_offset) -> list[Rollout]:
        import torch
        from transformers import GenerationConfig

        prompts = encode_prompts(self.tokenizer, problems, max_new_tokens, self.max_model_len, self.prompt_format)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):  # left-padded: every row's next token is at the same column
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention_mask[i, width - len(p) :] = 1
        # the temperature is the recorder's to apply (a user's processor may run before generate's own
        # warpers, so the recorder could not otherwise see the distribution sampled from)
        record = SampledLogprobs(sampling.get("temperature", 1.0))
        gen_cfg = GenerationConfig(
            **{**sampling, **({"temperature": 1.0} if "temperature" in sampling else {})},
            typical_p=1.0,
            repetition_penalty=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
        )
        ctx = self._policy(version)
        devices = [self.device] if self.device.type == "cuda" else []
        with ctx, torch.no_grad(), torch.random.fork_rng(devices=devices):
            if seed is not None:
                torch.manual_seed(seed)
            out = self._model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=gen_cfg,
                logits_processor=[record],
            )
        gen = out.sequences[:, width:]  # (B*n, L) rows ordered problem-major, as the groups
        logp = record.finish(out.sequences)  # (B*n, L)
        gen, logp = gen.tolist(), logp.tolist()
        stop = set(self.stop_ids)
        rollouts = []
        for row, (ids, lps) in enumerate(zip(gen, logp, strict=True)):
            i, j = divmod(row, n)
            end = next((t + 1 for t, tok in enumerate(ids) if tok in stop), None)
            finish = "stop" if end is not None else "length"
            end = end if end is not None else len(ids)  # never stopped: generate ran max_new_tokens steps
            rollouts.append(make_rollout(self.tokenizer, problems[i], prompts[i], ids[:end], lps[:end], finish, self.stop,
                                         group_id=group_offset + i, sample_idx=j, version=version))
        return rollouts

    def sample_ids(self, prompts: Sequence[Sequence[int]], *, seeds: Sequence[int], max_new_tokens: Sequence[int],
                   version: int = 0, temperature: float = 1.0, stop: Sequence[str] = ()) -> list[Continuation]:
        """Continue each token-id prompt as given (nothing re-tokenized), row ``i`` sampled from its own
        generator seeded with ``seeds[i]`` (so a row's ids do not depend on the other rows, up to float
        rounding of the batch) and cut at ``max_new_tokens[i]``, a stop id or a ``stop`` string.
        Top-k and top-p off; log-probs are of the tempered distribution sampled from. ``temperature=0``
        decodes greedily (argmax; the log-probs are then the untempered policy's)."""
        import torch
        from transformers import DynamicCache

        check_request(1, version, max(max_new_tokens, default=1), temperature or 1.0, has_store=self.store is not None)
        stop = tuple(s for s in stop if s)  # "" is in every text: as cut_completion, it stops nothing
        B, width = len(prompts), max((len(p) for p in prompts), default=0)
        if not prompts:
            return []
        for i, (p, m) in enumerate(zip(prompts, max_new_tokens, strict=True)):
            check_turn(p, m, self.max_model_len, f"row {i}")
        ids = torch.full((B, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left-padded; positions count real tokens only
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(list(p)), 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        out = [Continuation([], [], "length") for _ in range(B)]
        live, stops = set(range(B)), set(self.stop_ids)
        with self._policy(version), torch.no_grad():
            cache = DynamicCache()
            step = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
            for _ in range(max(max_new_tokens)):
                logits = self._model(**step, past_key_values=cache, use_cache=True).logits[:, -1]
                logp = (logits.float() / (temperature or 1.0)).log_softmax(-1)  # (B, V)
                nxt = torch.full((B,), self.pad_token_id, dtype=torch.long, device=self.device)
                for i in sorted(live):
                    tok = int(logp[i].argmax()) if not temperature else \
                        int(torch.multinomial(logp[i].exp(), 1, generator=gens[i]))
                    c = out[i]
                    c.ids.append(tok)
                    c.logprobs.append(float(logp[i, tok]))
                    nxt[i] = tok
                    if tok in stops:
                        c.finish_reason = "stop"
                    elif stop and any(s in self.tokenizer.decode(c.ids, skip_special_tokens=True) for s in stop):
                        cut = cut_completion(self.tokenizer, c.ids, "length", stop)
                        c.ids, c.logprobs, c.finish_reason, c.stop = c.ids[:cut.n_tokens], c.logprobs[:cut.n_tokens], "stop", cut.stop
                    if c.finish_reason == "stop" or len(c.ids) >= max_new_tokens[i]:
                        live.discard(i)
                if not live:
                    break
                mask = torch.cat([mask, mask.new_ones((B, 1))], dim=1)
                pos = pos[:, -1:] + 1
                step = {"input_ids": nxt[:, None], "attention_mask": mask, "position_ids": pos}
        return out

    def close(self) -> None:
        """Drop the model (frees its memory once nothing else holds it)."""
        import torch

        self._model = self._base = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class SampledLogprobs:
    """A logits processor that applies the sampling temperature (``generate`` then runs at 1.0 with
    no other warper: top-k 0, top-p 1) and records the log-prob of each sampled token under the
    distribution it was sampled from: each step keeps that step's log-softmax, and the next step (or
    :meth:`finish`) reads the token that was drawn from it. Memory is one (rows, vocab) array, where
    ``output_scores`` would keep one per step (tens of GiB for a real vocabulary and long completions)."""

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = float(temperature)
        self.prev = None
        self.logps: list = []

    def __call__(self, input_ids, scores):
        self._take(input_ids[:, -1])
        if self.temperature != 1.0:
            scores = scores / self.temperature
        self.prev = scores.float().log_softmax(-1)
        return scores

    def _take(self, tokens) -> None:
        if self.prev is not None:
            self.logps.append(self.prev.gather(1, tokens[:, None].to(self.prev.device)).squeeze(1))
            self.prev = None

    def finish(self, sequences):
        """(rows, steps): the sampled tokens' log-probs, given ``generate``'s output sequences."""
        import torch

        self._take(sequences[:, -1])
        return torch.stack(self.logps, dim=1) if self.logps else torch.zeros(sequences.shape[0], 0)
