"""grpo_kit.lora_merge: the deltas added to the base weights are what PEFT's own
``merge_and_unload()`` gives, for every targeted weight (linear layers and an embedding) and nothing
else; adapters the merge cannot reproduce are refused. No vLLM needed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from grpo_kit import tiny
from grpo_kit.adapters import AdapterStore
from grpo_kit.lora_merge import adapter_deltas, base_weights
from grpo_kit.testing import perturbed_adapter


@pytest.fixture(scope="module")
def tiny_path():
    return str(tiny.ensure_tiny_model())


def test_deltas_are_peft_merge_and_unsupported_adapters_are_refused(tiny_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    store = AdapterStore(str(tmp_path / "store"))
    store.publish(perturbed_adapter(tiny_path, seed=1), 1)
    # base + delta is what PEFT's own merge gives, for every targeted weight and nothing else
    deltas = adapter_deltas(store.fetch(1))
    assert len(deltas) == 4 * 7 and "model.layers.0.self_attn.q_proj.weight" in deltas
    base = base_weights(tiny_path)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), store.fetch(1))
    merged = peft.merge_and_unload().state_dict()
    for name, w in base.items():
        want = merged[name]
        got = w + deltas[name] if name in deltas else w
        assert torch.allclose(got, want, atol=1e-6, rtol=0), name
        assert (name in deltas) == (not torch.equal(w, want))
    conf = tmp_path / "dora"
    conf.mkdir()
    for f in os.listdir(store.fetch(1)):
        shutil.copy(os.path.join(store.fetch(1), f), conf / f)
    cfg = json.loads((conf / "adapter_config.json").read_text())
    (conf / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        adapter_deltas(str(conf))


def embedding_adapter(model_path: str, seed: int):
    """A PEFT LoRA on ``embed_tokens`` and two projections with every A and B random (PEFT starts an
    embedding's A, and a linear layer's B, at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def untied_copy(tiny_path: str, dest) -> str:
    """The tiny model with its own output layer (``tie_word_embeddings=False``; a random lm_head)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(tiny_path)
    conf.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, config=conf, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(str(dest))
    for name in os.listdir(tiny_path):
        if name.startswith("tokenizer") or name == "generation_config.json":
            shutil.copy(os.path.join(tiny_path, name), os.path.join(dest, name))
    return str(dest)


def test_an_embedding_lora_merges_as_peft_does_and_a_tied_one_is_refused(tiny_path, tmp_path):
    """``embed_tokens`` among the targets: base + delta is PEFT's own ``merge_and_unload()`` for every
    weight (the merged engine once ignored the embedding's LoRA, so it sampled without it while the
    trainer applied it). On a model whose embedding is also its output layer,
    merging cannot match the trainer's adapter: refused."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_kit.adapter_save import save_adapter
    from grpo_kit.lora_merge import adapter_deltas, base_weights, ties_word_embeddings

    model_dir = untied_copy(tiny_path, tmp_path / "untied")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_adapter(embedding_adapter(model_dir, seed=4), str(adapter))
    deltas = adapter_deltas(str(adapter), tied_embeddings=ties_word_embeddings(model_dir))
    assert "model.embed_tokens.weight" in deltas
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(adapter))
    merged = peft.merge_and_unload().state_dict()
    base = base_weights(model_dir)
    assert set(base) == set(merged) and "lm_head.weight" in base
    for name, w in base.items():
        got = w + deltas[name] if name in deltas else w
        assert torch.allclose(got, merged[name], atol=1e-6, rtol=0), name
        assert (name in deltas) == (not torch.equal(w, merged[name])), name

    assert ties_word_embeddings(tiny_path) and not ties_word_embeddings(model_dir)
    tied = tmp_path / "tied-adapter"
    tied.mkdir()
    save_adapter(embedding_adapter(tiny_path, seed=5), str(tied))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        adapter_deltas(str(tied), tied_embeddings=True)
