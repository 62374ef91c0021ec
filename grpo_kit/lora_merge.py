"""The LoRA merge: ``W + (alpha / r) B A`` per targeted weight, from a PEFT adapter directory.

One implementation for the two places that merge: the vLLM engine's merged LoRA mode
(:class:`grpo_kit.vllm_engine.VLLMEngine`, which reloads the base checkpoint with the deltas added)
and the export of a merged checkpoint for serving (:mod:`grpo_kit.export`). Deltas are computed in
float32 (or a given dtype); PEFT's own ``merge_and_unload()`` gives the same weights to 1e-6
(``tests/test_lora_merge.py``).
"""

from __future__ import annotations

import os


def ties_word_embeddings(model_path: str) -> bool:
    """Whether the checkpoint at ``model_path`` shares one matrix between its input embedding and
    its output layer (``tie_word_embeddings``; vLLM loads it once for both)."""
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(model_path)
    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    return bool(getattr(conf, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def adapter_deltas(path: str, tied_embeddings: bool = False, dtype=None) -> dict:
    """``{hf weight name: delta}`` in float32 for a PEFT LoRA adapter directory: ``(alpha / r) * B @ A``
    for a linear layer, ``(alpha / r) * (B @ A).T`` for an embedding (PEFT stores its A as
    ``(r, num_embeddings)`` and its B as ``(embedding_dim, r)``, the delta is ``(num_embeddings,
    embedding_dim)``). An embedding LoRA of a model that ties its embedding to its output layer
    (``tied_embeddings``) raises: merged, the delta would change the output layer too, which the
    trainer's unmerged adapter leaves alone. ``dtype``: the torch dtype of the deltas (None: float32)."""
    import json

    import torch
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        conf = json.load(f)
    unsupported = [k for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern") if conf.get(k)]
    if unsupported:
        raise ValueError(f"lora_mode='merged' does not merge adapters with {unsupported}; use lora_mode='request'")
    r, alpha = conf["r"], conf["lora_alpha"]
    scale = alpha / (r**0.5) if conf.get("use_rslora") else alpha / r
    sd = load_file(os.path.join(path, "adapter_model.safetensors"))
    deltas = {}
    for key, a in sd.items():
        if ".lora_A." in key:  # a linear layer: A (r, in), B (out, r)
            module, b = key.split(".lora_A.")[0], sd[key.replace(".lora_A.", ".lora_B.")]
            delta = b.to(dtype or torch.float32) @ a.to(dtype or torch.float32)
        elif key.endswith(".lora_embedding_A"):  # an embedding: A (r, num_embeddings), B (embedding_dim, r)
            module, b = key[: -len(".lora_embedding_A")], sd[key[: -len("A")] + "B"]
            delta = (b.to(dtype or torch.float32) @ a.to(dtype or torch.float32)).T
            if tied_embeddings:
                raise ValueError(
                    f"lora_mode='merged': the adapter in {path} has a LoRA on {module.split('.')[-1]}, the input "
                    "embedding of a model that ties it to its output layer (tie_word_embeddings): merged, the "
                    "delta would change the output layer too, which the trainer's adapter does not. Use "
                    "lora_mode='request', or leave the embedding out of lora_targets"
                )
        else:
            continue
        module = module[len("base_model.model."):] if module.startswith("base_model.model.") else module
        deltas[module + ".weight"] = scale * delta
    if not deltas:
        raise ValueError(f"no LoRA A/B pairs in {path}")
    return deltas


INDEX = "model.safetensors.index.json"
"""A sharded checkpoint's index of its safetensors files."""


def safetensors_shards(model_path: str) -> list[str]:
    """A checkpoint's weight files: those its ``model.safetensors.index.json`` lists where it has one
    (a ``consolidated.safetensors`` beside them, Mistral's single-file copy of the same weights, is
    left out), else every ``*.safetensors``."""
    import glob
    import json

    index = os.path.join(model_path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(model_path, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    return sorted(glob.glob(os.path.join(model_path, "*.safetensors")))


def base_weights(model_path: str) -> dict:
    """Every tensor of a local Hugging Face checkpoint (:func:`safetensors_shards`)."""
    from safetensors.torch import load_file

    files = safetensors_shards(model_path)
    if not files:
        raise FileNotFoundError(f"lora_mode='merged' needs a local safetensors checkpoint; none in {model_path}")
    out = {}
    for file in files:
        out.update(load_file(file))
    return out
