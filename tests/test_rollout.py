"""grpo_kit.rollout: the Rollout record, and the HF engine's contract on the tiny model.

The alignment tests recompute the sampled tokens' log-probs with the trainer's
``logprobs.token_logprobs`` under the same adapter version (loaded from the store the way the
trainer loads it): at temperature 1 the on-policy importance ratio must be 1.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from grpo_kit import data, tiny
from grpo_kit.adapters import AdapterStore, VersionNotFoundError
from grpo_kit.hf_engine import HFEngine
from grpo_kit.rollout import TOKEN_FIELDS, Engine, Rollout, RolloutSummary, group_seed
from grpo_kit.testing import assert_aligned, dlogp, perturbed_adapter, policy

MAX_NEW = 48


scorer = policy  # the names these tests (and test_vllm_engine's) use


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared CPU, idle OpenMP workers spinning cost far more than they give
    on a model this small (tens of times slower measured under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_path():
    return str(tiny.ensure_tiny_model())


@pytest.fixture(scope="module")
def store(tiny_path, tmp_path_factory):
    s = AdapterStore(str(tmp_path_factory.mktemp("store")))
    s.publish(perturbed_adapter(tiny_path, seed=1), 1)
    s.publish(perturbed_adapter(tiny_path, seed=2), 2)
    return s


@pytest.fixture(scope="module")
def engine(tiny_path, store):
    eng = HFEngine(tiny_path, store=store)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def problems():
    return data.synthetic_problems(16, split="train", seed=0)


# ----------------------------------------------------------------------------- the record


def test_rollout_round_trip():
    r = Rollout("add-1-2", 3, 1, [5, 6], [7, 1], [-0.5, -0.25], 2, "stop", "#### 3", "3", reward=1.0, iteration=4)
    d = json.loads(json.dumps(r.to_dict()))
    assert Rollout.from_dict(d) == r
    assert not r.truncated and Rollout.from_dict({**d, "finish_reason": "length"}).truncated
    assert d["reward_reason"] is None
    with pytest.raises(ValueError, match="unknown Rollout field"):
        Rollout.from_dict({**d, "extra": 1})


def test_summary_is_the_record_without_its_tokens():
    """The driver's view of a rollout: every other field, and the token counts (a field added to
    Rollout and not to RolloutSummary fails here, not mid-run)."""
    r = Rollout("add-1-2", 3, 1, [5, 6, 9], [7, 1], [-0.5, -0.25], 2, "length", "#### 3", "3", reward=1.0, iteration=4)
    d = json.loads(json.dumps(RolloutSummary.of(r.to_dict())))
    # a single-turn record has no episode, one whose rewards logged nothing no reward_extra (not serialized when None)
    assert set(d) == ({f.name for f in dataclasses.fields(Rollout)} - set(TOKEN_FIELDS) - {"episode", "reward_extra"}) | {"prompt_tokens", "completion_tokens"}
    s = RolloutSummary.from_dict(d)
    assert (s.prompt_tokens, s.completion_tokens, s.reward, s.text, s.truncated) == (3, 2, 1.0, "#### 3", True)
    assert RolloutSummary.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="unknown RolloutSummary field"):
        RolloutSummary.from_dict({**d, "completion_ids": [7, 1]})


def test_rollout_mask_round_trip_and_old_records():
    """A multi-turn rollout's mask survives the round trip; one without a mask serializes as before
    (no key), and a record written before the field existed loads with mask None (all scored)."""
    r = Rollout("add-1-2", 3, 1, [5, 6], [7, 1, 2, 9], [-0.5, 0.0, 0.0, -0.25], 2, "stop", "3", "3",
                mask=[1, 0, 0, 1], reward=1.0)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["mask"] == [1, 0, 0, 1] and Rollout.from_dict(d) == r
    plain = Rollout("add-1-2", 3, 1, [5, 6], [7, 1], [-0.5, -0.25], 2, "stop", "#### 3", "3")
    old = plain.to_dict()
    assert "mask" not in old and Rollout.from_dict(old) == plain and Rollout.from_dict(old).mask is None
    # the driver's summary drops the mask with the other token fields (its record is unchanged)
    s = RolloutSummary.of(d)
    # completion_tokens counts what the policy sampled (sum(mask)), not the environment's ids
    assert "mask" not in s and RolloutSummary.from_dict(s).completion_tokens == 2
    assert set(RolloutSummary.of(old)) == set(s)


def test_group_seeds_are_distinct_and_stable():
    seeds = {group_seed(0, g) for g in range(1000)} | {group_seed(1, g) for g in range(1000)}
    assert len(seeds) == 2000
    assert group_seed(7, 3) == group_seed(7, 3) < 2**62


# ----------------------------------------------------------------------------- HF engine contract


def assert_contract(engine, problems, version: int) -> None:
    """The Engine contract, checked on any engine: ids, grouping, log-probs, EOS and text."""
    assert isinstance(engine, Engine)
    n = 4
    out = engine.generate(problems[:5], n, version, max_new_tokens=MAX_NEW, seed=1, group_offset=10)
    assert len(out) == 5 * n
    eos = engine.eos_token_id
    for k, r in enumerate(out):
        i, j = divmod(k, n)
        p = problems[i]
        assert (r.prompt_id, r.group_id, r.sample_idx, r.version, r.gold) == (p.id, 10 + i, j, version, p.gold)
        assert r.prompt_ids == engine.tokenizer.encode(p.prompt, add_special_tokens=False)
        assert len(r.logprobs) == len(r.completion_ids) > 0
        assert all(lp <= 0 for lp in r.logprobs)
        assert r.finish_reason in ("stop", "length")
        # EOS: the last token of a stopped completion, nowhere else; never in the text
        assert eos not in r.completion_ids[:-1]
        assert (r.completion_ids[-1] == eos) == (r.finish_reason == "stop")
        assert engine.tokenizer.eos_token not in r.text
        assert r.text == engine.tokenizer.decode(
            r.completion_ids[:-1] if r.finish_reason == "stop" else r.completion_ids
        )
    assert any(r.finish_reason == "stop" for r in out), "the tiny model should finish most answers in 48 tokens"


def test_contract(engine, problems):
    assert_contract(engine, problems, version=0)


def test_truncation_at_max_new_tokens(engine, problems):
    out = engine.generate(problems[:4], 3, 1, max_new_tokens=6, seed=0)
    assert sum(r.truncated for r in out) == len(out) == 12  # answers need > 6 tokens
    assert all(len(r.completion_ids) == 6 and engine.eos_token_id not in r.completion_ids for r in out)


def test_determinism(engine, problems):
    kw = {"max_new_tokens": MAX_NEW, "seed": 5, "group_offset": 2}
    a = engine.generate(problems[:6], 4, 1, **kw)
    b = engine.generate(problems[:6], 4, 1, **kw)
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    c = engine.generate(problems[:6], 4, 1, **{**kw, "seed": 6})
    assert [r.completion_ids for r in a] != [r.completion_ids for r in c]
    g1, g2 = (engine.greedy(problems[:6], 1, max_new_tokens=MAX_NEW) for _ in range(2))
    assert [r.to_dict() for r in g1] == [r.to_dict() for r in g2]
    assert [r.group_id for r in g1] == list(range(6)) and all(r.sample_idx == 0 for r in g1)


def test_bad_inputs(engine, tiny_path, problems):
    assert engine.generate([], 4, 0, max_new_tokens=8) == []
    assert engine.greedy([], 0, max_new_tokens=8) == []
    long = data.Problem(id="too-long", question="What is " + " + ".join(["123"] * 60) + "?", gold="0")
    with pytest.raises(ValueError, match="too-long"):
        engine.generate([problems[0], long], 2, 0, max_new_tokens=MAX_NEW)
    with pytest.raises(VersionNotFoundError, match="version 9"):
        engine.generate(problems[:1], 2, 9, max_new_tokens=8)
    with pytest.raises(ValueError, match="no AdapterStore"):
        HFEngine(tiny_path).generate(problems[:1], 2, 1, max_new_tokens=8)
    with pytest.raises(ValueError, match="n must be"):
        engine.generate(problems[:1], 0, 0, max_new_tokens=8)
    with pytest.raises(ValueError, match="max_model_len"):
        HFEngine(tiny_path, max_model_len=10_000)
    with warnings.catch_warnings():  # a temperature other than 1 is a plain request now
        warnings.simplefilter("error")
        assert len(engine.generate(problems[:1], 2, 0, max_new_tokens=8, temperature=0.7)) == 2


def copy_with_config_eos(tiny_path: str, dest, extra_eos: int, generation_config: str):
    """The tiny model copied to ``dest`` with ``config.json``'s ``eos_token_id`` set to ``[EOS,
    extra_eos]`` and ``generation_config.json`` either ``"missing"`` or ``"without-eos"``; returns
    ``dest`` as a string."""
    import os
    import shutil

    os.makedirs(dest)
    for name in os.listdir(tiny_path):
        shutil.copy(os.path.join(tiny_path, name), os.path.join(dest, name))
    conf = json.loads(open(os.path.join(dest, "config.json")).read())
    conf["eos_token_id"] = [conf["eos_token_id"], extra_eos]
    open(os.path.join(dest, "config.json"), "w").write(json.dumps(conf))
    gen = os.path.join(dest, "generation_config.json")
    if generation_config == "missing":
        os.remove(gen)
    else:
        kept = {k: v for k, v in json.loads(open(gen).read()).items() if k != "eos_token_id"}
        open(gen, "w").write(json.dumps(kept))
    return str(dest)


def config_eos_case(engine, problems):
    """A token the base model's greedy answer to ``problems[0]`` holds after its first two, and
    that answer: made an EOS id, the answer ends at it."""
    ref = engine.greedy(problems[:1], 0, max_new_tokens=MAX_NEW)[0].completion_ids
    extra = next(t for t in ref[2:] if t != engine.eos_token_id)
    return extra, ref[: ref.index(extra) + 1]


def test_stop_token_ids_read_config_json_when_the_generation_config_names_no_eos(engine, tiny_path, problems, tmp_path):
    """A model whose ``config.json`` names EOS ids its generation config does not (or that has no
    ``generation_config.json``): a completion ending at one of them stopped, it was not truncated."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from grpo_kit.rollout import stop_token_ids

    tok = AutoTokenizer.from_pretrained(tiny_path)
    extra, want = config_eos_case(engine, problems)
    hf = HFEngine(copy_with_config_eos(tiny_path, tmp_path / "engine", extra, "without-eos"))
    try:
        r = hf.greedy(problems[:1], 0, max_new_tokens=MAX_NEW)[0]
        assert r.completion_ids == want and r.finish_reason == "stop" and not r.truncated
        assert r.text == tok.decode(want[:-1])
        assert hf.stop_ids == [tok.eos_token_id, extra]
    finally:
        hf.close()

    for case in ("missing", "without-eos"):
        path = copy_with_config_eos(tiny_path, tmp_path / case, extra, case)
        gen = None if case == "missing" else GenerationConfig.from_pretrained(path)
        assert stop_token_ids(tok, gen, AutoConfig.from_pretrained(path)) == [tok.eos_token_id, extra]
    # a generation config that names EOS ids wins over config.json's
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[5, 6]), AutoConfig.from_pretrained(path)) == [1, 5, 6]


# ----------------------------------------------------------------------------- alignment with the trainer


@pytest.mark.parametrize("version", [0, 1, 2])
def test_alignment_with_trainer(engine, store, tiny_path, problems, version):
    out = engine.generate(problems, 6, version, max_new_tokens=MAX_NEW, seed=version)
    assert_aligned(dlogp(scorer(tiny_path, store, version), out))


def test_adapter_swap_and_back_to_base(engine, store, tiny_path, problems):
    for version in (2, 0, 1):  # swap, disable, swap again on one engine
        out = engine.generate(problems[:8], 4, version, max_new_tokens=MAX_NEW, seed=11)
        assert_aligned(dlogp(scorer(tiny_path, store, version), out), min_tokens=256)
    other = dlogp(scorer(tiny_path, store, 2), out)  # v1's samples scored by v2: far apart
    assert other.abs().max().item() > 0.5


def test_tempered_logprobs_are_of_the_sampled_distribution(engine, store, tiny_path, problems):
    out = engine.generate(problems, 6, 1, max_new_tokens=MAX_NEW, temperature=0.7)
    model = scorer(tiny_path, store, 1)
    assert_aligned(dlogp(model, out, temperature=0.7))
    assert dlogp(model, out).abs().max().item() > 0.05  # the untempered policy differs


def test_greedy_logprobs_are_the_policy(engine, store, tiny_path, problems):
    out = engine.greedy(problems, 1, max_new_tokens=MAX_NEW)
    assert_aligned(dlogp(scorer(tiny_path, store, 1), out), min_tokens=256)


# ----------------------------------------------------------------------------- token-id continuations (episode turns)


def test_sample_ids_continues_each_row_from_its_own_seed(engine, problems):
    prompts = [engine.tokenizer.encode(p.prompt, add_special_tokens=False) for p in problems[:6]]
    kw = {"version": 1, "max_new_tokens": [MAX_NEW] * 6}
    a = engine.sample_ids(prompts, seeds=range(6), **kw)
    assert [dataclasses.asdict(c) for c in a] == [dataclasses.asdict(c) for c in engine.sample_ids(prompts, seeds=range(6), **kw)]
    alone = engine.sample_ids(prompts[2:3], seeds=[2], version=1, max_new_tokens=[MAX_NEW])
    assert alone[0].ids == a[2].ids  # a row does not depend on the others in its call
    assert [c.ids for c in engine.sample_ids(prompts, seeds=range(1, 7), **kw)] != [c.ids for c in a]
    for c in a:
        assert len(c.ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs)
        assert (c.finish_reason == "stop") == (c.ids[-1] == engine.eos_token_id)
    cut = engine.sample_ids(prompts, seeds=range(6), stop=("=",), **kw)  # "1+9=10": a stop string ends the turn
    for c, full in zip(cut, a, strict=True):
        assert (c.finish_reason, c.stop) == ("stop", "=") and c.ids == full.ids[: len(c.ids)]
        assert engine.tokenizer.decode(c.ids).count("=") == 1 and engine.tokenizer.decode(c.ids[:-1]).count("=") == 0


def test_sample_ids_checks_the_context_row_by_row(engine, problems):
    short = engine.tokenizer.encode(problems[0].prompt, add_special_tokens=False)
    long = (short * 20)[: engine.max_model_len - 8]
    out = engine.sample_ids([long, short], seeds=[0, 1], max_new_tokens=[8, 100])  # each row fits its budget
    assert len(out[0].ids) <= 8 and len(out[1].ids) <= 100
    with pytest.raises(ValueError, match="row 0"):
        engine.sample_ids([long], seeds=[0], max_new_tokens=[9])
    # review findings: a row's budget of 0 sampled one token; a temperature vLLM would raise to 0.01
    with pytest.raises(ValueError, match="row 0: max_new_tokens must be an int >= 1, got 0"):
        engine.sample_ids([short, short], seeds=[0, 1], max_new_tokens=[0, 3])
    with pytest.raises(ValueError, match=r"temperature must be in \[0.01, inf\)"):
        engine.sample_ids([short], seeds=[0], max_new_tokens=[3], temperature=0.005)


def test_a_version_published_anew_is_never_served_from_the_old_weights(engine, store, tiny_path, problems):
    """Review finding: the HF engine kept the adapter it had loaded for a version number, so a version
    taken back and published anew was sampled from the old weights under the new label."""
    store.publish(perturbed_adapter(tiny_path, seed=5), 5)
    first = engine.generate(problems[:6], 6, 5, max_new_tokens=MAX_NEW, seed=0)
    other = AdapterStore(store.root)  # the trainer's side: take v5 back, publish another v5
    other.delete(5)
    other.publish(perturbed_adapter(tiny_path, seed=6), 5)
    again = engine.generate(problems[:6], 6, 5, max_new_tokens=MAX_NEW, seed=0)
    assert_aligned(dlogp(scorer(tiny_path, AdapterStore(store.root), 5), again))
    assert [r.completion_ids for r in again] != [r.completion_ids for r in first]


def test_an_empty_stop_string_stops_nothing_in_sample_ids(engine, problems):
    """Review finding: "" is in every text, so sample_ids ended every row after one token (generate
    already ignored it)."""
    prompt = engine.tokenizer.encode("Question: 1 + 1?\nAnswer:\n")
    kw = dict(seeds=[3], max_new_tokens=[12], temperature=1.0)
    (plain,) = engine.sample_ids([prompt], **kw)
    (empty,) = engine.sample_ids([prompt], stop=("",), **kw)
    assert empty.ids == plain.ids and len(plain.ids) > 1
