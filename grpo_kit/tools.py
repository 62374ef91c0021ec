"""Tools for multi-turn episodes: schemas, tool-call parsers, and execution that never crashes.

The contract is TRL's (``GRPOTrainer(tools=..., environment_factory=...)``, trl 1.16), so a TRL
user's tools and environment classes plug in unchanged:

- A tool is a plain Python function with type hints and a Google-style docstring (``Args:``); its
  JSON schema is ``transformers.utils.get_json_schema(fn)``, which the chat template receives as
  ``tools=`` (:func:`tool_schema`). A tool returns anything; its answer to the model is ``str(result)``.
- An environment is a class whose instances have ``reset(**row) -> str | None`` (the text, when not
  None, is appended to the last user message), public methods that are its tools (every function on
  the class whose name does not start with ``_``, except ``reset`` and ``get_reward``:
  :func:`environment_tools`, TRL's rule), and optionally ``get_reward() -> float`` for the episode.
  One instance per episode, so episodes never share state.
- Tool calls are parsed from the text of a model turn by a parser from :data:`PARSERS`:
  ``"hermes"``, the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of
  ChatML/Qwen-family templates, and ``"plain"``, a format for the tiny byte-level model with no chat
  template: ``<call>name(a=1, b="x")</call>``, the call a Python expression whose function is a bare
  name and whose arguments are literals (parsed with :mod:`ast`, never evaluated). Plain turns end
  at the stop string ``</call>`` (:data:`PLAIN_STOP`).
- Every failure becomes the tool's answer to the model, ``{"error": "..."}`` as JSON (TRL answers
  ``{'error': str(e)}``), plus a counted :data:`ERROR_KINDS` kind, never an exception: a malformed
  call, an unknown tool, arguments that do not bind to the signature, a tool that raises (an
  exception whose own text cannot be made is named by its type), a tool past its time limit (run
  in a daemon thread that is abandoned at the limit; a call the thread cannot be left at, one
  inside a single long C-level operation that holds the interpreter's lock, such as a regex that
  backtracks or a huge ``**``, holds every thread of the worker until it returns, and is answered
  as timed out then; a tool that runs untrusted code or work of unbounded size should use
  :func:`grpo_kit.sandbox.run_python`, which kills it), and calls past
  ``max_calls`` in one turn. ``async def`` tools (and ``get_reward``) are awaited in the call's thread.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "too_many_calls")
"""Why a tool call failed (counted per episode and per iteration)."""
PLAIN_STOP = "</call>"
"""The stop string that ends a plain-format turn holding a call."""
ENV_RESERVED = ("reset", "get_reward")
"""Environment methods that are never tools."""


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of a tool (what ``apply_chat_template(tools=...)`` takes), with an error that
    says what to fix when the docstring or the hints are missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException / TypeHintParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: {e} (a tool needs type hints and a "
                         "Google-style docstring with an 'Args:' section)") from e


def environment_tools(env: Any) -> list[Callable]:
    """An environment instance's tools: its bound public methods (TRL's rule: functions on the class,
    not properties, without ``reset``/``get_reward`` or a leading underscore), in name order."""
    if not callable(getattr(env, "reset", None)):
        raise ValueError(f"environment {type(env).__name__} has no callable reset()")
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ENV_RESERVED]


# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from a model turn (or the reason it could not be parsed)."""

    name: str | None
    """The tool's name; None when the call was too malformed to name one."""
    args: tuple = ()
    """Positional arguments (the plain format allows them)."""
    kwargs: dict | None = None
    """Keyword arguments (Hermes ``"arguments"``)."""
    error: str | None = None
    """Why parsing failed (then the call is answered with this error, kind ``"malformed"``)."""


class Parser(Protocol):
    """Finds the tool calls in the text of one model turn."""

    def parse(self, text: str) -> list[ToolCall]: ...


def blocks(text: str, open_tag: str, close_tag: str) -> list[str | None]:
    """The bodies between ``open_tag`` and the next ``close_tag``, in order; None for a block that is
    never closed or that opens another block inside it (nested tags)."""
    out, at = [], 0
    while (start := text.find(open_tag, at)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:  # never closed: malformed, and nothing after it can be a call
            out.append(None)
            break
        body = text[start + len(open_tag): end]
        out.append(None if open_tag in body else body)
        at = end + len(close_tag)
    return out


class HermesParser:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (Qwen2.5/Qwen3, Hermes, ChatML)."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in blocks(text, self.open_tag, self.close_tag):
            if body is None:
                calls.append(ToolCall(None, error=f"unclosed or nested {self.open_tag}"))
                continue
            try:
                obj = json.loads(body)
            except Exception as e:  # noqa: BLE001 - JSONDecodeError, or RecursionError on deeply nested input
                calls.append(ToolCall(None, error=f"the call is not valid JSON ({getattr(e, 'msg', type(e).__name__)})"))
                continue
            name = obj.get("name") if isinstance(obj, dict) else None
            args = obj.get("arguments", {}) if isinstance(obj, dict) else None
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except Exception:  # noqa: BLE001 - as above
                    args = None
            if not isinstance(name, str) or not isinstance(args, dict):
                calls.append(ToolCall(name if isinstance(name, str) else None,
                                      error='expected {"name": <string>, "arguments": <object>}'))
                continue
            calls.append(ToolCall(name, kwargs=args))
        return calls


def _literal_arguments(call: ast.Call) -> tuple[tuple, dict] | str:
    """``(args, kwargs)`` of a plain call whose arguments are all literals, else why not, in words
    that depend on the text only (never an object's address, as ``ast``'s own messages name one: a
    retried episode must read the same answer)."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return "no * or ** arguments"
    names = [k.arg for k in call.keywords]
    if len(set(names)) < len(names):
        return f"keyword {next(n for n in names if names.count(n) > 1)!r} given twice"
    values = []
    for what, node in [*((f"argument {i + 1}", a) for i, a in enumerate(call.args)),
                       *((f"argument {k.arg!r}", k.value) for k in call.keywords)]:
        try:
            values.append(ast.literal_eval(node))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return f"{what} is an expression ({type(node).__name__}), not a literal"
    return tuple(values[: len(call.args)]), dict(zip(names, values[len(call.args):], strict=True))


class PlainParser:
    """``<call>name(1, b="x")</call>``: a bare function name and literal arguments (:mod:`ast`, no eval)."""

    open_tag, close_tag = "<call>", PLAIN_STOP

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in blocks(text, self.open_tag, self.close_tag):
            if body is None:
                calls.append(ToolCall(None, error=f"unclosed or nested {self.open_tag}"))
                continue
            try:
                node = ast.parse(body.strip(), mode="eval").body
            except Exception as e:  # noqa: BLE001 - SyntaxError, ValueError (a NUL), MemoryError or RecursionError (deep nesting)
                calls.append(ToolCall(None, error=f"not a call: {getattr(e, 'msg', None) or type(e).__name__}"))
                continue
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                calls.append(ToolCall(None, error="expected name(arg, key=value, ...)"))
                continue
            got = _literal_arguments(node)
            if isinstance(got, str):
                calls.append(ToolCall(node.func.id, error=f"arguments must be literals ({got})"))
                continue
            args, kwargs = got
            calls.append(ToolCall(node.func.id, args=args, kwargs=kwargs))
        return calls


PARSERS: dict[str, Callable[[], Parser]] = {"hermes": HermesParser, "plain": PlainParser}
"""Tool-call formats by name."""


def parser(name: str) -> Parser:
    """The parser registered as ``name`` in :data:`PARSERS`."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name]()


# ----------------------------------------------------------------------------- execution


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer to one call, as the model will read it."""

    name: str
    """The tool's name (``"unknown"`` when the call named none)."""
    content: str
    """``str(result)``, or ``{"error": "..."}`` as JSON."""
    error: str | None = None
    """The :data:`ERROR_KINDS` kind of the failure; None for a good call."""
    seconds: float = 0.0
    """Wall-clock time of the call."""


def resolve(value: Any) -> Any:
    """A tool's (or ``get_reward``'s) value; an ``async def`` one's awaitable is run to its end here
    (TRL takes async tools too)."""
    if inspect.isawaitable(value):
        async def wait():
            return await value

        return asyncio.run(wait())
    return value


def error_text(message: str) -> str:
    """The tool answer for a failure (JSON, so the model sees one stable shape)."""
    return json.dumps({"error": message})


def exception_text(e: BaseException, limit: int = 500) -> str:
    """``"<type>: <message>"`` of an exception, at most ``limit`` characters of message; the type
    alone (with a note) when the message itself cannot be made: ``str()`` of an exception can raise
    (a ``KeyError`` of an int past Python's 4,300-digit conversion limit), and the policy chooses
    the arguments that make it.

    >>> exception_text(KeyError(int("f" * 4000, 16)))
    'KeyError: (its message could not be made: ValueError)'
    """
    try:
        msg = str(e)
    except BaseException as inner:  # noqa: BLE001 - whatever str() raised
        msg = f"(its message could not be made: {type(inner).__name__})"
    return f"{type(e).__name__}: {msg[:limit]}"


def bounded(fn: Callable[[], Any], timeout_s: float, name: str = "bounded") -> tuple[Any, str | None, float]:
    """``fn()`` in a daemon thread, abandoned at ``timeout_s``: ``(value, None, seconds)``, or
    ``(exception_text, "raised", seconds)``, or ``(None, "timeout", seconds)``. A thread cannot be
    killed: an abandoned one runs on (use the sandbox for untrusted code); one that held the
    interpreter's lock past the limit could not be left, and is past its limit all the same."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # reported; the run goes on
            box["raised"] = exception_text(e)

    t0 = time.perf_counter()
    worker = threading.Thread(target=target, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    dt = time.perf_counter() - t0
    if worker.is_alive() or dt > timeout_s:
        return None, "timeout", dt
    if "raised" in box:
        return box["raised"], "raised", dt
    return box["value"], None, dt


class ToolBox:
    """Named tools and how to call them safely (see the module docstring)."""

    def __init__(self, tools: Sequence[Callable], *, timeout_s: float = 10.0, max_calls: int = 8,
                 stateful: Collection[str] = ()) -> None:
        self.stateful = frozenset(stateful)
        """Names of tools whose timeout ends the turn's calls (an environment's methods: the abandoned
        thread may still be changing the state the next call would read)."""
        self.tools = {}
        for fn in tools:
            name = getattr(fn, "__name__", None)
            if not name or name in self.tools:
                raise ValueError(f"tool {fn!r}: missing or duplicate name {name!r}")
            self.tools[name] = fn
        self.timeout_s, self.max_calls = float(timeout_s), int(max_calls)

    def schemas(self) -> list[dict]:
        return [tool_schema(fn) for fn in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call: its result, or the error the model is told."""
        name = call.name or "unknown"
        if call.error is not None:
            return ToolResult(name, error_text(f"malformed tool call: {call.error}"), "malformed")
        fn = self.tools.get(call.name)
        if fn is None:
            return ToolResult(name, error_text(f"unknown tool {call.name!r}; available: {', '.join(self.tools)}"),
                              "unknown_tool")
        try:
            inspect.signature(fn).bind(*call.args, **(call.kwargs or {}))
        except TypeError as e:
            return ToolResult(name, error_text(f"bad arguments for {name}: {e}"), "bad_arguments")
        # str() of the result may raise too
        value, kind, dt = bounded(lambda: str(resolve(fn(*call.args, **(call.kwargs or {})))), self.timeout_s, f"tool-{name}")
        if kind == "timeout":
            return ToolResult(name, error_text(f"{name} timed out after {self.timeout_s:g} s"), "timeout", dt)
        if kind == "raised":
            return ToolResult(name, error_text(f"{name} raised {value}"), "raised", dt)
        return ToolResult(name, value, None, dt)

    def call_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One turn's calls, in order (an environment's state may depend on the order); calls past
        ``max_calls``, and those after a :attr:`stateful` tool timed out, are answered with an error
        without running."""
        out: list[ToolResult] = []
        for c in calls[: self.max_calls]:
            stuck = next((r.name for r in out if r.error == "timeout" and r.name in self.stateful), None)
            out.append(self.call(c) if stuck is None else ToolResult(
                c.name or "unknown", error_text(f"not run: {stuck} timed out before it and may still be changing the "
                                                "environment"), "timeout"))
        return out + [ToolResult(c.name or "unknown", error_text(f"more than {self.max_calls} tool calls in one turn"),
                                 "too_many_calls") for c in calls[self.max_calls:]]
