"""The paths that need a GPU: NCCL DDP step, bf16 loss path, HF engine on CUDA.

Skipped where CUDA is absent (CI has no GPU); bench/gpu_check.sh runs them on a lent GPU machine.
"""

from __future__ import annotations

import copy
import datetime
import socket

import pytest
import torch

from grpo_kit import config, data, tiny
from grpo_kit.logprobs import token_logprobs
from grpo_kit.loss import grpo_loss
from grpo_kit.train_step import collate, grpo_step, make_optimizer, wrap_ddp
from grpo_kit.trainer import build_policy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _batch(tok, n=6):
    probs = data.synthetic_problems(n, seed=7)
    out = []
    for i, p in enumerate(probs):
        prompt = tok.encode(p.prompt, add_special_tokens=False)
        comp = tok.encode(p.solution, add_special_tokens=False) + [tok.eos_token_id]
        out.append((prompt, comp, [-1.0] * len(comp), (-1) ** i * 0.5))
    return collate(out, tok.pad_token_id)


def test_nccl_ddp_world_size_1_matches_plain_step():
    from transformers import AutoTokenizer

    path = str(tiny.ensure_tiny_model())
    tok = AutoTokenizer.from_pretrained(path)
    cfg = config.profile("tiny")
    plain = build_policy(path, cfg.model, cfg.lora, seed=0, device="cuda")
    ddp_model = copy.deepcopy(plain)
    batch = _batch(tok)
    s_plain = grpo_step(plain, make_optimizer(plain, cfg.optim), batch, cfg.loss, cfg.optim)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                         timeout=datetime.timedelta(seconds=60))
    try:
        ddp = wrap_ddp(ddp_model)
        s_ddp = grpo_step(ddp, make_optimizer(ddp_model, cfg.optim), batch, cfg.loss, cfg.optim, rank=0, world_size=1)
        del ddp
    finally:
        torch.distributed.destroy_process_group()
    assert s_ddp["loss"] == pytest.approx(s_plain["loss"], rel=1e-5)
    for (n1, p1), (_, p2) in zip(plain.named_parameters(), ddp_model.named_parameters(), strict=True):
        if p1.requires_grad:
            torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-7, msg=n1)


def test_bf16_loss_path_upcasts_and_trains():
    from transformers import AutoTokenizer

    path = str(tiny.ensure_tiny_model())
    tok = AutoTokenizer.from_pretrained(path)
    cfg = config.profile("tiny", dtype="bfloat16")
    model = build_policy(path, cfg.model, cfg.lora, seed=0, device="cuda")
    b = _batch(tok).to("cuda")
    logp = token_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask)
    assert logp.dtype == torch.float32  # log-softmax in fp32 even for a bf16 model
    loss, stats = grpo_loss(logp, logp.detach(), logp.detach(), b.adv, b.completion_mask, kl_beta=0.04)
    loss.backward()
    assert torch.isfinite(loss) and stats.summary()["ratio_mean"] == pytest.approx(1.0)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_hf_engine_on_cuda_is_aligned():
    from transformers import AutoModelForCausalLM

    from grpo_kit.hf_engine import HFEngine

    path = str(tiny.ensure_tiny_model())
    eng = HFEngine(path, device="cuda")
    probs = data.synthetic_problems(8, split="heldout", seed=3)
    outs = eng.generate(probs, 4, 0, max_new_tokens=40, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    b = collate([(r.prompt_ids, r.completion_ids, r.logprobs, 0.0) for r in outs], eng.tokenizer.pad_token_id).to("cuda")
    with torch.no_grad():
        logp = token_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask)
    m = b.completion_mask.bool()
    assert (logp[m] - b.old_logp[m]).abs().max().item() <= 1e-3
    eng.close()


def test_vllm_engine_on_gpu_uses_cuda_graphs_and_lora_requests():
    """enforce_eager (no CUDA graphs) was applied on GPUs too; merged LoRA is refused in bfloat16."""
    pytest.importorskip("vllm")
    from grpo_kit.vllm_engine import VLLMEngine

    path = str(tiny.ensure_tiny_model())
    with pytest.raises(ValueError, match="rounds most of a small"):
        VLLMEngine(path, dtype="bfloat16", lora_mode="merged", gpu_memory_utilization=0.2)
    engine = VLLMEngine(path, dtype="bfloat16", gpu_memory_utilization=0.2)
    try:
        assert engine.lora_mode == "request"  # auto: request on GPU
        assert engine.llm.llm_engine.vllm_config.model_config.enforce_eager is False
        out = engine.greedy(data.synthetic_problems(4, split="heldout"), 0, max_new_tokens=8)
        assert len(out) == 4
    finally:
        engine.close()
