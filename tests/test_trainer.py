"""grpo_kit.trainer: the worker-resident state, in this process (world size 1) on the tiny model:
no dropout in the scoring forwards, devices per local rank, and a retried step that is idempotent
per version."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from grpo_kit import config, data, tiny, trainer
from grpo_kit.adapters import AdapterStore
from grpo_kit.train_step import collate, token_logprobs


@pytest.fixture(scope="module")
def tiny_path():
    return str(tiny.ensure_tiny_model())


def make_spec(tiny_path, store_root, **kw) -> trainer.RankSpec:
    cfg = config.profile("tiny", **kw)
    return trainer.RankSpec(
        run_id=f"test-{store_root}", model_path=tiny_path, store_root=store_root, storage_options=None,
        model=cfg.model, lora=cfg.lora, loss=cfg.loss, optim=cfg.optim, seed=0, rank=0, world_size=1, gang_id=1,
        init_method=None, timeout_s=30, max_len=48,
    )


def make_samples(tiny_path, n: int = 8, flip: bool = False) -> list:
    """Real prompts with their reference solutions as completions; advantages +-1."""
    tok = AutoTokenizer.from_pretrained(tiny_path)
    out = []
    for i, p in enumerate(data.synthetic_problems(n, split="train", seed=4)):
        comp = tok.encode(p.solution, add_special_tokens=False) + [tok.eos_token_id]
        adv = (1.0 if i % 2 else -1.0) * (-1.0 if flip else 1.0)
        out.append((tok.encode(p.prompt, add_special_tokens=False), comp, [-1.0] * len(comp), adv))
    return out


def test_scoring_forwards_have_no_dropout(tiny_path):
    """The engines never drop: with the trainer's LoRA dropout on, it scored a different policy."""
    with pytest.raises(ValueError, match="allow_lora_dropout"):
        config.profile("tiny", lora_dropout=0.1)
    cfg = config.profile("tiny")
    model = trainer.build_policy(tiny_path, cfg.model, cfg.lora, seed=0)
    assert not model.training
    allowed = config.profile("tiny", lora_dropout=0.5, allow_lora_dropout=True)
    assert trainer.build_policy(tiny_path, allowed.model, allowed.lora, seed=0).training
    batch = collate(make_samples(tiny_path, 4), pad_id=0)
    with torch.no_grad():  # B is random here so that the adapter matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    a = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    b = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert torch.equal(a, b)
    (a * batch.completion_mask).sum().backward()  # gradients still flow in eval mode
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_rank_device_follows_the_local_rank(monkeypatch):
    assert trainer.rank_device(3) == ("cpu" if not torch.cuda.is_available() else f"cuda:{3 % torch.cuda.device_count()}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [trainer.rank_device(r) for r in range(5)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU per worker (CUDA_VISIBLE_DEVICES)
    assert trainer.rank_device(2) == "cuda:0"


def test_a_retried_step_adopts_the_version_an_earlier_attempt_published(tiny_path, tmp_path):
    """A gang failure can surface while rank 0's publish of v+1 is still running; the driver then
    retries the step. The retry used to overwrite optimizer/v+1 and then meet the published
    adapter: the first attempt's adapter with the second attempt's optimizer state."""
    spec = make_spec(tiny_path, str(tmp_path / "store"), lr=1e-2)
    store = AdapterStore(spec.store_root)
    first = trainer.train_rank(spec, make_samples(tiny_path), 0, 0)
    assert not first["adopted"] and store.versions() == [1]
    name = store.manifest(1)["meta"]["optimizer_state"]
    committed = store.load_state(name)
    state = trainer.get_state(spec)
    weights = {k: v.detach().clone() for k, v in state.model.named_parameters() if v.requires_grad}

    state.version = None  # the retried attempt starts again from version 0, on another batch
    retry = trainer.train_rank(spec, make_samples(tiny_path, flip=True), 0, 0)
    assert retry["adopted"] and store.versions() == [1]
    assert store.manifest(1)["meta"]["optimizer_state"] == name
    after = store.load_state(name)
    for pid, st in committed["state"].items():  # the committed optimizer state is untouched
        assert torch.equal(after["state"][pid]["exp_avg"], st["exp_avg"])
    for k, v in state.model.named_parameters():  # and the trainer holds exactly version 1
        if v.requires_grad:
            assert torch.equal(v, weights[k]), k
    for pid, st in committed["state"].items():
        assert torch.equal(state.optimizer.state_dict()["state"][pid]["exp_avg"], st["exp_avg"])
    assert retry["loss"] == first["loss"]  # the committed step's stats, not the lost attempt's
    # the next step continues from version 1 and keeps only the last two optimizer states
    for v in (1, 2, 3):
        trainer.train_rank(spec, make_samples(tiny_path), v, v)
    states = store.fs.find(f"{store.path}/state/optimizer")
    assert len(states) == 2, states
