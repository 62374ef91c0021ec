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

The tool-use variant (``TinySpec(task="multiply")``, the built-in name ``"tiny-tools"``:
:data:`TOOLS_SPEC`) pretrains on episodes of the calculator task (:mod:`grpo_kit.tasks.calculator`)
written in exactly the token stream the kit plays at run time: the prompt rendered by
:class:`~grpo_kit.renderers.PlainRenderer` with the ``multiply`` tool's schema, then with
probability ``tool_rate`` the call ``<call>multiply(347, 28)</call>``, the tool's answer as the
renderer writes it (``"\\nResult: 9716\\n"``, the call parsed by the plain parser and run by the kit's
:class:`~grpo_kit.tools.ToolBox`), and ``#### 9716``; otherwise a wrong guess ``#### <number>``;
each ending in EOS (:func:`tool_episode`). Each segment is tokenized on its own, as the episode
runner does, and the loss covers the model's segments only. So the base model calls the tool in
about ``tool_rate`` of its sampled episodes, copies the result when it does, and greedy decoding
(which guesses) is nearly always wrong: GRPO has the tool call to reinforce. The built-in spec
pretrains on six question shapes (``extra_shapes``) and adds copying demonstrations (``copy_share``):
without them the model copied 5-digit tool results and never 4-digit ones (``bench/tool_copy.py``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
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
TASKS = ("add", "multiply")
"""Pretraining tasks: noisy column addition, or the calculator task's tool episodes."""
TOOL_FIELDS = ("task", "tool_rate", "factor_digits", "extra_shapes", "copy_share")
"""The spec fields of the tool variant (left out of an addition spec's key, so it is unchanged)."""
LATER_TOOL_FIELDS = {"extra_shapes": (), "copy_share": 0.0}
"""Tool fields added after the first shipped tool model: left out of the key at these defaults, so a
spec that does not use them keeps the key (and the shipped build) it had before they existed."""


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
    task: str = "add"
    """What it is pretrained on: ``"add"`` (noisy column-addition traces, ``slip_rate``) or
    ``"multiply"`` (the calculator task's tool episodes: :func:`tool_episode`)."""
    tool_rate: float = 0.3
    """``task="multiply"``: the share of demonstrations that call the tool (the others guess wrong)."""
    factor_digits: int = 2
    """``task="multiply"``: digits of the second factor (the first has ``n_digits``)."""
    extra_shapes: tuple[tuple[int, int], ...] = ()
    """``task="multiply"``: more ``(n_digits, factor_digits)`` question shapes pretrained beside the
    main one, in equal shares, so products (and tool results) of every length up to the longest are
    demonstrated: a model that saw mostly 5-digit results copies a 5-digit result but not a 4-digit
    one (``bench/tool_copy.py``). Training split only; the held-out questions stay unseen."""
    copy_share: float = 0.0
    """``task="multiply"``: extra sequences per step, as a share of ``batch_size``, that demonstrate
    copying alone: a call episode whose tool answer is a random number (2 to 7 digits) and whose only
    trained tokens are the final ``#### <that number>`` and EOS (the call turn is context, not a
    target). More copying to learn from, while the share of episodes that call the tool, what the
    base model's tool rate follows, stays ``tool_rate``."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if not 0.0 <= self.tool_rate <= 1.0:
            raise ValueError(f"tool_rate must be in [0, 1], got {self.tool_rate}")
        object.__setattr__(self, "extra_shapes", tuple(tuple(int(d) for d in s) for s in self.extra_shapes))
        if any(len(s) != 2 or not all(1 <= d <= 9 for d in s) for s in self.extra_shapes):
            raise ValueError(f"extra_shapes must be (n_digits, factor_digits) pairs of 1..9, got {self.extra_shapes}")
        if self.copy_share < 0:
            raise ValueError(f"copy_share must be >= 0, got {self.copy_share}")

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """The ``(n_digits, factor_digits)`` shapes a ``task="multiply"`` model is pretrained on."""
        return ((self.n_digits, self.factor_digits), *(s for s in self.extra_shapes if s != (self.n_digits, self.factor_digits)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def key(self) -> str:
        spec = dataclasses.asdict(self)
        extra = {}
        if self.task == "add":  # the tool fields do not apply: the addition model's key predates them
            for k in TOOL_FIELDS:
                del spec[k]
        else:  # the stream format itself: a change in the renderer or the tool rebuilds the model
            for k, default in LATER_TOOL_FIELDS.items():
                if spec[k] == default:
                    del spec[k]
            from .tasks import calculator

            first = calculator.problems("train", 1, 0, n_digits=self.n_digits, factor_digits=self.factor_digits)[0]
            extra["stream"] = tool_episode(first, call=True, rng=random.Random(0))
        blob = json.dumps({"spec": spec, "format": FORMAT_VERSION, "template": data.format_prompt("{question}"), **extra},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


TOOLS_SPEC = TinySpec(task="multiply", tool_rate=0.3, extra_shapes=((2, 1), (2, 2), (3, 1), (3, 3), (4, 2)), copy_share=1.0,
                      steps=1000)
"""The spec of the built-in ``"tiny-tools"`` model (the calculator task's tool episodes)."""


def cache_root() -> Path:
    return Path(os.environ.get("GRPO_KIT_CACHE", Path.home() / ".cache" / "grpo_kit"))


def _tokenizer_corpus(n: int = 4000, spec: TinySpec | None = None) -> list[str]:
    rng = random.Random(1234)
    out = []
    for p in data.synthetic_problems(n, split="train", seed=1234, n_digits=3, n_terms=2):
        out.append(p.prompt + data.demonstration(data.parse_terms(p.question), slip_rate=0.5, rng=rng))
    if spec is not None and spec.task == "multiply":
        for p in _pretrain_problems(n, 1234, spec):
            out.append("".join(text for text, _ in tool_episode(p, call=rng.random() < 0.5, rng=rng)))
    return out


def _pretrain_problems(n: int, seed: int, spec: TinySpec) -> list[data.Problem]:
    """About ``n`` distinct training questions of a ``task="multiply"`` spec: an equal share per shape
    (:attr:`TinySpec.shapes`), each capped at what the shape has (:func:`calculator.available`), so a
    long pretraining run or a small shape asks for no more questions than exist."""
    from .tasks import calculator

    share = -(-n // len(spec.shapes))
    return [p for nd, fd in spec.shapes
            for p in calculator.problems("train", min(share, calculator.available("train", nd, fd)), seed,
                                         n_digits=nd, factor_digits=fd)]


def wrong_guess(answer: int, rng: random.Random) -> int:
    """A number with as many digits as ``answer`` that is not ``answer`` (the demonstrations' guess)."""
    k = len(str(answer))
    while (guess := rng.randint(10 ** (k - 1) if k > 1 else 0, 10**k - 1)) == answer:
        pass
    return guess


def tool_episode(problem: data.Problem, *, call: bool, rng: random.Random, result: str | None = None) -> list[tuple[str, bool]]:
    """A calculator-task episode as the kit streams it at run time, as ``(text, policy_wrote)`` segments:
    the prompt (:class:`~grpo_kit.renderers.PlainRenderer` with the tool's schema and the task's
    :class:`~grpo_kit.prompts.PromptFormat` messages), then either the call turn, the environment text
    (the plain parser's call run by a :class:`~grpo_kit.tools.ToolBox`, its answer rendered by the
    renderer) and ``#### <product>``, or (``call=False``) ``#### <wrong guess>``. EOS follows the last one.
    ``result`` replaces the tool's answer (and so the final number): :func:`copy_episode`.

    >>> [t for t, _ in tool_episode(data.Problem("mul-347-28", "What is 347 * 28?", "9716", columns={"a": 347, "b": 28}),
    ...                              call=True, rng=random.Random(0))][1:]
    ['<call>multiply(347, 28)</call>', '\\nResult: 9716\\n', '#### 9716']
    """
    from .tools import PlainParser

    renderer, box, schemas, fmt = _tool_context()
    messages = fmt.messages(problem.question)
    prompt = renderer.prompt(messages, schemas)
    if not call:
        return [(prompt, False), (f"#### {wrong_guess(int(problem.gold), rng)}", True)]
    turn = f"<call>multiply({problem.columns['a']}, {problem.columns['b']})</call>"
    results = [box.call(c) for c in PlainParser().parse(turn)]
    if [r.error for r in results] != [None]:
        raise AssertionError(f"the demonstration's call {turn!r} failed: {results}")
    answer = results[0].content if result is None else result
    messages += [{"role": "assistant", "content": turn}, {"role": "tool", "name": results[0].name, "content": answer}]
    env = renderer.extend(messages, prompt + turn, schemas)
    return [(prompt, False), (turn, True), (env, False), (f"#### {answer}", True)]


def copy_episode(problem: data.Problem, rng: random.Random) -> list[tuple[str, bool]]:
    """A call episode whose tool answer is a random number of 2 to 7 digits, with only the final answer
    (``#### <that number>``) as the policy's: the copying demonstration of :attr:`TinySpec.copy_share`.

    >>> [(t, w) for t, w in copy_episode(data.Problem("m", "What is 347 * 28?", "9716", columns={"a": 347, "b": 28}),
    ...                                  random.Random(1))][1:]
    [('<call>multiply(347, 28)</call>', False), ('\\nResult: 682\\n', False), ('#### 682', True)]
    """
    digits = rng.randint(2, 7)
    segs = tool_episode(problem, call=True, rng=rng, result=str(rng.randrange(10 ** (digits - 1), 10**digits)))
    return [(text, i == len(segs) - 1) for i, (text, _) in enumerate(segs)]


@functools.lru_cache(maxsize=1)
def _tool_context():
    """The renderer, tool box, tool schemas and prompt format of the calculator task (built once: the
    schema parses the tool's docstring)."""
    from .prompts import PromptFormat
    from .renderers import PlainRenderer
    from .tasks import calculator
    from .tools import ToolBox

    box = ToolBox([calculator.multiply])
    return PlainRenderer(None), box, box.schemas(), PromptFormat(instruction=calculator.task().instruction)


def encode_episode(tok, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Token ids of an episode's segments, each tokenized on its own (as the episode runner does),
    then EOS; per id, whether the policy wrote it (the loss's mask)."""
    ids: list[int] = []
    trained: list[bool] = []
    for text, wrote in segments:
        seg = tok.encode(text, add_special_tokens=False)
        ids += seg
        trained += [wrote] * len(seg)
    return ids + [tok.eos_token_id], trained + [True]


def build_tokenizer(spec: TinySpec | None = None):
    """A small byte-level BPE tokenizer trained (deterministically) on the synthetic task's text
    (and, for a ``task="multiply"`` spec, the tool episodes' text too).

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
    tok.train_from_iterator(_tokenizer_corpus(spec=spec), trainer)
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


def _trained_after(ids: list[int], n_prompt: int) -> tuple[list[int], list[bool]]:
    return ids, [i >= n_prompt for i in range(len(ids))]


def pretrain(spec: TinySpec, *, progress: bool = True):
    """Pretrain the tiny model; returns (model, tokenizer, log) with the log's timings."""
    import torch
    from tqdm.auto import tqdm

    tok = build_tokenizer(spec if spec.task != "add" else None)
    model = build_model(spec, len(tok))
    model.train()
    rng = random.Random(spec.seed)
    n_problems = max(spec.batch_size, min(60000, spec.steps * spec.batch_size // 2))  # steps=1 still fills a batch
    if spec.task == "multiply":
        problems = _pretrain_problems(n_problems, spec.seed, spec)
    else:
        problems = data.synthetic_problems(n_problems, split="train", seed=spec.seed, n_digits=spec.n_digits,
                                           n_terms=spec.n_terms)
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
        if spec.task == "multiply":
            seqs = [encode_episode(tok, tool_episode(p, call=rng.random() < spec.tool_rate, rng=rng)) for p in batch]
            seqs += [encode_episode(tok, copy_episode(p, rng)) for p in rng.sample(problems, round(spec.copy_share * spec.batch_size))]
        else:
            seqs = [_trained_after(*_encode_example(
                tok, p, data.demonstration(data.parse_terms(p.question), slip_rate=spec.slip_rate, rng=rng))) for p in batch]
        T = max(len(s) for s, _ in seqs)
        ids = torch.full((len(seqs), T), pad, dtype=torch.long)
        labels = torch.full((len(seqs), T), -100, dtype=torch.long)
        attn = torch.zeros((len(seqs), T), dtype=torch.long)
        for i, (s, trained) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            labels[i, : len(s)] = torch.where(torch.tensor(trained), torch.tensor(s), -100)
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
        shipped = prebuilt(spec)
        if shipped is not None:
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=".copy-"))
            try:
                for f in shipped.iterdir():
                    shutil.copyfile(f, tmp / f.name)
                if out.exists():  # an unfinished copy or build without its marker (we hold the lock)
                    shutil.rmtree(out)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
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


PREBUILT = Path(__file__).resolve().parent / "prebuilt"
"""The built-in tiny models as :func:`ensure_tiny_model` built them on the project's machine
(``tiny-<key>/``, with their build record ``grpo_kit_tiny.json``): copied into the cache instead of
pretraining them again (about 6 and 24.5 min of a fresh clone's set-up on 2 cores). A spec whose key
has no shipped copy is pretrained as before; ``GRPO_KIT_TINY_BUILD=1`` pretrains every spec."""


def prebuilt(spec: TinySpec | None = None) -> Path | None:
    """The shipped copy of ``spec``'s model (:data:`PREBUILT`), or None: none for this key, or
    ``GRPO_KIT_TINY_BUILD=1``. A copy counts only if its build record names the same spec and key."""
    spec = spec or TinySpec()
    d = PREBUILT / f"tiny-{spec.key()}"
    if os.environ.get("GRPO_KIT_TINY_BUILD") == "1" or not (d / "grpo_kit_tiny.json").is_file():
        return None
    record = tiny_info(d)
    held = record.get("spec", {})  # the addition model's record predates the tool fields
    want = json.loads(json.dumps(dataclasses.asdict(spec)))  # as the record holds it (tuples are lists in JSON)
    if record.get("key") != spec.key() or any(held.get(k, v) != v for k, v in want.items()):
        return None
    return d


def is_built(spec: TinySpec | None = None) -> bool:
    """Whether :func:`ensure_tiny_model` finds the model in the cache (if not, it pretrains it: minutes)."""
    return (cache_root() / f"tiny-{(spec or TinySpec()).key()}" / "grpo_kit_tiny.json").exists()


def tiny_info(path: str | os.PathLike) -> dict:
    """The build record saved beside a tiny model (spec and pretraining timings)."""
    return json.loads((Path(path) / "grpo_kit_tiny.json").read_text())
