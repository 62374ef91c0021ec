"""Prompts and stop rules: the one place that turns a question into prompt token ids and decides
where a sampled completion ends. Every engine uses it, so the trainer (which receives the engines'
token ids) scores exactly the prompt that was sampled from.

- Chat models: when the tokenizer has a chat template (and ``chat_template`` is not ``"never"``),
  the prompt is ``[system?, user: "<question>\\n<instruction>"]`` rendered with
  ``add_generation_prompt=True``. With ``system_prompt=None`` the template's own default applies
  (SmolLM2's ChatML template inserts "You are a helpful AI assistant named SmolLM...").
- Plain models (the tiny model has no template): ``Question: <question>\\n<instruction>\\nAnswer:\\n``,
  the template the tiny model was pretrained on.
- Conversational prompts (a problem's ``messages``, TRL's conversational format): the conversation
  as it is, rendered with the chat template and ``add_generation_prompt=True`` (as TRL renders it);
  a non-empty ``instruction`` is appended to its last user message, and ``system_prompt`` is added
  only to a conversation that has no system message of its own. Without a template the conversation
  is written in the plain format (:meth:`PromptFormat.plain`): each user message as the plain prompt
  of that question (the instruction after the last one only), a system message's text as a line
  before it, an assistant message's text as a line after its ``Answer:``, a tool message as
  ``Result: ...``. A conversation of one user message renders exactly as the text prompt of that question.
- Raw text (``chat_template="raw"``, TRL's standard format as TRL sends it): a text prompt is
  tokenized as it is, with the tokenizer's own special tokens and nothing added (no template,
  instruction or system prompt); a conversation renders as with ``"auto"``.
- Stops: a completion ends at the model's EOS (kept as its last token, with its log-prob) or at the
  first configured stop string. For a stop string the completion keeps the tokens up to and
  including the one that completes it (their sampling log-probs unchanged: the cut only drops
  later tokens), ``text`` ends before the stop string, and ``finish_reason`` is ``"stop"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import data
from .config import CHAT_TEMPLATE_MODES, Config


@dataclass(frozen=True)
class PromptFormat:
    """How a question becomes a prompt (see the module docstring)."""

    instruction: str = data.DEFAULT_INSTRUCTION
    """The answer-format instruction after the question."""
    system_prompt: str | None = None
    """System message for chat templates; None keeps the template's default."""
    chat_template: str = "auto"
    """``"auto"`` uses the tokenizer's chat template when it has one; ``"always"`` requires one;
    ``"never"`` uses the plain template; ``"raw"`` sends a text prompt as it is (module docstring)."""

    def __post_init__(self) -> None:
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template must be one of {CHAT_TEMPLATE_MODES}, got {self.chat_template!r}")

    def uses_chat(self, tokenizer) -> bool:
        has = bool(getattr(tokenizer, "chat_template", None))
        if self.chat_template == "always" and not has:
            raise ValueError("chat_template='always' but the tokenizer has no chat template")
        return has and self.chat_template != "never"

    def messages(self, prompt: str | Sequence[dict]) -> list[dict]:
        """The chat messages of a question (text) or of a conversation (copied; module docstring)."""
        if isinstance(prompt, str):
            msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
            return msgs + [{"role": "user", "content": f"{prompt.strip()}\n{self.instruction}".strip()}]
        data.check_messages(prompt)
        msgs = [dict(m) for m in prompt]
        if self.instruction.strip():
            last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
            msgs[last]["content"] = f"{msgs[last]['content'].strip()}\n{self.instruction}"
        if self.system_prompt is not None and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def plain(self, conversation: Sequence[dict]) -> str:
        """A conversation in the plain format (module docstring).

        >>> PromptFormat(instruction="Be brief.").plain([{"role": "user", "content": "2+2?"}]) == \\
        ...     data.format_prompt("2+2?", "Be brief.")
        True
        """
        data.check_messages(conversation)
        last = max(i for i, m in enumerate(conversation) if m["role"] == "user")
        out = []
        for i, m in enumerate(conversation):
            text = m["content"].strip()
            if m["role"] == "user":
                out.append(data.format_prompt(text, self.instruction if i == last else ""))
            elif m["role"] == "tool":
                out.append(f"Result: {text}\n")
            else:  # system: a line before; assistant: its text after the ``Answer:`` line
                out.append(f"{text}\n")
        return "".join(out)

    def raw(self, prompt: str | Sequence[dict]) -> bool:
        """Whether ``prompt`` is sent as it is (a text prompt under ``chat_template="raw"``)."""
        return self.chat_template == "raw" and isinstance(prompt, str)

    def render(self, tokenizer, prompt: str | Sequence[dict]) -> str:
        """The prompt as text: a question (text) or a conversation (messages)."""
        if self.raw(prompt):
            return prompt
        if self.uses_chat(tokenizer):
            return tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True, tokenize=False)
        return data.format_prompt(prompt, self.instruction) if isinstance(prompt, str) else self.plain(prompt)

    def encode(self, tokenizer, prompt: str | Sequence[dict]) -> list[int]:
        """The prompt's token ids. A chat template's text carries its special tokens itself (a BOS
        included, where the template writes one); the plain text gets the tokenizer's own (a Llama,
        Gemma or Mistral base model's BOS), as TRL tokenizes a plain prompt (``processing_class(text=...)``)."""
        text = self.render(tokenizer, prompt)
        return list(tokenizer.encode(text, add_special_tokens=self.raw(prompt) or not self.uses_chat(tokenizer)))


def prompt_of(p: data.Problem) -> str | list[dict]:
    """What a problem's prompt is rendered from: its conversation, or else its question."""
    return p.messages if p.messages is not None else p.question


def encode_prompts(tokenizer, problems: Sequence[data.Problem], max_new_tokens: int, max_len: int,
                   fmt: PromptFormat | None = None) -> list[list[int]]:
    """Token ids of each problem's prompt; a prompt that leaves no room for the completion raises."""
    fmt = fmt or PromptFormat()
    out = []
    for p in problems:
        ids = fmt.encode(tokenizer, prompt_of(p))
        if not ids:
            raise ValueError(f"problem {p.id!r}: the prompt tokenizes to nothing")
        if len(ids) + max_new_tokens > max_len:
            raise ValueError(
                f"problem {p.id!r}: prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"engine's context of {max_len} tokens (raise max_model_len or shorten the prompt)"
            )
        out.append(ids)
    return out


@dataclass(frozen=True)
class Cut:
    """Where a completion ends under the stop rules."""

    n_tokens: int
    """Tokens kept."""
    finish_reason: str
    """``"stop"`` or ``"length"``."""
    stop: str | None
    """The stop string that ended it; None for EOS or length."""
    text: str
    """Decoded text of the kept tokens, without the EOS token or the stop string."""


def cut_completion(tokenizer, ids: Sequence[int], finish_reason: str, stop: Sequence[str] = ()) -> Cut:
    """Apply the stop strings to a completion that ended by EOS (``"stop"``, EOS last) or length.

    The stop string completed first wins, as a sampler that checks after each token stops (vLLM,
    ``sample_ids``), so a completion cut after the fact (HF ``generate``) keeps the same tokens; among
    those the same token completes, the one that starts earliest. The kept tokens are the shortest
    prefix whose text contains a stop string (found by bisection over prefix decodes, which grow
    monotonically). Containment, not length: a prefix that ends inside a multi-byte character decodes
    to U+FFFD, as long as the character it has not finished.
    """
    ids = list(ids)
    body = ids[:-1] if finish_reason == "stop" else ids
    text = tokenizer.decode(body, skip_special_tokens=True)
    live = [s for s in stop if s and s in text]
    if not live:
        return Cut(len(ids), finish_reason, None, text)
    lo, hi = 1, len(body)  # smallest k with a stop string in decode(body[:k])
    while lo < hi:
        mid = (lo + hi) // 2
        head = tokenizer.decode(body[:mid], skip_special_tokens=True)
        if any(s in head for s in live):
            hi = mid
        else:
            lo = mid + 1
    head = tokenizer.decode(body[:lo], skip_special_tokens=True)
    at, s = min((head.find(s), s) for s in live if s in head)
    return Cut(lo, "stop", s, text[:at])


def prompt_format(cfg: Config, instruction: str = data.DEFAULT_INSTRUCTION) -> PromptFormat:
    """The run's prompt format; ``instruction`` is the task's, used unless ``cfg.prompt.instruction`` is set."""
    p = cfg.prompt
    return PromptFormat(instruction=instruction if p.instruction is None else p.instruction,
                        system_prompt=p.system_prompt, chat_template=p.chat_template)
