"""The tiny base model: built, cached, and loadable by transformers, PEFT and vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
import time

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
    t0 = time.perf_counter()
    assert tiny.ensure_tiny_model(spec, cache_dir=tmp_path) == path
    assert time.perf_counter() - t0 < 1.0
    other = tiny.TinySpec(**{**spec.__dict__, "seed": 1})
    assert other.key() != spec.key()
    assert tiny.tiny_info(path)["spec"]["steps"] == 3


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
    assert peft_model.print_trainable_parameters() is None
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) > 0


VLLM_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from transformers import AutoTokenizer
path, prompt = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(path)
ids = tok.encode(prompt, add_special_tokens=False)
llm = LLM(model=path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0)
out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
print("RESULT " + json.dumps(list(out[0].outputs[0].token_ids)))
"""


def test_loads_in_vllm_and_matches_hf_greedy(tiny_path):
    pytest.importorskip("vllm")
    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    prompt = data.synthetic_problems(1, split="heldout", seed=5)[0].prompt
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    hf = model.generate(**ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids["input_ids"].shape[1]:]
    proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(tiny_path), prompt], capture_output=True, text=True, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, f"vLLM failed:\n{proc.stderr[-3000:]}"
    assert json.loads(line[0][7:]) == hf.tolist()
