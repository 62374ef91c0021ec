"""Renderers: how an episode's conversation becomes token ids, appended once and never re-tokenized.

An episode is one token stream (:mod:`grpo_kit.episode`): the prompt's ids, then each model turn's
sampled ids verbatim, then the environment's ids, and so on. A renderer makes the two kinds of ids
the policy did not sample: the prompt (:meth:`prompt`) and, after a turn with tool calls, the
environment segment (:meth:`extend`): the tool messages and the next assistant header.

- :class:`ChatRenderer` (models with a chat template) renders the whole conversation so far, tool
  messages included, with ``add_generation_prompt=True`` and takes the text past what the stream
  already holds. The assistant messages carry the exact decoded text of each turn (tool-call markup
  included, ``tool_calls`` not set), so a template that renders history verbatim reproduces the
  stream. Two checks make that an invariant instead of an assumption, each a :class:`PrefixError`
  that names the fix: (1) text: the rendering starts with the stream's text (prompt, the decoded
  turns with their end-of-turn tokens, earlier environment segments); Qwen3's template breaks it
  (checked with its real template) by re-rendering past ``<think>`` blocks in its own whitespace and
  dropping those before the last user message, and any template does when the model ended its turn
  with another token than the template writes; (2) tokens: the environment text tokenizes to
  the same ids alone as at the end of the whole rendering (SentencePiece's leading space, or a BPE
  merge across the boundary, break it). Sampled ids are never compared with a re-tokenization: a
  non-canonical tokenization the model sampled is what it saw, and it stays.
  Tools go to the template as ``tools=`` (their JSON schemas) when the template renders them;
  otherwise (SmolLM2's ChatML template ignores ``tools=``) they are described, with the Hermes call
  format, in a system message (:data:`TOOLS_SYSTEM`), which replaces the template's default one.
- :class:`PlainRenderer` (the tiny model, no template): the kit's plain prompt
  (``Question: <user message>\\nAnswer:\\n``, i.e. ``data.PROMPT_TEMPLATE``) with a line per tool
  before it; a tool answer is appended as ``"\\nResult: <content>\\n"`` (:data:`PLAIN_RESULT`).
  This format is defined by the stream itself, so there is no template to check against.

A tool's answer is text the policy can steer (a tool that echoes its arguments, a Python tool that
prints): the environment's ids are made by :func:`environment_ids`, which tokenizes an added
token's text inside an answer (``<|im_end|>``, ``<eos>``, Qwen's ``</tool_response>``) as its
characters, never as the token, so an answer cannot end the tool message early or forge a user or
assistant turn in the stream; the template's own tokens stay what they are.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Protocol

from .tools import PLAIN_STOP

TOOLS_SYSTEM = ("You can call these tools (JSON schemas):\n{schemas}\nTo call a tool, write "
                '<tool_call>{{"name": <tool name>, "arguments": <JSON object>}}</tool_call> and end your turn.')
"""The system message that describes tools to a chat template that ignores ``tools=``."""
PLAIN_RESULT = "\nResult: {content}\n"
"""A tool answer in the plain format."""


class PrefixError(ValueError):
    """The chat template does not extend the episode's stream (see the module docstring)."""


class Renderer(Protocol):
    """What the episode runner needs from a renderer."""

    tokenizer: object
    format: str
    """The tool-call format its model writes (a :data:`grpo_kit.tools.PARSERS` name)."""
    stop: tuple[str, ...]
    """Stop strings that end a turn (besides the model's stop ids)."""

    def prompt(self, messages: list[dict], schemas: Sequence[dict]) -> str: ...

    def extend(self, messages: list[dict], history: str, schemas: Sequence[dict]) -> str:
        """The environment text that follows ``history`` (the stream so far, as text) once the tool
        messages at the end of ``messages`` are added, up to the next assistant header."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def continues_after(self, stop_text: str) -> bool:
        """Whether a turn that ended on a stop id whose text is ``stop_text`` can be followed by the
        environment's answers (the template ends assistant turns with it); optional, default True."""
        ...


def continues_after(renderer, stop_text: str) -> bool:
    """``renderer.continues_after(stop_text)``, True for a renderer without that method."""
    method = getattr(renderer, "continues_after", None)
    return True if method is None else bool(method(stop_text))


def turn_end_text(tokenizer, **template_kwargs) -> str:
    """What the chat template writes after an assistant message's content (ChatML: ``"<|im_end|>\\n"``);
    empty when it writes nothing there or a probe conversation cannot be rendered."""
    probe = "PROBE_c41e"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **template_kwargs)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: no end text known
        return ""
    at = text.rfind(probe)
    return text[at + len(probe):] if at >= 0 else ""


def encode(tokenizer, text: str) -> list[int]:
    """Text to ids the way prompts are tokenized (the rendered text carries its special tokens)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def added_strings(tokenizer) -> list[str]:
    """The strings the tokenizer turns into one added token, special or not (Qwen's ``<tool_call>``
    and ``</tool_response>`` are added tokens not marked special), longest first."""
    found = {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()}
    found.update(getattr(tokenizer, "all_special_tokens", None) or [])
    return sorted((t for t in found if t), key=len, reverse=True)


def environment_ids(renderer, messages: list[dict], history: str, schemas: Sequence[dict], text: str) -> list[int]:
    """The ids of the environment segment ``text`` (``renderer.extend(messages, history, schemas)``):
    as :func:`encode`, except where a tool answer (the tool messages at the end of ``messages``) holds
    an added token's text (``<|im_end|>``, ``<eos>``, Qwen's ``</tool_response>``). Then the answers'
    exact places in ``text`` are taken from a rendering with a placeholder for each answer, and each
    answer is tokenized as its characters, never as the added token, so it cannot close the tool
    message or forge a turn; the template's own tokens stay what they are. A template that does not
    render every answer verbatim, once, raises ``ValueError``: which tokens are the template's could
    not be told."""
    tokenizer = renderer.tokenizer
    n = len(messages)
    while n and messages[n - 1]["role"] == "tool":
        n -= 1
    answers = [str(m["content"]) for m in messages[n:]]
    added = added_strings(tokenizer)
    if not any(t in a for a in answers for t in added):
        return encode(tokenizer, text)
    marks = [f"GRPOKITANSWER{k}X{secrets.token_hex(6)}" for k in range(len(answers))]
    marked = renderer.extend(messages[:n] + [{**m, "content": mark} for m, mark in zip(messages[n:], marks, strict=True)],
                             history, schemas)
    spans, rebuilt, pos = [], "", 0
    for mark, answer in zip(marks, answers, strict=True):
        at = marked.find(mark, pos)
        if at < 0 or marked.count(mark) != 1:
            raise ValueError("a tool answer holds an added token's text and the template does not render each answer "
                             "once, verbatim, so its ids cannot be told from the template's")
        rebuilt += marked[pos:at]
        spans.append((len(rebuilt), len(rebuilt) + len(answer)))
        rebuilt += answer
        pos = at + len(mark)
    if rebuilt + marked[pos:] != text:
        raise ValueError("a tool answer holds an added token's text and the template does not render it verbatim, "
                         "so its ids cannot be told from the template's")
    ids, pos = [], 0
    for start, end in spans:
        ids += encode(tokenizer, text[pos:start]) + as_characters(tokenizer, text[start:end], added)
        pos = end
    return ids + encode(tokenizer, text[pos:])


def as_characters(tokenizer, text: str, added: Sequence[str]) -> list[int]:
    """``text``'s ids with no added token among them: an added token's text is tokenized as its first
    character and the rest, each as plain text (``split_special_tokens``)."""
    def plain(piece: str) -> list[int]:
        return list(tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)) if piece else []

    if not added:
        return plain(text)
    ids, pos = [], 0
    for m in re.finditer("|".join(map(re.escape, added)), text):
        ids += plain(text[pos:m.start()]) + plain(m.group()[0]) + as_characters(tokenizer, m.group()[1:], added)
        pos = m.end()
    return ids + plain(text[pos:])


def decode(tokenizer, ids: Sequence[int]) -> str:
    """Ids to the exact text they stand for, special tokens included."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def supports_tools(tokenizer, **template_kwargs) -> bool:
    """Whether the chat template renders ``tools=`` (a probe schema changes the rendering)."""
    probe = [{"type": "function", "function": {"name": "probe_tool_7f3a", "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "user", "content": "hi"}]
    plain = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **template_kwargs)
    with_tools = tokenizer.apply_chat_template(msgs, tools=probe, tokenize=False, add_generation_prompt=True,
                                               **template_kwargs)
    return plain != with_tools


def first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class ChatRenderer:
    """A chat template as the episode renderer (module docstring); ``template_kwargs`` go to every
    ``apply_chat_template`` call (e.g. ``chat_template=`` a prefix-preserving template)."""

    format = "hermes"

    def __init__(self, tokenizer, *, stop: Sequence[str] = (), **template_kwargs) -> None:
        if not getattr(tokenizer, "chat_template", None) and "chat_template" not in template_kwargs:
            raise ValueError("ChatRenderer needs a tokenizer with a chat template (use PlainRenderer)")
        self.tokenizer, self.stop, self.template_kwargs = tokenizer, tuple(stop), template_kwargs
        self.native_tools = supports_tools(tokenizer, **template_kwargs)
        self.turn_end = turn_end_text(tokenizer, **template_kwargs)
        """What the template writes after an assistant turn's content (:func:`turn_end_text`)."""

    def continues_after(self, stop_text: str) -> bool:
        """False when the template ends assistant turns with other text than ``stop_text`` (a model
        with two EOS ids that ended a ChatML turn with ``<|endoftext|>`` instead of ``<|im_end|>``):
        no rendering of the conversation could extend that stream. True when the template's end of
        turn is unknown (the prefix check then decides)."""
        return not self.turn_end or self.turn_end.startswith(stop_text)

    def render(self, messages: list[dict], schemas: Sequence[dict]) -> str:
        """The conversation up to the next assistant header."""
        tools = {"tools": list(schemas)} if self.native_tools and schemas else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **tools,
                                                  **self.template_kwargs)

    def prompt(self, messages: list[dict], schemas: Sequence[dict]) -> str:
        """The prompt's text; the tools' system message is added to ``messages`` when the template
        does not render ``tools=``."""
        if schemas and not self.native_tools:
            text = TOOLS_SYSTEM.format(schemas="\n".join(json.dumps(s) for s in schemas))
            if messages and messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
            else:
                messages.insert(0, {"role": "system", "content": text})
        return self.render(messages, schemas)

    def extend(self, messages: list[dict], history: str, schemas: Sequence[dict]) -> str:
        full = self.render(messages, schemas)
        if not full.startswith(history):
            at = first_difference(full, history)
            raise PrefixError(
                "the chat template does not render the episode so far as the stream holds it: at character "
                f"{at} the stream has {history[max(0, at - 30): at + 30]!r} but the template renders "
                f"{full[max(0, at - 30): at + 30]!r}. The template re-renders earlier turns differently (Qwen3's "
                "reformats past <think> blocks as '<think>\\n...\\n</think>\\n\\n' and drops those before the last "
                "user message), or the model ended its turn with another token than the template writes. Fix: pass "
                "chat_template= a template that renders past assistant turns verbatim (for Qwen3, its own template "
                "with the assistant branch reduced to {{ message.content }}); TRL's get_training_chat_template keeps "
                "past reasoning but still reformats it")
        env = full[len(history):]
        ids, whole, head = self.encode(env), self.encode(full), self.encode(history)
        if head + ids != whole:
            raise PrefixError(
                f"the environment text {env[:60]!r} tokenizes differently alone ({ids[:8]}...) than after the "
                f"conversation ({whole[len(head):len(head) + 8]}...): SentencePiece's leading space or a merge "
                "across the boundary. Fix: a template whose tool and assistant headers start with a special token, "
                "or a tokenizer without a dummy prefix (e.g. legacy=False, add_prefix_space=False)")
        return env

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)


class PlainRenderer:
    """The plain format for a model without a chat template (module docstring)."""

    format = "plain"

    def __init__(self, tokenizer, *, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = (PLAIN_STOP, *(s for s in stop if s != PLAIN_STOP))
        """Stop strings that end a turn: the plain call's closing tag, then the run's own (``sampling.stop``)."""

    def prompt(self, messages: list[dict], schemas: Sequence[dict]) -> str:
        """A line per tool, then the conversation as the single-turn plain prompt renders it
        (:meth:`grpo_kit.prompts.PromptFormat.plain`: a system message's text as a line, each user
        turn as a question, earlier answers and tool results after it), the last user message
        holding the instruction already (``PromptFormat.messages``). Until 2026-12-03 only the last
        user message was kept (a review: a conversation's system message and earlier turns were lost)."""
        lines = [f"Tool: {s['function']['name']}({', '.join(s['function']['parameters'].get('properties', {}))})"
                 f" {s['function'].get('description', '')}".rstrip() for s in schemas]
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        out = []
        for i, m in enumerate(messages):
            text = m["content"].strip() if i != last else m["content"]
            if m["role"] == "user":  # data.PROMPT_TEMPLATE: an earlier turn's instruction is empty
                out.append(f"Question: {text}\n{'' if i == last else chr(10)}Answer:\n")
            elif m["role"] == "tool":
                out.append(f"Result: {text}\n")
            else:
                out.append(f"{text}\n")
        return "".join(f"{line}\n" for line in lines) + "".join(out)

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt's ids with the tokenizer's own special tokens (a BOS), as a plain single-turn
        prompt is encoded (:meth:`grpo_kit.prompts.PromptFormat.encode`)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def extend(self, messages: list[dict], history: str, schemas: Sequence[dict]) -> str:
        tail = []
        for m in reversed(messages):
            if m["role"] != "tool":
                break
            tail.insert(0, PLAIN_RESULT.format(content=m["content"]))
        return "".join(tail)

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)


def for_engine(engine) -> Renderer:
    """The renderer of an engine's prompts: :class:`ChatRenderer` where its prompt format uses the
    chat template, else :class:`PlainRenderer`; either with the engine's stop strings (``sampling.stop``)."""
    if engine.prompt_format.uses_chat(engine.tokenizer):
        return ChatRenderer(engine.tokenizer, stop=getattr(engine, "stop", ()))
    return PlainRenderer(engine.tokenizer, stop=getattr(engine, "stop", ()))
