"""The offline embedded default: a tiny Qwen3-architecture model and its own small BPE tokenizer.

:func:`ensure_tiny_model` builds ``Qwen3ForCausalLM`` from scratch, pretrains it on the synthetic
column-addition task (:mod:`grpo_kit.data`) with seeded, noisy demonstrations, and saves it with
``save_pretrained`` (``config.json``, ``model.safetensors``, ``tokenizer.json``) so transformers,
PEFT and vLLM all load it from the directory. The result is cached under a hash of
:class:`TinySpec`; a second call returns the cached directory at once.

Why noisy demonstrations: the demonstrations forget an incoming carry with probability
``slip_rate``. The model learns to carry, but only some of the time, so greedy decoding is often
wrong while sampled groups of completions disagree: the reward has something to teach and GRPO
has signal. See the README's "tiny profile" section for the measured figures.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import data

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
VOCAB_SIZE = 384
"""BPE vocabulary size (256 byte symbols, the special tokens, merges)."""
FORMAT_VERSION = 3
"""Bumped whenever the recipe below changes what gets built (invalidates caches)."""


@dataclass(frozen=True)
class TinySpec:
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (head_dim = 32)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention, as in Qwen3)."""
    intermediate_size: int = 384
    """MLP width."""
    n_digits: int = 3
    """Digits per operand in the pretraining task."""
    n_terms: int = 2
    """Operands per problem."""
    slip_rate: float = 0.6
    """Probability that a demonstration forgets an incoming carry."""
    steps: int = 600
    """Optimizer steps of pretraining."""
    batch_size: int = 64
    """Sequences per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay)."""
    seed: int = 0
    """Seeds weights, data order and slips."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def key(self) -> str:
        blob = json.dumps({"spec": dataclasses.asdict(self), "format": FORMAT_VERSION, "template": data.format_prompt("{question}")}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_KIT_CACHE", Path.home() / ".cache" / "grpo_kit"))


def _tokenizer_corpus(n: int = 4000) -> list[str]:
    rng = random.Random(1234)
    out = []
    for p in data.synthetic_problems(n, split="train", seed=1234, n_digits=3, n_terms=2):
        out.append(p.prompt + data.demonstration(data.parse_terms(p.question), slip_rate=0.5, rng=rng))
    return out


def build_tokenizer():
    """A small byte-level BPE tokenizer trained (deterministically) on the synthetic task's text.

    Digits are always single tokens (as in Qwen's tokenizer), so numbers are spelled digit by
    digit; the template's words become single tokens, which keeps prompts short.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


def build_model(spec: TinySpec, vocab_size: int, *, seed: int | None = None):
    """A randomly initialised ``Qwen3ForCausalLM`` of the spec's shape."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=SPECIAL_TOKENS.index("<pad>"),
        eos_token_id=SPECIAL_TOKENS.index("<eos>"),
        bos_token_id=SPECIAL_TOKENS.index("<eos>"),
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed if seed is None else seed)
    return Qwen3ForCausalLM(cfg)


def _encode_example(tok, problem: data.Problem, completion: str) -> tuple[list[int], int]:
    prompt_ids = tok.encode(problem.prompt, add_special_tokens=False)
    comp_ids = tok.encode(completion, add_special_tokens=False) + [tok.eos_token_id]
    return prompt_ids + comp_ids, len(prompt_ids)


def pretrain(spec: TinySpec, *, progress: bool = True):
    """Pretrain the tiny model; returns (model, tokenizer, log) with the log's timings."""
    import torch
    from tqdm.auto import tqdm

    tok = build_tokenizer()
    model = build_model(spec, len(tok))
    model.train()
    rng = random.Random(spec.seed)
    problems = data.synthetic_problems(
        min(60000, spec.steps * spec.batch_size // 2), split="train", seed=spec.seed, n_digits=spec.n_digits, n_terms=spec.n_terms
    )
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, spec.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / spec.steps)))
    )
    pad = tok.pad_token_id
    t0, tokens, losses = time.time(), 0, []
    bar = tqdm(range(spec.steps), desc="pretraining tiny model", disable=not progress)
    for _ in bar:
        batch = rng.sample(problems, spec.batch_size)
        seqs = [
            _encode_example(tok, p, data.demonstration(data.parse_terms(p.question), slip_rate=spec.slip_rate, rng=rng))
            for p in batch
        ]
        T = max(len(s) for s, _ in seqs)
        ids = torch.full((len(seqs), T), pad, dtype=torch.long)
        labels = torch.full((len(seqs), T), -100, dtype=torch.long)
        attn = torch.zeros((len(seqs), T), dtype=torch.long)
        for i, (s, n_prompt) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            labels[i, n_prompt : len(s)] = torch.tensor(s[n_prompt:])
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(attn.sum())
        losses.append(loss.item())
        if len(losses) % 50 == 0:
            bar.set_postfix(loss=f"{sum(losses[-50:]) / 50:.3f}", tok_s=f"{tokens / (time.time() - t0):.0f}")
    model.eval()
    log = {"pretrain_s": time.time() - t0, "tokens": tokens, "tokens_per_s": tokens / (time.time() - t0), "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:]))}
    return model, tok, log


def ensure_tiny_model(spec: TinySpec | None = None, *, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The directory of the pretrained tiny model, built on first use and cached by spec hash.

    Safe to call from several processes at once: a file lock serializes the build, and the
    directory appears atomically (built in a temporary directory, then renamed).
    """
    spec = spec or TinySpec()
    root = Path(cache_dir) if cache_dir else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"tiny-{spec.key()}"
    if (out / "grpo_kit_tiny.json").exists():
        return out
    with open(root / f".tiny-{spec.key()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "grpo_kit_tiny.json").exists():
            return out
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        try:
            model, tok, log = pretrain(spec, progress=progress)
        finally:
            torch.set_num_threads(threads)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
        model.save_pretrained(tmp, safe_serialization=True)
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "grpo_kit_tiny.json").write_text(json.dumps({"spec": dataclasses.asdict(spec), "key": spec.key(), **log}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out


def is_built(spec: TinySpec | None = None) -> bool:
    """Whether :func:`ensure_tiny_model` finds the model in the cache (if not, it pretrains it: minutes)."""
    return (cache_root() / f"tiny-{(spec or TinySpec()).key()}" / "grpo_kit_tiny.json").exists()


def tiny_info(path: str | os.PathLike) -> dict:
    """The build record saved beside a tiny model (spec and pretraining timings)."""
    return json.loads((Path(path) / "grpo_kit_tiny.json").read_text())
