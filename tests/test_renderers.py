"""Renderers: prompts with tools, environment segments, and the prefix-property checks (on SmolLM2's
tokenizer and ChatML template, and on small templates written to break the property)."""

from __future__ import annotations

import pytest

from grpo_kit import data, models
from grpo_kit.prompts import PromptFormat
from grpo_kit.renderers import TOOLS_SYSTEM, ChatRenderer, PlainRenderer, PrefixError, supports_tools
from grpo_kit.tools import tool_schema

NATIVE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A ChatML template that renders ``tools=`` (as Qwen2.5's does)."""


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: The key.
    """
    return key


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.resolve_model("smollm2-135m"))


def test_which_templates_render_tools(tok):
    assert not supports_tools(tok)  # SmolLM2's ChatML template ignores tools=
    assert supports_tools(tok, chat_template=NATIVE)


def test_prompts_without_tools_are_the_single_turn_prompts(tok):
    fmt = PromptFormat()
    q = "What is 2 + 3?"
    assert ChatRenderer(tok).prompt(fmt.messages(q), []) == fmt.render(tok, q)
    assert PlainRenderer(tok).prompt(fmt.messages(q), []) == data.format_prompt(q)  # the tiny model's template
    # review finding: a conversation's system message and earlier turns were dropped from the plain prompt
    conv = [{"role": "system", "content": "Use base 8."}, {"role": "user", "content": "What is 1+1?"},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "What is 5+5?"}]
    assert PlainRenderer(tok).prompt(fmt.messages(conv), []) == fmt.plain(conv)
    assert "Use base 8.\n" in fmt.plain(conv) and "What is 1+1?" in fmt.plain(conv)


def test_tools_reach_the_prompt(tok):
    schemas = [tool_schema(lookup)]
    msgs = PromptFormat().messages("q")
    described = ChatRenderer(tok).prompt(msgs, schemas)
    assert msgs[0]["role"] == "system" and described.startswith("<|im_start|>system\nYou can call these tools")
    assert '"name": "lookup"' in described and "<tool_call>" in described
    native = ChatRenderer(tok, chat_template=NATIVE).prompt(PromptFormat().messages("q"), schemas)
    assert '"name": "lookup"' in native and TOOLS_SYSTEM[:20] not in native
    assert PlainRenderer(tok).prompt(PromptFormat().messages("q"), schemas).startswith("Tool: lookup(key) Look a key up.\n")


def test_chatml_environment_segment(tok):
    r = ChatRenderer(tok)
    msgs = PromptFormat().messages("q")
    history = r.prompt(msgs, []) + "call it<|im_end|>"
    msgs += [{"role": "assistant", "content": "call it"}, {"role": "tool", "name": "lookup", "content": "v"}]
    assert r.extend(msgs, history, []) == "\n<|im_start|>tool\nv<|im_end|>\n<|im_start|>assistant\n"


def test_a_turn_ended_by_another_token_than_the_template_writes_is_refused(tok):
    r = ChatRenderer(tok)
    msgs = PromptFormat().messages("q")
    history = r.prompt(msgs, []) + "call it<|endoftext|>"  # the model stopped on EOS, the template ends turns with im_end
    msgs += [{"role": "assistant", "content": "call it"}, {"role": "tool", "name": "lookup", "content": "v"}]
    with pytest.raises(PrefixError, match="another token"):
        r.extend(msgs, history, [])


def test_plain_environment_segment(tok):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<call>f()</call>"},
            {"role": "tool", "name": "f", "content": "1"}, {"role": "tool", "name": "f", "content": "2"}]
    assert PlainRenderer(tok).extend(msgs, "anything", []) == "\nResult: 1\n\nResult: 2\n"


def test_both_renderers_take_the_runs_stop_strings():
    """Review finding: a model without a chat template got the plain renderer with only the call's
    closing tag, so ``sampling.stop`` did not end its turns in multi-turn episodes."""
    from types import SimpleNamespace

    from grpo_kit.renderers import PLAIN_STOP, for_engine

    engine = SimpleNamespace(tokenizer=None, stop=("\n\n", PLAIN_STOP), prompt_format=PromptFormat(chat_template="never"))
    assert for_engine(engine).stop == (PLAIN_STOP, "\n\n")
    assert PlainRenderer(None).stop == (PLAIN_STOP,)
