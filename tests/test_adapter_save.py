"""Saving an adapter as PEFT does (grpo_kit.adapter_save): PEFT's files, without its model card,
written directly from a model's second save on."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_adapters import tiny_peft  # pytest puts tests/ on sys.path


def test_save_adapter_writes_what_save_pretrained_writes(tmp_path):
    """The store saves without PEFT's model card; the weights and config are PEFT's own."""
    import json

    from safetensors import safe_open

    from grpo_kit.adapter_save import save_adapter

    model = tiny_peft()
    model.peft_config["default"].inference_mode = False  # as a policy in training is
    ours, peft = tmp_path / "ours", tmp_path / "peft"
    ours.mkdir()
    save_adapter(model, str(ours))
    model.save_pretrained(str(peft))
    assert sorted(os.listdir(ours)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert set(os.listdir(peft)) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    assert json.loads((ours / "adapter_config.json").read_text()) == json.loads((peft / "adapter_config.json").read_text())
    with safe_open(str(ours / "adapter_model.safetensors"), "pt") as a, safe_open(str(peft / "adapter_model.safetensors"), "pt") as b:
        assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    assert model.peft_config["default"].inference_mode is False  # left as it was
    assert "create_or_update_model_card" not in vars(model)  # the class's method again


def test_save_adapter_after_the_first_writes_peft_files_without_peft(tmp_path, monkeypatch):
    """From the second save of a model on, save_adapter writes the files itself (PEFT's save walks
    every module: most of the publish on the trainer's critical path), byte for byte what PEFT's
    save writes after the same update; a replaced parameter or a changed config goes back to PEFT."""
    from grpo_kit.adapter_save import save_adapter

    model = tiny_peft()
    model.peft_config["default"].inference_mode = False
    peft_save = type(model).save_pretrained
    save_adapter(model, str(tmp_path / "first"))  # PEFT's save, learned

    def refused(*a, **k):
        raise AssertionError("PEFT's save_pretrained called")

    def same_as_peft(ours, peft):
        peft_save(model, str(peft))
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            assert (ours / name).read_bytes() == (peft / name).read_bytes(), name
        assert sorted(os.listdir(ours)) == ["adapter_config.json", "adapter_model.safetensors"]

    gen = torch.Generator().manual_seed(3)
    for step in range(2):  # a training step updates the parameters in place
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=gen))
        monkeypatch.setattr(type(model), "save_pretrained", refused)
        save_adapter(model, str(tmp_path / f"ours{step}"))
        monkeypatch.undo()
        same_as_peft(tmp_path / f"ours{step}", tmp_path / f"peft{step}")
        assert load_file(str(tmp_path / f"ours{step}" / "adapter_model.safetensors")) != {}

    for change in ("config", "tensors"):  # what the saver learned no longer describes the model: PEFT saves
        if change == "config":
            model.peft_config["default"].lora_dropout = 0.25
        else:
            model.to(torch.float64)
        monkeypatch.setattr(type(model), "save_pretrained", refused)
        with pytest.raises(AssertionError, match="PEFT's save_pretrained called"):
            save_adapter(model, str(tmp_path / f"refused-{change}"))
        monkeypatch.undo()
        save_adapter(model, str(tmp_path / f"ours-{change}"))  # PEFT's save, learned again
        same_as_peft(tmp_path / f"ours-{change}", tmp_path / f"peft-{change}")
    assert json.loads((tmp_path / "ours-config" / "adapter_config.json").read_text())["lora_dropout"] == 0.25
    tensors = load_file(str(tmp_path / "ours-tensors" / "adapter_model.safetensors"))
    assert tensors and all(t.dtype == torch.float64 for t in tensors.values())


def test_parameters_swapped_in_by_a_load_are_saved_not_the_learned_ones(tmp_path):
    """Review finding (2026-12-03): load_state_dict(..., assign=True) (or PEFT's low_cpu_mem_usage
    loads) puts new Parameter objects in the model; the saver still held the first save's, whose
    storage was still alive, and the next publish wrote the old weights under a new version."""
    from grpo_kit.adapter_save import save_adapter

    model, other = tiny_peft(seed=1), tiny_peft(seed=2)
    save_adapter(model, str(tmp_path / "v1"))
    model.load_state_dict({k: v for k, v in other.state_dict().items() if "lora" in k}, strict=False, assign=True)
    save_adapter(model, str(tmp_path / "v2"))
    type(model).save_pretrained(model, str(tmp_path / "peft"))
    assert (tmp_path / "v2" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "peft" / "adapter_model.safetensors").read_bytes()
    assert (tmp_path / "v2" / "adapter_model.safetensors").read_bytes() != \
        (tmp_path / "v1" / "adapter_model.safetensors").read_bytes()
