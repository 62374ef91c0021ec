"""The tiny base model: built, cached, and loadable by transformers and PEFT (and vLLM: tests/test_export.py)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_kit import data, tiny


@pytest.fixture(scope="module")
def tiny_path():
    return tiny.ensure_tiny_model()


def test_build_is_cached_by_spec(tmp_path):
    spec = tiny.TinySpec(steps=3, batch_size=4, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, num_layers=1)
    path = tiny.ensure_tiny_model(spec, cache_dir=tmp_path, progress=False)
    assert {"config.json", "model.safetensors", "tokenizer.json", "grpo_kit_tiny.json"} <= {p.name for p in path.iterdir()}
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_model(spec, cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other = tiny.TinySpec(**{**spec.__dict__, "seed": 1})
    assert other.key() != spec.key()
    assert tiny.tiny_info(path)["spec"]["steps"] == 3


@pytest.mark.parametrize("spec", [tiny.TinySpec(), tiny.TOOLS_SPEC], ids=["tiny", "tiny-tools"])
def test_built_in_models_are_shipped_and_copied_not_pretrained(spec, tmp_path, monkeypatch):
    """The kit ships both built-in tiny models (tiny.PREBUILT) for the specs it names: a change to a
    spec, the stream format or the prompt template changes the key and must come with a re-shipped
    build (``GRPO_KIT_TINY_BUILD=1 python -m grpo_kit.models tiny``, then copy it), or every fresh
    clone pretrains for minutes again. ensure_tiny_model copies the shipped files byte for byte."""
    shipped = tiny.prebuilt(spec)
    assert shipped is not None and shipped.name == f"tiny-{spec.key()}", sorted(p.name for p in tiny.PREBUILT.iterdir())

    def no_pretraining(*a, **k):
        raise AssertionError("pretrained although a shipped copy exists")

    monkeypatch.setattr(tiny, "pretrain", no_pretraining)
    path = tiny.ensure_tiny_model(spec, cache_dir=tmp_path)
    assert path == tmp_path / shipped.name
    assert {f.name: f.read_bytes() for f in path.iterdir()} == {f.name: f.read_bytes() for f in shipped.iterdir()}
    assert tiny.tiny_info(path)["key"] == spec.key() and tiny.tiny_info(path)["pretrain_s"] > 0

    # review finding: a copy whose folder exists without its marker (an interrupted copy) failed for
    # good, leaving another .copy-* folder each time
    again = tmp_path / "interrupted"
    (again / shipped.name).mkdir(parents=True)
    (again / shipped.name / "config.json").write_text("{}")
    assert tiny.ensure_tiny_model(spec, cache_dir=again) == again / shipped.name
    assert tiny.tiny_info(again / shipped.name)["key"] == spec.key()
    assert [p.name for p in again.iterdir() if p.name.startswith(".copy-")] == []

    monkeypatch.setenv("GRPO_KIT_TINY_BUILD", "1")  # pretrain anyway
    assert tiny.prebuilt(spec) is None
    with pytest.raises(AssertionError, match="pretrained although"):
        tiny.ensure_tiny_model(spec, cache_dir=tmp_path / "again")


def test_a_shipped_copy_of_another_spec_is_not_used(tmp_path, monkeypatch):
    """A directory named for a key whose build record holds another spec is not taken."""
    spec = tiny.TinySpec(steps=3)
    fake = tmp_path / "prebuilt" / f"tiny-{spec.key()}"
    fake.mkdir(parents=True)
    (fake / "grpo_kit_tiny.json").write_text(json.dumps({"key": spec.key(), "spec": {**spec.__dict__, "steps": 4}}))
    monkeypatch.setattr(tiny, "PREBUILT", tmp_path / "prebuilt")
    assert tiny.prebuilt(spec) is None
    (fake / "grpo_kit_tiny.json").write_text(json.dumps({"key": spec.key(), "spec": spec.__dict__}))
    assert tiny.prebuilt(spec) == fake
    mixed = tiny.TinySpec(task="multiply", steps=3, extra_shapes=((2, 1),))  # its record holds the shapes as lists
    shipped = tmp_path / "prebuilt" / f"tiny-{mixed.key()}"
    shipped.mkdir()
    (shipped / "grpo_kit_tiny.json").write_text(json.dumps({"key": mixed.key(), "spec": mixed.__dict__}))
    assert tiny.prebuilt(mixed) == shipped


def test_tokenizer_round_trips_and_spells_digits():
    tok = tiny.build_tokenizer()
    for p in data.synthetic_problems(20, seed=4):
        text = p.prompt + p.solution
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    pieces = tok.convert_ids_to_tokens(tok.encode("#### 632", add_special_tokens=False))
    assert pieces[-3:] == ["6", "3", "2"]
    assert tiny.build_tokenizer().get_vocab() == tok.get_vocab()  # deterministic


def test_loads_with_auto_classes_and_peft(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    assert model.config.model_type == "qwen3"
    prompt = data.synthetic_problems(1, split="heldout")[0].prompt
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "####" in text  # the pretrained model answers in GSM8K format
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert trainable == sum(p.numel() for p in peft_model.parameters() if p.requires_grad) > 0


# vLLM loading the tiny model and matching transformers' greedy tokens: tests/test_export.py's vLLM
# test (its one engine is built on a merged export, whose config and tokenizer are the tiny model's
# files, then runs the tiny model's own weights, reloaded, against HF greedy, 40 tokens each).


# ----------------------------------------------------------------------------- the tool-use variant

SMALL_TOOLS = tiny.TinySpec(task="multiply", tool_rate=0.5, steps=3, batch_size=4, hidden_size=32, num_heads=2,
                            num_kv_heads=1, intermediate_size=64, num_layers=1)


def test_default_spec_key_is_unchanged_by_the_tool_fields():
    assert tiny.TinySpec().key() == "acf39a0b1f31"  # the addition model built before the tool fields: still valid
    assert tiny.TinySpec(tool_rate=0.9, factor_digits=3).key() == tiny.TinySpec().key()  # they do not apply to "add"
    keys = {tiny.TinySpec(task="multiply").key(), tiny.TinySpec(task="multiply", tool_rate=0.5).key(), tiny.TinySpec().key()}
    assert len(keys) == 3
    with pytest.raises(ValueError):
        tiny.TinySpec(task="divide")
    with pytest.raises(ValueError):
        tiny.TinySpec(task="multiply", tool_rate=1.5)


def test_extra_shapes_cover_every_result_length_and_never_ask_for_more_questions_than_exist():
    """The tool model's pretraining shapes (``extra_shapes``): products of every length from 2 to 6
    digits are demonstrated (a model that saw mostly 5-digit results did not copy a 4-digit one:
    bench/tool_copy.py), each shape capped at the questions it has, none held out; a spec without
    extra shapes keeps its key (the shipped tiny-tools build of before still matches its spec)."""
    from grpo_kit.tasks import calculator

    assert tiny.TinySpec(task="multiply", tool_rate=0.3).key() == "ecc4570c71fa"
    mixed = tiny.TinySpec(task="multiply", extra_shapes=((2, 1), (2, 2), (3, 1), (3, 3), (4, 2)))
    assert mixed.shapes[0] == (3, 2) and len(mixed.shapes) == 6 and mixed.key() != tiny.TinySpec(task="multiply").key()
    probs = tiny._pretrain_problems(60000, 0, mixed)
    assert {len(p.gold) for p in probs} == {2, 3, 4, 5, 6}
    assert len({p.id for p in probs}) == len(probs)
    assert not any(calculator.is_heldout(p.columns["a"], p.columns["b"]) for p in probs)
    assert sum(p.id.startswith("mul-") and len(str(p.columns["a"])) == 2 and p.columns["b"] < 10 for p in probs) \
        == calculator.available("train", 2, 1)  # the small shape gives all it has, no more
    # a long run of the single-shape spec asked calculator.problems for more questions than exist (crashed past 1139 steps)
    long = tiny.TinySpec(task="multiply", steps=1500)
    assert len(tiny._pretrain_problems(long.steps * long.batch_size // 2, 0, long)) == calculator.available("train")
    with pytest.raises(ValueError, match="extra_shapes"):
        tiny.TinySpec(task="multiply", extra_shapes=((3, 0),))
    assert tiny.TinySpec(task="multiply", extra_shapes=[[2, 1]]).extra_shapes == ((2, 1),)  # lists become tuples


def test_copy_episodes_train_only_the_copied_answer(tools_tok):
    """``copy_share``'s demonstrations: the tool answers a random number, the model's only trained
    tokens are ``#### <that number>`` and EOS (the call turn is context), so they teach copying without
    teaching the call; a spec without them keeps its key."""
    import random

    assert tiny.TinySpec(task="multiply", copy_share=0.0).key() == tiny.TinySpec(task="multiply").key()
    assert tiny.TinySpec(task="multiply", copy_share=1.0).key() != tiny.TinySpec(task="multiply").key()
    with pytest.raises(ValueError, match="copy_share"):
        tiny.TinySpec(task="multiply", copy_share=-1)
    rng = random.Random(0)
    p = data.Problem("m", "What is 347 * 28?", "9716", columns={"a": 347, "b": 28})
    lengths = set()
    for _ in range(40):
        segs = tiny.copy_episode(p, rng)
        env, (answer, wrote) = segs[2][0], segs[3]
        number = answer.removeprefix("#### ")
        assert wrote and [w for _, w in segs] == [False, False, False, True] and env.strip() == f"Result: {number}"
        ids, trained = tiny.encode_episode(tools_tok, segs)
        n = len(tools_tok.encode(answer, add_special_tokens=False)) + 1  # and EOS
        assert trained == [False] * (len(ids) - n) + [True] * n
        lengths.add(len(number))
    assert lengths == {2, 3, 4, 5, 6, 7}


@pytest.fixture(scope="module")
def tools_tok():
    return tiny.build_tokenizer(SMALL_TOOLS)


class Replay:
    """An engine (one episode) whose turns are the demonstration's model segments, verbatim."""

    def __init__(self, tok, turns):
        self.tokenizer, self.turns, self.max_model_len = tok, turns, 512
        self.stop_ids, self.prompts = [tok.eos_token_id], []

    def sample_ids(self, prompts, *, seeds, max_new_tokens, version=0, temperature=1.0, stop=()):
        from grpo_kit.rollout import Continuation

        (prompt,) = prompts
        self.prompts.append(list(prompt))
        ids = self.turns[len(self.prompts) - 1]
        ends_call = any(s in self.tokenizer.decode(ids) for s in stop)
        return [Continuation(ids, [-0.1] * len(ids), "stop", stop="</call>" if ends_call else None)]


@pytest.mark.parametrize("call", [True, False])
def test_tool_demonstrations_are_the_run_time_stream(call, tools_tok):
    """The episode runner, the calculator task, the plain renderer and parser, replaying a demonstration's
    model segments, produce exactly the demonstration's token stream (prompt, call, tool answer, answer, EOS)."""
    import random

    from grpo_kit import config, tasks
    from grpo_kit.episode import EpisodePlan
    from grpo_kit.prompts import PromptFormat
    from grpo_kit.renderers import PlainRenderer

    tok = tools_tok
    task = tasks.resolve("calculator")
    p = task.load("train", 1, 5)[0]
    segs = tiny.tool_episode(p, call=call, rng=random.Random(0))
    ids, trained = tiny.encode_episode(tok, segs)
    turns = [tok.encode(t, add_special_tokens=False) for t, wrote in segs if wrote]
    turns[-1] = turns[-1] + [tok.eos_token_id]
    plan = EpisodePlan.of(task, config.profile("tiny-tools"))
    eng = Replay(tok, turns)
    eng.prompt_format = PromptFormat(instruction=task.instruction)
    (ep,) = plan.runner(eng, PlainRenderer(tok), 1.0).run([p], 1)
    assert ep.stream == ids
    assert eng.prompts[-1] == ids[: len(eng.prompts[-1])] and len(eng.prompts) == len(turns)  # each turn saw the demo's prefix
    n_prompt = len(tok.encode(segs[0][0], add_special_tokens=False))
    assert ep.mask == [int(t) for t in trained[n_prompt:]] and not any(trained[:n_prompt])
    assert ep.end_reason == "answered" and ep.tool_calls == int(call) and not ep.tool_errors
    if call:
        assert [m["content"] for m in ep.messages if m["role"] == "tool"] == [p.gold]
        assert ep.messages[-1]["content"] == f"#### {p.gold}"
        assert task.scorer().score_problems([p], [ep.messages[-1]["content"]])[0].correct
    else:
        assert not task.scorer().score_problems([p], [ep.messages[-1]["content"]])[0].correct  # the guess is wrong


def test_tool_variant_builds_and_its_tokenizer_knows_the_format(tmp_path, tools_tok):
    path = tiny.ensure_tiny_model(SMALL_TOOLS, cache_dir=tmp_path, progress=False)
    assert tiny.tiny_info(path)["spec"]["task"] == "multiply"
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.get_vocab() == tools_tok.get_vocab()
    text = "".join(t for t, _ in tiny.tool_episode(data.Problem("m", "What is 12 * 34?", "408", columns={"a": 12, "b": 34}),
                                                    call=True, rng=__import__("random").Random(0)))
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    plain = tiny.build_tokenizer()  # the addition model's tokenizer has never seen the call markup
    assert len(tok.encode(text, add_special_tokens=False)) < len(plain.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def tools_path():
    return tiny.ensure_tiny_model(tiny.TOOLS_SPEC)


def test_tool_model_calls_its_tool_sometimes_and_copies_the_answer(tools_path):
    """The built-in tool model (``tiny-tools``) through the kit's own episode path: sampled, it calls
    the tool in some episodes, not all (GRPO's signal), every call parses and runs, and some calls
    end in the tool's number; greedy, it guesses (the base accuracy GRPO starts from)."""
    from grpo_kit import config, tasks
    from grpo_kit.episode import EpisodePlan, to_rollout
    from grpo_kit.hf_engine import HFEngine
    from grpo_kit.prompts import prompt_format
    from grpo_kit.renderers import for_engine

    cfg = config.profile("tiny-tools")
    task = tasks.for_config(cfg)
    eng = HFEngine(str(tools_path), max_model_len=cfg.model.max_model_len, device="cpu",
                   prompt_format=prompt_format(cfg, task.instruction))
    probs = task.load("heldout", 12, 0)
    plan = EpisodePlan.of(task, cfg)
    sampled = plan.runner(eng, for_engine(eng), 1.0).run(probs, 4, seed=3)
    called = [e for e in sampled if e.tool_calls]
    assert 0 < len(called) < len(sampled)
    assert not any(e.tool_errors for e in sampled) and {e.end_reason for e in sampled} <= {"answered", "budget"}
    # a call ends in the tool's number (bench/multiturn.py: 98.5% of 68 sampled calls at base; the build
    # before, pretrained on one question shape, copied 4-digit results never: 33%): GRPO then only has
    # the call to reinforce
    scores = task.scorer().score_problems([probs[e.group_id] for e in called], [to_rollout(e).text for e in called])
    assert sum(s.correct for s in scores) >= 0.8 * len(called), [to_rollout(e).text for e in called]
    greedy = plan.runner(eng, for_engine(eng), 0.0).run(probs, 1)
    scores = task.scorer().score_problems(probs, [to_rollout(e).text for e in greedy])
    assert sum(s.correct for s in scores) <= 0.3 * len(probs)
