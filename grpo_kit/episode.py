"""Multi-turn episodes: the :class:`Episode` record and the runner that plays them.

An episode is one token stream, never re-tokenized: ``prompt_ids``, then ``completion_ids``, the
segments after the prompt in order: each model turn's sampled ids kept verbatim (``mask`` 1, with
their sampling log-probs), and after a turn with tool calls the environment segment, the renderer's
ids for the tool answers and the next assistant header, tokenized once (``mask`` 0, log-prob 0.0)
(:mod:`grpo_kit.renderers` checks the chat template's prefix property on every extension).

Environments and tools follow TRL's ``environment_factory`` / ``tools=`` contract
(:mod:`grpo_kit.tools`): one environment instance per episode, ``reset(**row)`` with the problem's
row (``prompt`` = the question, or the conversation of a conversational prompt, ``gold``, ``id``
and the problem's ``columns``) whose text, when not
None, is appended to the user message; its public methods are tools beside the standalone ones;
``get_reward()``, when defined, scores the finished episode (:attr:`Episode.env_reward`).

An episode ends (:attr:`Episode.end_reason`) ``"answered"``: a turn ended by a stop id or stop
string with no tool call in it, or ended by a stop id the chat template never ends a turn with
(SmolLM2's ``<|endoftext|>`` where ChatML writes ``<|im_end|>``: no rendering could extend that
stream, so its calls are not run); ``"max_turns"``: turn ``max_turns`` still called tools (they are not
run, so the stream ends on the model's ids); ``"budget"``: a turn reached its token limit, or the
next turn or environment segment would not fit ``max_episode_tokens`` (the completion side: sampled and
environment ids) or the engine's context; ``"error"``: the environment's ``reset`` raised (the
episode keeps its prompt, without an observation, and samples nothing: a sample with no tokens to
train on), the rendering of its answers raised, or one of the environment's own tools ran past its
time limit (its abandoned thread may still change the environment, so no later turn or
``get_reward`` could be trusted) (:attr:`Episode.error`). A :class:`~grpo_kit.renderers.PrefixError`
is raised, not recorded: it is a configuration fault, and training on that stream would be wrong.
``reset`` gets a deep copy of the problem's row, so an environment that edits it changes no other
episode.

Scheduling: an episode's next turn is queued on the engine as soon as it is due (:func:`turn_batch`).
On an engine with continuous batching (:meth:`grpo_kit.vllm_engine.VLLMEngine.turn_batch`) each turn
is its own request: between engine steps the runner takes the tool answers that are in (without
waiting) and queues those episodes' next turns, which join the running batch at the next step, so
no turn waits for the slowest row of a call or for another episode's tool. On other engines
(:class:`WaveBatch`) the due turns are sampled in one ``sample_ids`` call; once it returns, the runner
waits for the first tool answer and ``tool_gather_s`` more for others, and samples those episodes
together (later answers join a later call). Either way each episode's tool calls run in a thread
pool (in order within the episode; episodes concurrently), so a slow tool holds only its own episode. Seeds:
turn ``t`` of the episode of ``(iteration, group_id, sample_idx)`` samples from a generator seeded
with :func:`turn_seed` of :func:`episode_seed`, so a retried task reproduces its episodes.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import dataclasses
import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from . import data
from .config import EpisodeConfig
from .prompts import PromptFormat, prompt_of
from .renderers import PrefixError, Renderer, continues_after, decode, environment_ids
from .rollout import Continuation, Rollout
from .tools import ToolBox, ToolResult, bounded, environment_tools, exception_text, parser, resolve

END_REASONS = ("answered", "max_turns", "budget", "error")
DEFAULT_TURN_TOKENS = 64
"""A turn's token limit where ``EpisodeConfig.max_turn_tokens`` is None and no run fills it in."""


class TurnEngine(Protocol):
    """What the runner needs from an engine: continue token-id prompts (:meth:`grpo_kit.hf_engine.HFEngine.sample_ids`;
    vLLM: a ``TokensPrompt`` per row with ``SamplingParams(seed=...)``). An engine may also offer
    ``turn_batch(version=, temperature=, stop=)``, a context manager giving a :class:`TurnBatch` with
    continuous batching (:func:`turn_batch`)."""

    tokenizer: Any
    stop_ids: list[int]
    max_model_len: int

    def sample_ids(self, prompts: Sequence[Sequence[int]], *, seeds: Sequence[int], max_new_tokens: Sequence[int],
                   version: int = 0, temperature: float = 1.0, stop: Sequence[str] = ()) -> list[Continuation]: ...


class TurnBatch(Protocol):
    """Turns in flight on an engine: :meth:`add` queues one, :meth:`step` advances the engine and
    returns ``(key, continuation)`` for the turns that finished. ``continuous``: a turn added between
    steps joins those in flight (else :meth:`step` samples everything queued, start to end)."""

    continuous: bool

    @property
    def busy(self) -> bool: ...

    def add(self, key: Any, prompt: Sequence[int], *, seed: int, max_new_tokens: int) -> None: ...

    def step(self) -> list[tuple[Any, Continuation]]: ...


class WaveBatch:
    """The :class:`TurnBatch` of an engine with ``sample_ids`` only: :meth:`step` samples every turn
    queued since the last step in one call."""

    continuous = False

    def __init__(self, engine: TurnEngine, version: int, temperature: float, stop: Sequence[str]) -> None:
        self.engine, self.version, self.temperature, self.stop = engine, version, temperature, tuple(stop)
        self.rows: list[tuple[Any, Sequence[int], int, int]] = []

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    def add(self, key: Any, prompt: Sequence[int], *, seed: int, max_new_tokens: int) -> None:
        self.rows.append((key, prompt, seed, max_new_tokens))

    def step(self) -> list[tuple[Any, Continuation]]:
        rows, self.rows = self.rows, []
        outs = self.engine.sample_ids([r[1] for r in rows], seeds=[r[2] for r in rows],
                                      max_new_tokens=[r[3] for r in rows], version=self.version,
                                      temperature=self.temperature, stop=self.stop)
        return [(r[0], out) for r, out in zip(rows, outs, strict=True)]


def turn_batch(engine: TurnEngine, version: int, temperature: float, stop: Sequence[str]):
    """A context manager giving the engine's :class:`TurnBatch`: its own ``turn_batch`` where it has
    one (continuous batching), else a :class:`WaveBatch` over ``sample_ids``."""
    make = getattr(engine, "turn_batch", None)
    if make is not None:
        return make(version=version, temperature=temperature, stop=stop)
    return contextlib.nullcontext(WaveBatch(engine, version, temperature, stop))


@dataclass
class Segment:
    """A run of ``completion_ids``: ``[start, end)``."""

    kind: str
    """``"model"`` (sampled, mask 1) or ``"env"`` (environment and template ids, mask 0)."""
    start: int
    """First index in ``completion_ids``."""
    end: int
    """One past the last index."""
    finish_reason: str | None = None
    """For a model turn: ``"stop"`` or ``"length"``."""


@dataclass
class Episode:
    """One multi-turn episode (module docstring)."""

    prompt_id: str
    """The problem's id."""
    group_id: int
    """Group (problem) index in the batch."""
    sample_idx: int
    """Index within the group."""
    iteration: int
    """Training iteration (part of the seed)."""
    seed: int
    """:func:`episode_seed` of the run seed, iteration, group and sample."""
    version: int
    """Adapter version that sampled it."""
    gold: str | None
    """The problem's gold answer."""
    prompt_ids: list[int] = field(default_factory=list)
    """The rendered prompt's ids."""
    completion_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: model and environment segments, in order."""
    mask: list[int] = field(default_factory=list)
    """Per completion id: 1 sampled by the policy, 0 environment/template."""
    logprobs: list[float] = field(default_factory=list)
    """Per completion id: the sampling log-prob (0.0 where ``mask`` is 0)."""
    segments: list[Segment] = field(default_factory=list)
    """The turns and environment answers as runs of ``completion_ids``."""
    messages: list[dict] = field(default_factory=list)
    """The conversation for display: assistant content is each turn's exact text."""
    prompt_messages: int = 0
    """How many of :attr:`messages` are the prompt's (system message included): the episode's
    own turns come after them, even when the prompt holds earlier assistant or tool turns."""
    end_reason: str | None = None
    """One of :data:`END_REASONS` (None while running)."""
    tool_calls: int = 0
    """Tool calls run or answered with an error, whether or not their answers made it into the stream
    (the episode may end there: budget, error)."""
    tool_errors: dict = field(default_factory=dict)
    """Failed calls by :data:`grpo_kit.tools.ERROR_KINDS` kind."""
    env_reward: float | None = None
    """``get_reward()`` of the environment, when it has one and it did not raise."""
    error: str | None = None
    """What raised, for ``end_reason == "error"`` or a failed ``get_reward``."""

    @property
    def stream(self) -> list[int]:
        """The whole token stream: prompt then completion side."""
        return self.prompt_ids + self.completion_ids

    @property
    def turns(self) -> int:
        return sum(s.kind == "model" for s in self.segments)

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled (``sum(mask)``): the loss's token count."""
        return sum(self.mask)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (it crosses Dask and goes to JSONL)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Episode:
        return cls(**{**d, "segments": [Segment(**s) for s in d["segments"]]})


def to_rollout(ep: Episode) -> Rollout:
    """The :class:`~grpo_kit.rollout.Rollout` the trainer takes for a finished episode: its whole stream
    (``completion_ids``: model and environment ids), ``logprobs`` and ``mask``, so one forward scores the
    stream and the loss covers the sampled ids only (:mod:`grpo_kit.train_step`). ``text`` is the last
    assistant message of the episode's own turns (the final answer, for a text reward; "" without a turn), ``reward`` the environment's
    (:attr:`Episode.env_reward`, None without one), ``finish_reason`` ``"length"`` when the episode ran
    out of budget (``"stop"`` otherwise)."""
    if ep.end_reason is None:
        raise ValueError(f"episode {ep.prompt_id!r}/{ep.sample_idx} is still running")
    if not len(ep.completion_ids) == len(ep.mask) == len(ep.logprobs):
        raise ValueError(f"episode {ep.prompt_id!r}/{ep.sample_idx}: completion_ids, mask and logprobs differ in length")
    # the episode's own turns only: a conversational prompt's assistant messages (few-shot demos) are
    # not its answer (an episode that sampled nothing, its reset having raised, would score on a demo)
    answers = [m["content"] for m in ep.messages[ep.prompt_messages:] if m.get("role") == "assistant"]
    return Rollout(
        prompt_id=ep.prompt_id, group_id=ep.group_id, sample_idx=ep.sample_idx, prompt_ids=list(ep.prompt_ids),
        completion_ids=list(ep.completion_ids), logprobs=list(ep.logprobs), version=ep.version,
        finish_reason="length" if ep.end_reason == "budget" else "stop", text=answers[-1] if answers else "",
        gold=ep.gold, mask=list(ep.mask), reward=ep.env_reward, iteration=ep.iteration, episode=summary(ep),
    )


def summary(ep: Episode) -> dict[str, Any]:
    """What a rollout record keeps of an episode besides its tokens (:attr:`grpo_kit.rollout.Scored.episode`):
    counts, end reason, environment reward, and the conversation after the prompt."""
    return {"turns": ep.turns, "tool_calls": ep.tool_calls, "tool_errors": dict(ep.tool_errors),
            "end_reason": ep.end_reason, "model_tokens": ep.sampled_tokens,
            "env_tokens": len(ep.completion_ids) - ep.sampled_tokens, "env_reward": ep.env_reward,
            "error": ep.error, "messages": [dict(m) for m in ep.messages[ep.prompt_messages:]]}


@dataclass
class EpisodePlan:
    """What a rollout worker needs to play a task's episodes; it travels with each rollout task
    (cloudpickle, so tools and environment classes defined in a notebook cell go too)."""

    tools: list
    """Standalone tool functions."""
    environment_factory: Callable[[], Any] | None
    """One environment per episode, or None."""
    cfg: EpisodeConfig
    """Limits (``max_turn_tokens`` filled in)."""
    tool_parser: Any = None
    """A :data:`grpo_kit.tools.PARSERS` name or a parser object; None: the renderer's format."""

    @classmethod
    def of(cls, task, cfg) -> EpisodePlan | None:
        """The plan of ``task`` under a run's config, or None for a single-turn task."""
        if not task.multi_turn:
            return None
        ep = cfg.episode
        if ep.max_turn_tokens is None:
            ep = dataclasses.replace(ep, max_turn_tokens=cfg.sampling.max_new_tokens)
        return cls(list(task.tools), task.environment_factory, ep, task.tool_parser)

    def runner(self, engine, renderer: Renderer, temperature: float) -> EpisodeRunner:
        return EpisodeRunner(engine, renderer, tools=self.tools, environment_factory=self.environment_factory,
                             cfg=self.cfg, prompt_format=engine.prompt_format, temperature=temperature,
                             tool_parser=parser(self.tool_parser) if isinstance(self.tool_parser, str) else self.tool_parser)


def episode_seed(seed: int, iteration: int, group_id: int, sample_idx: int) -> int:
    """A 62-bit seed per episode.

    >>> episode_seed(0, 1, 2, 3) == episode_seed(0, 1, 2, 3) != episode_seed(0, 1, 2, 4)
    True
    """
    digest = hashlib.blake2b(f"{seed}:{iteration}:{group_id}:{sample_idx}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def turn_seed(ep_seed: int, turn: int) -> int:
    """The seed of one turn of an episode."""
    return int.from_bytes(hashlib.blake2b(f"{ep_seed}/{turn}".encode(), digest_size=8).digest(), "little") >> 2


def counts(episodes: Sequence[Episode]) -> dict[str, int]:
    """An iteration's episode counters for its metrics: end reasons (``end_<reason>``), tool calls and
    tool errors by kind (``tool_error_<kind>``), turns, sampled and environment tokens."""
    c: Counter = Counter()
    for ep in episodes:
        c[f"end_{ep.end_reason}"] += 1
        c.update({f"tool_error_{k}": v for k, v in ep.tool_errors.items()})
        c.update(tool_calls=ep.tool_calls, turns=ep.turns, sampled_tokens=ep.sampled_tokens,
                 env_tokens=len(ep.completion_ids) - ep.sampled_tokens)
    return dict(c)


def problem_row(p: data.Problem) -> dict[str, Any]:
    """The keyword arguments of ``reset``: the problem as a TRL dataset row."""
    return {"prompt": prompt_of(p), "gold": p.gold, "id": p.id, **p.columns}


@dataclass
class Live:
    """An episode being played and what it needs besides its record."""

    ep: Episode
    env: Any
    box: ToolBox
    schemas: list[dict]
    history: str = ""
    """The stream as text (prompt, decoded turns, environment texts)."""
    env_tools: frozenset = frozenset()
    """Names of the tools that are the environment's methods."""


def append(ep: Episode, kind: str, ids: Sequence[int], logprobs: Sequence[float] | None = None,
           finish_reason: str | None = None) -> None:
    start = len(ep.completion_ids)
    ep.completion_ids += list(ids)
    ep.mask += [1 if kind == "model" else 0] * len(ids)
    ep.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
    ep.segments.append(Segment(kind, start, len(ep.completion_ids), finish_reason))


class EpisodeRunner:
    """Plays episodes with ``engine`` and ``renderer`` (module docstring). ``tools`` are standalone
    tool functions; ``environment_factory`` makes one environment per episode (TRL's shape)."""

    def __init__(self, engine: TurnEngine, renderer: Renderer, *, tools: Sequence[Callable] = (),
                 environment_factory: Callable[[], Any] | None = None, cfg: EpisodeConfig | None = None,
                 prompt_format: PromptFormat | None = None, tool_parser=None, temperature: float = 1.0) -> None:
        self.engine, self.renderer, self.tools, self.factory = engine, renderer, list(tools), environment_factory
        cfg = cfg or EpisodeConfig()
        self.cfg, self.fmt = cfg, prompt_format or PromptFormat()
        self.turn_tokens = cfg.max_turn_tokens or DEFAULT_TURN_TOKENS
        self.temperature = temperature
        """Sampling temperature (log-probs are of the tempered distribution); 0 decodes greedily
        (evaluation: the engines take argmax, and the log-probs are the untempered policy's)."""
        self.parser = tool_parser or parser(renderer.format)

    def start(self, p: data.Problem, ep: Episode) -> Live:
        broken = None
        try:  # one episode's environment that cannot be made must not stop the batch
            env = self.factory() if self.factory is not None else None
            env_tools = environment_tools(env) if env is not None else []
        except Exception as e:
            env, env_tools, broken = None, [], f"environment_factory raised {exception_text(e)}"
        box = ToolBox(self.tools + env_tools, timeout_s=self.cfg.tool_timeout_s, max_calls=self.cfg.max_tool_calls,
                      stateful=[fn.__name__ for fn in env_tools])
        live = Live(ep, env, box, box.schemas(), env_tools=frozenset(fn.__name__ for fn in env_tools))
        ep.messages = self.fmt.messages(prompt_of(p))  # a conversational prompt as it is
        ep.prompt_messages = len(ep.messages)
        obs = None
        if broken:  # the episode keeps its prompt and samples nothing, as when reset raises
            ep.end_reason, ep.error = "error", broken
        if env is not None:  # a row of its own (a deep copy): an environment that edits it changes no other
            row = copy.deepcopy(problem_row(p))  # episode; one broken row must not stop the batch, nor one
            value, kind, _ = bounded(lambda: resolve(env.reset(**row)), self.cfg.tool_timeout_s, "reset")  # slow reset
            if kind is None:
                obs = value
            else:  # the episode keeps its prompt and samples nothing
                ep.end_reason = "error"
                ep.error = f"reset raised {value}" if kind == "raised" else \
                    f"reset timed out after {self.cfg.tool_timeout_s:g} s (tool_timeout_s)"
        if obs is not None:
            ep.messages[-1] = {**ep.messages[-1], "content": ep.messages[-1]["content"] + str(obs)}
        live.history = self.renderer.prompt(ep.messages, live.schemas)
        ep.prompt_messages = len(ep.messages)  # the renderer may have added the tools' system message
        ep.prompt_ids = getattr(self.renderer, "encode_prompt", self.renderer.encode)(live.history)  # plain: a BOS too
        if len(ep.prompt_ids) + self.turn_tokens > self.engine.max_model_len:
            raise ValueError(f"problem {p.id!r}: prompt of {len(ep.prompt_ids)} tokens + max_turn_tokens="
                             f"{self.turn_tokens} exceeds the engine's context of {self.engine.max_model_len}")
        return live

    def turn(self, live: Live, out: Continuation) -> list | None:
        """Record a sampled turn; the tool calls to run, or None when the episode ends here."""
        ep = live.ep
        append(ep, "model", out.ids, out.logprobs, out.finish_reason)
        ends_on_id = out.finish_reason == "stop" and out.stop is None and out.ids[-1] in self.engine.stop_ids
        tok = self.engine.tokenizer
        content = decode(tok, out.ids[:-1] if ends_on_id else out.ids)
        ep.messages.append({"role": "assistant", "content": content})
        live.history += decode(tok, out.ids)
        calls = self.parser.parse(content)
        if out.finish_reason == "length":
            ep.end_reason = "budget"
        elif not calls:
            ep.end_reason = "answered"
        elif ends_on_id and not continues_after(self.renderer, decode(tok, out.ids[-1:])):
            ep.end_reason = "answered"  # ended on an id the template never ends a turn with: the conversation is over
        elif ep.turns >= self.cfg.max_turns:
            ep.end_reason = "max_turns"
        return None if ep.end_reason else calls

    def answer(self, live: Live, results: list[ToolResult]) -> bool:
        """Append the environment's answers; whether the episode goes on."""
        ep = live.ep
        ep.tool_calls += len(results)
        ep.tool_errors = dict(Counter(ep.tool_errors) + Counter(r.error for r in results if r.error))
        stuck = [r.name for r in results if r.error == "timeout" and r.name in live.env_tools]
        if stuck:  # its abandoned thread may still change the environment: nothing after this is reliable
            ep.end_reason, ep.error = "error", (f"the environment's tool {stuck[0]!r} timed out and may still be "
                                                "changing the environment")
            return False
        n = len(ep.messages)
        ep.messages += [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        try:
            env_text = self.renderer.extend(ep.messages, live.history, live.schemas)
            ids = environment_ids(self.renderer, ep.messages, live.history, live.schemas, env_text)
        except PrefixError:
            raise
        except Exception as e:  # e.g. a template that rejects the messages
            del ep.messages[n:]  # the messages stay those of the stream
            ep.end_reason, ep.error = "error", f"rendering the tool answers raised {exception_text(e)}"
            return False
        if len(ep.completion_ids) + len(ids) >= self.cfg.max_episode_tokens or \
                len(ep.stream) + len(ids) >= self.engine.max_model_len:
            del ep.messages[n:]  # the messages stay those of the stream
            ep.end_reason = "budget"
            return False
        append(ep, "env", ids)
        live.history += env_text
        return True

    def run(self, problems: Sequence[data.Problem], n: int, version: int = 0, *, seed: int = 0, iteration: int = 0,
            group_offset: int = 0) -> list[Episode]:
        """``n`` episodes per problem, grouped consecutively (``group_id = group_offset + i``)."""
        return [lv.ep for lv in self.play(problems, n, version, seed=seed, iteration=iteration, group_offset=group_offset)]

    def play(self, problems: Sequence[data.Problem], n: int, version: int = 0, *, seed: int = 0, iteration: int = 0,
             group_offset: int = 0) -> list[Live]:
        """:meth:`run`, returning each episode with its environment (``Live.env``, alive: reward
        functions may read it, as TRL's take ``environments``)."""
        lives = []
        for i, p in enumerate(problems):
            for j in range(n):
                ep = Episode(p.id, group_offset + i, j, iteration, episode_seed(seed, iteration, group_offset + i, j),
                             version, p.gold)
                lives.append(self.start(p, ep))
        order = {id(lv): k for k, lv in enumerate(lives)}  # handle turns and answers in a stable order
        pending: dict[cf.Future, Live] = {}
        with cf.ThreadPoolExecutor(self.cfg.tool_workers, thread_name_prefix="episode-tools") as pool, \
                turn_batch(self.engine, version, self.temperature, self.renderer.stop) as batch:

            def due(lv: Live) -> None:  # queue the episode's next turn, or end it when none fits
                if self.budget(lv) > 0:
                    batch.add(lv, lv.ep.stream, seed=turn_seed(lv.ep.seed, lv.ep.turns), max_new_tokens=self.budget(lv))
                else:
                    self.end(lv, "budget")

            for lv in lives:
                if lv.ep.end_reason is None:
                    due(lv)
            while batch.busy or pending:
                if batch.busy:
                    for lv, out in sorted(batch.step(), key=lambda r: order[id(r[0])]):
                        calls = self.turn(lv, out)
                        if calls:
                            pending[pool.submit(lv.box.call_all, calls)] = lv
                if batch.busy:  # turns in flight: take the answers that are in, without waiting
                    done = {f for f in pending if f.done()}
                elif pending:  # the engine is idle: wait for an answer (and, batching by call, for more)
                    done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                    if not batch.continuous:
                        done |= cf.wait(set(pending) - done, timeout=self.cfg.tool_gather_s)[0]
                else:
                    done = set()
                for f in sorted(done, key=lambda f: order[id(pending[f])]):
                    lv = pending.pop(f)
                    if self.answer(lv, f.result()):
                        due(lv)
        for lv in lives:
            self.finish(lv)
        return lives

    def budget(self, lv: Live) -> int:
        """Tokens the next turn may sample."""
        ep = lv.ep
        return min(self.turn_tokens, self.cfg.max_episode_tokens - len(ep.completion_ids),
                   self.engine.max_model_len - len(ep.stream))

    @staticmethod
    def end(lv: Live, reason: str) -> bool:
        lv.ep.end_reason = reason
        return False

    def finish(self, lv: Live) -> None:
        """The environment's reward (``get_reward()``, bounded by ``tool_timeout_s`` as a tool is: it
        may work on what the policy wrote); raising or past the limit, the reward is missing (the
        trainer decides) and the episode records why."""
        if lv.env is None or not callable(getattr(lv.env, "get_reward", None)) or lv.ep.end_reason == "error":
            return
        value, kind, _ = bounded(lambda: float(resolve(lv.env.get_reward())), self.cfg.tool_timeout_s, "get_reward")
        if kind is None:
            lv.ep.env_reward = value
        else:
            lv.ep.error = f"get_reward raised {value}" if kind == "raised" else \
                f"get_reward timed out after {self.cfg.tool_timeout_s:g} s (tool_timeout_s)"
