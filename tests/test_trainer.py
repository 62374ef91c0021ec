"""grpo_kit.trainer: the worker-resident state on the tiny model, in this process (world size 1):
no dropout in the scoring forwards, devices per local rank, a retried step that is idempotent per
version, the tempered distribution scored as the engine sampled it; and in a real gloo gang of two
ranks: every rank adopts the version an earlier attempt published."""

from __future__ import annotations

import math
import traceback
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_train_step import spawn_ranks  # pytest puts tests/ on sys.path
from transformers import AutoTokenizer

from grpo_kit import config, data, tiny, trainer
from grpo_kit.adapters import AdapterStore
from grpo_kit.hf_engine import HFEngine
from grpo_kit.logprobs import token_logprobs
from grpo_kit.train_step import collate


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
        for m in model.modules():  # LoRA dropout that drops in train mode (the profile's is 0, an Identity: review)
            if isinstance(getattr(m, "lora_dropout", None), torch.nn.ModuleDict):
                for k in m.lora_dropout:
                    m.lora_dropout[k] = torch.nn.Dropout(0.5).train(m.training)  # in the mode the policy was built in
    a = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    b = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert torch.equal(a, b)
    with torch.no_grad():  # the check can fail: in train mode the same forwards differ
        model.train()
        dropped = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
        model.eval()
    assert not torch.equal(a, dropped)
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


def test_a_rank_moved_to_another_device_builds_its_state_again(monkeypatch):
    """Review finding: a re-formed gang's local ranks follow the workers' addresses, and a worker that
    kept its state kept its first device: beside a restarted worker given the same index, two ranks
    shared a GPU (NCCL refuses). Fakes: this machine has no GPU."""

    class Built:
        def __init__(self, spec):
            self.run_id, self.device, self.torn = spec.run_id, trainer.rank_device(spec.local_rank), False

        def teardown_group(self):
            self.torn = True

    monkeypatch.setattr(trainer, "TrainerState", Built)
    monkeypatch.setattr(trainer, "rank_device", lambda local_rank: f"cuda:{local_rank}")
    monkeypatch.setattr(trainer, "_STATE", None)
    spec = trainer.RankSpec.for_run(config.profile("tiny"), "r", "m", "s", None)
    first = trainer.get_state(spec)
    assert trainer.get_state(replace(spec, rank=1)) is first  # same run, same device: kept
    moved = trainer.get_state(replace(spec, local_rank=1))
    assert moved is not first and moved.device == "cuda:1" and first.torn


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
    # the next step continues from version 1 and keeps only the last three optimizer states (the
    # committed version's survives two versions a stopping driver may take back)
    for v in (1, 2, 3, 4):
        trainer.train_rank(spec, make_samples(tiny_path), v, v)
    states = store.fs.find(f"{store.path}/state/optimizer")
    assert sorted(p.rsplit("/", 1)[1].split("-")[0] for p in states) == ["v000003", "v000004", "v000005"], states


def test_the_step_scores_the_tempered_distribution_the_engine_sampled(tiny_path, tmp_path):
    """temperature=0.7: the engine records log-probs of the tempered distribution; the trainer scored
    the untempered policy, so even on-policy the ratio was not 1 (and the KL was of the wrong policy)."""
    torch.manual_seed(0)
    engine = HFEngine(tiny_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the engine's note that it samples tempered
        out = engine.generate(data.synthetic_problems(16, split="train", seed=0), 6, 0, max_new_tokens=48,
                              temperature=0.7, seed=3)
    engine.close()
    samples = [(r.prompt_ids, r.completion_ids, r.logprobs, 1.0 if i % 2 else -1.0) for i, r in enumerate(out)]
    ratios = {}
    for temperature in (0.7, 1.0):  # the sampling temperature, then the scoring the trainer used to do
        cfg = config.profile("tiny", temperature=temperature)
        spec = trainer.RankSpec.for_run(cfg, f"tempered-{temperature}", tiny_path, str(tmp_path / f"s{temperature}"), None)
        assert spec.temperature == temperature
        stats = trainer.train_rank(spec, samples, 0, 0)
        assert stats["tokens_trained"] >= 512
        ratios[temperature] = stats
    on = ratios[0.7]  # the alignment tests' tolerances (grpo_kit.testing.assert_aligned)
    assert max(abs(math.log(on["ratio_min"])), abs(math.log(on["ratio_max"]))) <= 1e-3, on
    assert abs(on["ratio_mean"] - 1) <= 1e-4 and on["clip_frac"] == 0
    off = ratios[1.0]  # the check can fail: untempered scoring is far off on these samples
    assert max(abs(math.log(off["ratio_min"])), abs(math.log(off["ratio_max"]))) > 0.05


def _adopt_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank of a gang of two on the tiny model: a step from v0, the same step retried on another
    batch (rank 0 meets the published v1), the next step, then a step whose publish raises on rank 0."""
    out = Path(out_dir)
    try:
        torch.set_num_threads(1)
        tiny_path = str(tiny.ensure_tiny_model())
        spec = replace(make_spec(tiny_path, str(out / "store"), lr=1e-2), rank=rank, world_size=2,
                       init_method=f"tcp://127.0.0.1:{port}")
        res = {"first": trainer.train_rank(spec, make_samples(tiny_path), 0, 0)}
        state = trainer.get_state(spec)
        trainable = lambda: {k: v.detach().clone() for k, v in state.model.named_parameters() if v.requires_grad}  # noqa: E731
        res["v1"] = trainable()
        state.version = None  # the retried attempt starts again from version 0, on another batch
        res["retry"] = trainer.train_rank(spec, make_samples(tiny_path, flip=True), 0, 0)
        res["held"] = trainable()
        res["exp_avg"] = {pid: st["exp_avg"].clone() for pid, st in state.optimizer.state_dict()["state"].items()}
        res["next"] = trainer.train_rank(spec, make_samples(tiny_path), 1, 1)
        res["attempt_after_next"] = state.attempt  # rank 0's publish, told to rank 1 with the outcome

        def broken(*a, **k):
            raise OSError("store unreachable")

        if rank == 0:
            state.store.publish = broken
        try:
            trainer.train_rank(spec, make_samples(tiny_path), 2, 2)
            res["failed"] = None
        except Exception as e:
            res["failed"] = repr(e)
        res["version_after_failure"] = state.version
        torch.save(res, out / f"rank{rank}.pt")
        trainer.drop_state()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_every_rank_adopts_the_version_an_earlier_attempt_published(tmp_path):
    """world size 2: rank 0 alone used to reload the published v1, so rank 1 kept the retry's own
    update (the ranks disagreed and the driver's checksum check failed the run). When rank 0's
    publish raises, every rank fails the step (none is left waiting on rank 0)."""
    tiny.ensure_tiny_model()
    ranks = spawn_ranks(2, tmp_path, timeout=240.0, target=_adopt_worker)
    store = AdapterStore(str(tmp_path / "store"))
    committed = store.load_state(store.manifest(1)["meta"]["optimizer_state"])
    v1 = ranks[0]["v1"]
    assert [(r["first"]["adopted"], r["retry"]["adopted"]) for r in ranks] == [(False, True)] * 2
    assert [r["attempt_after_next"] for r in ranks] == [(2, store.attempt(2))] * 2
    # rank 0's failed publish of v3 left no optimizer state behind
    assert not [p for p in store.fs.find(f"{store.path}/state/optimizer") if "/v000003" in p]
    assert ranks[0]["retry"]["param_checksum"] == ranks[1]["retry"]["param_checksum"]
    for rank, res in enumerate(ranks):
        assert res["retry"]["loss"] == ranks[0]["first"]["loss"]  # the committed step's stats
        for k, v in res["held"].items():  # exactly version 1, on every rank
            assert torch.equal(v, v1[k]), (rank, k)
        for pid, st in committed["state"].items():  # and v1's optimizer state
            assert torch.equal(res["exp_avg"][pid], st["exp_avg"]), (rank, pid)
        assert res["next"]["param_checksum"] == ranks[0]["next"]["param_checksum"]  # they step on together
    assert "store unreachable" in ranks[0]["failed"] and "rank 0 failed to publish" in ranks[1]["failed"]
    assert [r["version_after_failure"] for r in ranks] == [None, None]  # reloaded from the store on retry
    assert store.versions() == [1, 2]


def test_a_failed_clean_up_after_the_publish_does_not_fail_the_step(tiny_path, tmp_path):
    """Review finding: deleting an old optimizer state (housekeeping, after v+1 was committed) raised on
    a transient store error, failing a step that had published (a gang restart; three in a run, and the
    run failed), and the name was dropped so no later step deleted that state."""
    from grpo_kit.adapters import AdapterStore

    tiny = tiny_path
    spec = make_spec(tiny, str(tmp_path / "store"), lr=1e-2)
    store = AdapterStore(spec.store_root)
    for v in range(3):
        trainer.train_rank(spec, make_samples(tiny, 4), v, v)
    state = trainer.get_state(spec)
    first = store.manifest(1)["meta"]["optimizer_state"]
    real = state.store.delete_state

    def flaky(name):
        raise OSError("503 SlowDown")

    state.store.delete_state = flaky
    with pytest.warns(RuntimeWarning, match="could not delete the old optimizer state"):
        trainer.train_rank(spec, make_samples(tiny, 4), 3, 3)
    state.store.delete_state = real
    assert store.versions() == [1, 2, 3, 4] and state.version == 4 and store.state_exists(first)
    trainer.train_rank(spec, make_samples(tiny, 4), 4, 4)  # the next step deletes what was left
    assert not store.state_exists(first) and len(state.saved_states) == 3
