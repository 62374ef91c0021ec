"""The kit on a real pretrained chat model, SmolLM2-135M-Instruct (built offline from its PyPI
wheel; see grpo_kit.models): engine/trainer alignment through the chat template, and the whole
Dask loop (LOOP_ENGINES says why in vLLM's LoRARequest mode only). Small batches and short completions: the
learning run itself is bench/real_model.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GSM8K_DIR
from transformers import AutoTokenizer

from grpo_kit import config, data, loop, models, tasks
from grpo_kit.adapters import AdapterStore
from grpo_kit.hf_engine import HFEngine
from grpo_kit.prompts import PromptFormat, prompt_format
from grpo_kit.testing import LLAMA_TARGETS, assert_aligned, dlogp, perturbed_adapter, policy


@pytest.fixture(scope="module")
def smol_path():
    return models.resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def store(smol_path, tmp_path_factory):
    s = AdapterStore(str(tmp_path_factory.mktemp("store")))
    s.publish(perturbed_adapter(smol_path, seed=1, scale=0.01), 1)
    return s


@pytest.fixture(scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ENGINES = ["vllm-merged", "vllm-request", "hf"]


@pytest.mark.parametrize("which", ENGINES)
def test_engine_logprobs_are_the_trainers(which, smol_path, store, one_torch_thread):
    """On-policy ratio 1 on the real model in float32, through the chat template, under a LoRA on
    all seven Llama projections (the acceptance figures: ratio mean within 1e-4, max |dlogp| 1e-3)."""
    kw = {"store": store, "max_model_len": 256, "prompt_format": PromptFormat(), "stop": ("\n\n",)}
    if which == "hf":
        engine = HFEngine(smol_path, **kw)
    else:
        pytest.importorskip("vllm")
        from grpo_kit.vllm_engine import VLLMEngine

        engine = VLLMEngine(smol_path, lora_mode=which.split("-")[1], max_batch_seqs=32, **kw)
    problems = data.synthetic_problems(8, split="train", seed=3, n_digits=2)
    try:
        out = engine.generate(problems, 4, 1, max_new_tokens=40, seed=0)
    finally:
        engine.close()
    tok = AutoTokenizer.from_pretrained(smol_path)
    assert tok.decode(out[0].prompt_ids).startswith("<|im_start|>system\n")
    assert all(r.finish_reason in ("stop", "length") and len(r.logprobs) == len(r.completion_ids) for r in out)
    for r in out:
        if r.stop == "\n\n":  # cut at the stop string: its text ends before it, its tokens contain it
            assert "\n\n" in tok.decode(r.completion_ids) and "\n\n" not in r.text
    assert_aligned(dlogp(policy(smol_path, store, 1), out), min_tokens=400)




LOOP_ENGINES = ["vllm-request"]
"""The loop on this model runs once, in vLLM's LoRARequest mode (its only loop test: CPU's auto mode
is merged). What the loop records here does not depend on the engine or the mode; each engine's part
on this model (chat template, stop string, on-policy log-probs under all seven projections) is
test_engine_logprobs_are_the_trainers, all three of them. The two other engines inside a Dask
rollout worker on this model: merged vLLM is tests/test_notebooks.py's
test_gsm8k_notebook_runs_the_smol_profile_on_a_cpu (the same profile, GSM8K and sizes, CPU's auto
mode), and HF is tests/test_tasks.py's test_builtin_tasks_train_through_the_dask_loop[code-smollm2-135m-...]."""


@pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason="needs ../shared/data/gsm8k")
@pytest.mark.parametrize("which", LOOP_ENGINES)
def test_loop_on_smollm2(which, smol_path, tmp_path):
    """Two pipelined iterations of GSM8K on a real LocalCluster: chat prompts, stop strings, strict
    and lenient accuracy recorded, adapters on all seven projections published and loaded."""
    pytest.importorskip("vllm")
    engine, _, mode = which.partition("-")
    cfg = config.profile(
        "smol", engine=engine, lora_mode=mode or "auto", iterations=2, prompts_per_step=2, group_size=4,
        max_new_tokens=24, eval_size=4, eval_every=1, micro_batch=4, run_dir=str(tmp_path / "run"),
        dataset=str(GSM8K_DIR), train_size=64, max_model_len=512,
        kl_beta=1e-3,  # every row trains (kl_beta 0 skips rows with no advantage), so the ratio is measured
    )
    result = loop.run(cfg, progress=False)
    recs = result.records
    assert [r["iteration"] for r in recs] == [0, 1] and recs[-1]["version"] == 2
    first = recs[0]  # sampled by version 0 and trained at version 0: on-policy
    assert first["rollout_version"] == 0 and abs(first["ratio_mean"] - 1) < 1e-3
    for r in recs:
        assert 0 <= r["train_acc"] <= r["train_lenient_acc"] <= 1
    assert result.summary["acc_before"] is not None and result.summary["lenient_acc_before"] is not None
    assert result.summary["acc_after"] is not None and result.summary["lenient_acc_after"] is not None

    tok = AutoTokenizer.from_pretrained(smol_path)
    rows = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").open()]
    assert len(rows) == 2 * 2 * 4
    # the driver keeps no token ids (they went from the rollout workers to the ranks): each prompt's
    # length is that of its chat rendering
    fmt = prompt_format(cfg)
    pool = {p.id: p for p in tasks.for_config(cfg).load("train", cfg.data.train_size, cfg.run.seed)}
    assert fmt.uses_chat(tok)
    assert all(r["prompt_tokens"] == len(fmt.encode(tok, pool[r["prompt_id"]].question)) and "prompt_ids" not in r
               for r in rows)
    assert all(r["prompt_id"].startswith("gsm8k-train-") for r in rows)
    assert all(r["correct"] in (True, False) and r["lenient_correct"] in (True, False) for r in rows)
    assert all(r["stop"] in (None, "\n\n") for r in rows)
    store = AdapterStore(cfg.run.store_root)
    adapter_cfg = json.loads(open(f"{store.fetch(2)}/adapter_config.json").read())
    assert sorted(adapter_cfg["target_modules"]) == sorted(LLAMA_TARGETS) and adapter_cfg["r"] == 16
