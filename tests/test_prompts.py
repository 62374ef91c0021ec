"""grpo_kit.prompts: chat templates, the plain prompt, and stop strings, on real tokenizers (the
tiny model's byte-level BPE, and SmolLM2-135M-Instruct's with its ChatML template)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from grpo_kit import data, models, tiny
from grpo_kit.prompts import PromptFormat, cut_completion, encode_prompts

SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tiny_tok():
    return AutoTokenizer.from_pretrained(tiny.ensure_tiny_model())


@pytest.fixture(scope="module")
def smol_tok():
    return AutoTokenizer.from_pretrained(models.resolve_model("smollm2-135m"))


def test_plain_prompt_is_the_tiny_models_template(tiny_tok):
    fmt = PromptFormat()
    assert not fmt.uses_chat(tiny_tok)  # the tiny tokenizer has no chat template
    q = "What is 347 + 285?"
    assert fmt.render(tiny_tok, q) == data.format_prompt(q) == (
        "Question: What is 347 + 285?\nGive the final answer as '#### <integer>'.\nAnswer:\n"
    )
    assert fmt.encode(tiny_tok, q) == tiny_tok.encode(data.format_prompt(q), add_special_tokens=False)
    assert PromptFormat(instruction="Answer briefly.").render(tiny_tok, q).splitlines()[1] == "Answer briefly."
    with pytest.raises(ValueError, match="no chat template"):
        PromptFormat(chat_template="always").render(tiny_tok, q)


def test_chat_prompt_on_smollm2(smol_tok):
    fmt = PromptFormat(instruction="Reply as '#### <n>'.")
    assert fmt.uses_chat(smol_tok)
    text = fmt.render(smol_tok, "What is 2 + 3? ")
    assert text == (
        f"<|im_start|>system\n{SMOL_DEFAULT_SYSTEM}<|im_end|>\n"  # the template's own default system prompt
        "<|im_start|>user\nWhat is 2 + 3?\nReply as '#### <n>'.<|im_end|>\n"
        "<|im_start|>assistant\n"  # add_generation_prompt
    )
    ids = fmt.encode(smol_tok, "What is 2 + 3?")
    assert ids[0] == smol_tok.convert_tokens_to_ids("<|im_start|>")  # special tokens are single ids, once
    assert ids.count(smol_tok.eos_token_id) == 2  # <|im_end|> closes the system and the user turns
    own = PromptFormat(system_prompt="You add numbers.").render(smol_tok, "What is 2 + 3?")
    assert own.startswith("<|im_start|>system\nYou add numbers.<|im_end|>\n") and SMOL_DEFAULT_SYSTEM not in own
    plain = PromptFormat(chat_template="never").render(smol_tok, "What is 2 + 3?")
    assert plain == data.format_prompt("What is 2 + 3?")
    with pytest.raises(ValueError, match="chat_template must be one of"):
        PromptFormat(chat_template="sometimes")


CONVERSATION = [{"role": "system", "content": "You are a careful calculator."},
                {"role": "user", "content": "What is 2 + 3?"}]
"""A TRL conversational prompt, its own system message included."""


def test_conversational_prompt_is_rendered_as_it_is_by_the_chat_template(smol_tok):
    """As TRL renders it: the messages through the template, with the generation prompt; the
    conversation's system message replaces the template's default, and the kit's own settings only
    fill in what the conversation lacks."""
    expected = smol_tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert PromptFormat(instruction="").render(smol_tok, CONVERSATION) == expected == (
        "<|im_start|>system\nYou are a careful calculator.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    # the conversation's own system message wins; an instruction goes after the last user message
    fmt = PromptFormat(instruction="Reply as '#### <n>'.", system_prompt="ignored: the rows have one")
    assert fmt.render(smol_tok, CONVERSATION) == expected.replace("2 + 3?<|im_end|>", "2 + 3?\nReply as '#### <n>'.<|im_end|>")
    assert fmt.messages(CONVERSATION[1:])[0] == {"role": "system", "content": "ignored: the rows have one"}
    assert CONVERSATION[1]["content"] == "What is 2 + 3?"  # the row itself is not touched
    p = data.Problem("c", "What is 2 + 3?", "5", messages=CONVERSATION)
    assert encode_prompts(smol_tok, [p], 8, 256, PromptFormat(instruction="")) == [
        smol_tok.encode(expected, add_special_tokens=False)]


def test_conversational_prompt_in_the_plain_format(tiny_tok):
    fmt = PromptFormat(instruction="Be brief.")
    one = [{"role": "user", "content": "What is 2 + 3?"}]
    assert fmt.render(tiny_tok, one) == fmt.render(tiny_tok, "What is 2 + 3?")  # one user message: the text prompt
    few_shot = [*CONVERSATION[:1], {"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "#### 2"},
                *CONVERSATION[1:]]
    assert fmt.render(tiny_tok, few_shot) == ("You are a careful calculator.\nQuestion: 1 + 1?\n\nAnswer:\n#### 2\n"
                                              "Question: What is 2 + 3?\nBe brief.\nAnswer:\n")


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ([], "non-empty list"),  # nothing to render
        ("What is 2 + 3?", "non-empty list"),  # text is not a conversation (Problem.question holds text)
        ([{"content": "hi"}], "message 0: expected a dict with 'role' and 'content'"),
        (["hi"], "message 0: expected a dict"),
        ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "content must be a string"),  # multimodal
        ([{"role": "system", "content": "Be brief."}], "needs a user message"),
        ([{"role": "user", "content": "  "}], "last user message is empty"),
    ],
)
def test_malformed_conversations_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        data.Problem("c", "q", "1", messages=bad)


def test_encode_prompts_rejects_prompts_without_room(smol_tok):
    probs = data.synthetic_problems(2, split="heldout", n_digits=2)
    ids = encode_prompts(smol_tok, probs, 16, 256, PromptFormat())
    assert [len(x) for x in ids] == [len(PromptFormat().encode(smol_tok, p.question)) for p in probs]
    with pytest.raises(ValueError, match=probs[0].id):
        encode_prompts(smol_tok, probs, 250, 256, PromptFormat())


@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_stop_strings_cut_at_the_completing_token(which, tiny_tok, smol_tok):
    tok = tiny_tok if which == "tiny" else smol_tok
    eos = tok.eos_token_id
    text = "7+5=12\n#### 12\n\nQuestion: What is 1 + 1?\n#### 2"
    ids = tok.encode(text, add_special_tokens=False)
    # no stop strings: an EOS-ended completion keeps everything; the text drops the EOS
    cut = cut_completion(tok, ids + [eos], "stop")
    assert (cut.n_tokens, cut.finish_reason, cut.stop, cut.text) == (len(ids) + 1, "stop", None, text)
    cut = cut_completion(tok, ids, "length", ())
    assert (cut.n_tokens, cut.finish_reason, cut.text) == (len(ids), "length", text)
    # a stop string: the kept tokens are the shortest prefix whose text contains it
    for finish, tail in (("stop", [eos]), ("length", [])):
        cut = cut_completion(tok, ids + tail, finish, ("\n\n",))
        assert (cut.finish_reason, cut.stop, cut.text) == ("stop", "\n\n", "7+5=12\n#### 12")
        kept = tok.decode(ids[: cut.n_tokens])
        assert "\n\n" in kept and "\n\n" not in tok.decode(ids[: cut.n_tokens - 1])
    # the earliest of several stop strings wins, whatever their order in the list
    cut = cut_completion(tok, ids, "length", ("Question:", "####"))
    assert (cut.stop, cut.text) == ("####", "7+5=12\n")
    # a stop string that never occurs changes nothing
    assert cut_completion(tok, ids, "length", ("STOP",)).n_tokens == len(ids)
    # overlapping stop strings: the one completed first wins (where a sampler checking after each token
    # stops), not the one starting first, so a completion cut afterwards keeps what vLLM would have
    for stop in (("\nQuestion: What", "Question"), ("Question", "\nQuestion: What")):
        cut = cut_completion(tok, ids, "length", stop)
        first = next(k for k in range(1, len(ids) + 1) if any(x in tok.decode(ids[:k]) for x in stop))
        assert (cut.n_tokens, cut.stop) == (first, "Question") and cut.text == "7+5=12\n#### 12\n\n"
        assert cut_completion(tok, ids[:first], "length", stop) == cut  # the same cut on what vLLM returns


@pytest.mark.parametrize("which", ["tiny", "smol"])
@pytest.mark.parametrize(("text", "stop"), [("ab→c", "→"), ("ab🙂c", "🙂"), ("x = 5 → y\n\nQ", "→ y"),
                                            ("so 5 €\n#### 5", "€\n")])
def test_stop_string_ending_in_a_multibyte_character(which, text, stop, tiny_tok, smol_tok):
    """A prefix that ends inside a multi-byte UTF-8 character decodes to U+FFFD, one character as
    long as the stop string's last one: the cut must not stop there, before the stop string is out
    (byte-level BPE: the tiny tokenizer spells "→" in 3 byte tokens, SmolLM2's "🙂" in 2)."""
    tok = tiny_tok if which == "tiny" else smol_tok
    ids = tok.encode(text, add_special_tokens=False)
    shortest = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    head = text[: text.index(stop) + len(stop)]
    assert shortest == len(tok.encode(head, add_special_tokens=False))  # the prefix spelling the stop string
    for finish, tail in (("stop", [tok.eos_token_id]), ("length", [])):
        cut = cut_completion(tok, ids + tail, finish, (stop,))
        assert (cut.n_tokens, cut.finish_reason, cut.stop, cut.text) == (shortest, "stop", stop, text[: text.index(stop)])


def test_a_plain_prompt_gets_the_tokenizers_bos_as_trl_gives_it():
    """A Llama-style tokenizer adds a BOS; a plain prompt (no chat template) has no BOS in its text,
    so it is tokenized with the tokenizer's special tokens, as TRL tokenizes it; the multi-turn plain
    renderer does the same. The built-in models' tokenizers add none (their ids do not change)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from grpo_kit.renderers import PlainRenderer

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for w in "Question : What is 2 + ? Give the final answer as '#### <integer>' . Answer".split():
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fmt = PromptFormat(chat_template="never")
    ids = fmt.encode(tok, "What is 2 + 2?")
    assert ids == tok(fmt.render(tok, "What is 2 + 2?"))["input_ids"] and ids[0] == tok.bos_token_id
    assert PlainRenderer(tok).encode_prompt("Question: What is 2 + 2?")[0] == tok.bos_token_id


def test_raw_text_prompts_are_tokenized_as_trl_tokenizes_them(tiny_tok, smol_tok):
    """Review finding: TRL sends a text prompt (its standard format) as it is, through
    ``processing_class(text=...)``; no kit mode did (the chat template wrapped it, with SmolLM2's
    default system message, or the plain format did). ``chat_template="raw"`` does; a conversation
    still renders with the chat template, as TRL renders it."""
    raw = PromptFormat(instruction="", chat_template="raw")
    for tok in (tiny_tok, smol_tok):
        for text in ("Solve: 2+2=", "  leading and trailing spaces kept \n", "Question: 1 + 2\nAnswer:\n"):
            assert raw.encode(tok, text) == tok(text)["input_ids"]
            assert raw.render(tok, text) == text
    conv = [{"role": "user", "content": "What is 2 + 2?"}]
    assert raw.encode(smol_tok, conv) == PromptFormat(instruction="").encode(smol_tok, conv)
    from grpo_kit.config import profile

    assert profile("smol", chat_template="raw").prompt.chat_template == "raw"
