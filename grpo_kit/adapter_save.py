"""Saving a PEFT model's adapter as ``save_pretrained`` does, fast enough for the trainer's critical
path: PEFT's files (``adapter_model.safetensors``, ``adapter_config.json``), without its model card,
written directly from the second save of a model on (:class:`AdapterSaver`). The store publishes
what this writes (:meth:`grpo_kit.adapters.AdapterStore.publish`)."""

from __future__ import annotations

import os
import weakref


def save_adapter(peft_model, directory: str) -> None:
    """PEFT's ``save_pretrained(directory)`` (safetensors), without the README model card; the
    same files, written faster from the second save of a model on.

    ``save_pretrained`` renders a model card from a Jinja template on every call: 23 of its 38 ms
    on the tiny model, on the trainer's critical path once per step. PEFT has no switch for it, so
    the model's ``create_or_update_model_card`` is replaced by a no-op for the call. What is left of
    it still walks every module of the model and re-validates the config (about 8 of its 10 ms on
    the tiny model): the first save of a model is PEFT's, and what it wrote is learned
    (:class:`AdapterSaver`); later saves write the same parameters and config bytes directly while
    the adapter's config and its parameters (the same tensors, updated in place) are unchanged.
    """
    saver = _SAVERS.get(peft_model)
    if saver is not None and saver.valid(peft_model):
        saver.write(directory)
        return
    card = getattr(peft_model, "create_or_update_model_card", None)
    if card is None:  # another PEFT layout: save as is
        peft_model.save_pretrained(directory, safe_serialization=True)
        return
    peft_model.create_or_update_model_card = lambda *a, **k: None
    try:
        peft_model.save_pretrained(directory, safe_serialization=True)
    finally:
        del peft_model.create_or_update_model_card  # the class's method again
    saver = AdapterSaver.learn(peft_model, directory)
    if saver is None:
        _SAVERS.pop(peft_model, None)
    else:
        _SAVERS[peft_model] = saver


class AdapterSaver:
    """What :func:`save_adapter` learned from PEFT's save of a model: the parameter behind each
    tensor of ``adapter_model.safetensors`` and the bytes of ``adapter_config.json``. :meth:`write`
    writes the same two files from them; :meth:`valid` says whether they still describe the model
    (one adapter, ``default``, with the config it had, and the same parameter tensors)."""

    WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"

    def __init__(self, pairs: list, config: dict, config_bytes: bytes) -> None:
        self.pairs = pairs  # (safetensors key, parameter, its data_ptr when learned)
        self.config, self.config_bytes = config, config_bytes

    @classmethod
    def learn(cls, peft_model, directory: str) -> AdapterSaver | None:
        """From PEFT's save of ``peft_model`` into ``directory``; None where that save is not one
        this class reproduces (other files or adapters, a tensor that is not a parameter, parameters
        sharing storage, a tensor PEFT converted)."""
        import torch
        from peft.utils import get_peft_model_state_dict
        from safetensors import safe_open

        try:
            if list(getattr(peft_model, "peft_config", {})) != ["default"] or \
                    sorted(os.listdir(directory)) != sorted((cls.WEIGHTS, cls.CONFIG)):
                return None
            params = {p.data_ptr(): p for p in peft_model.parameters()}
            state = get_peft_model_state_dict(peft_model, adapter_name="default")
            pairs, seen = [], set()
            with safe_open(os.path.join(directory, cls.WEIGHTS), "pt") as f:
                if f.metadata() != {"format": "pt"} or sorted(f.keys()) != sorted(state):
                    return None
                for key in f.keys():
                    p, t = params.get(state[key].data_ptr()), f.get_tensor(key)
                    if p is None or p.data_ptr() in seen or p.shape != t.shape or p.dtype != t.dtype or \
                            not torch.equal(p.detach().cpu(), t):
                        return None
                    seen.add(p.data_ptr())
                    pairs.append((key, p, p.data_ptr()))
            with open(os.path.join(directory, cls.CONFIG), "rb") as fh:
                config_bytes = fh.read()
            return cls(pairs, peft_model.peft_config["default"].to_dict(), config_bytes)
        except Exception:  # noqa: BLE001 - anything unexpected: PEFT's own save every time
            return None

    def valid(self, peft_model) -> bool:
        """Whether :meth:`write` would write what PEFT's save of ``peft_model`` writes now."""
        cfg = getattr(peft_model, "peft_config", {})
        if list(cfg) != ["default"] or cfg["default"].to_dict() != self.config:
            return False
        # still the model's own parameters (a load with assign=True, or low_cpu_mem_usage, swaps in new
        # Parameter objects: a review found the next save wrote the first save's weights), in place
        held = {id(p) for p in peft_model.parameters()}
        return all(id(p) in held and p.data_ptr() == ptr for _, p, ptr in self.pairs)

    def write(self, directory: str) -> None:
        """The two files, as PEFT's save writes them."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        save_file({k: p.detach().contiguous() for k, p, _ in self.pairs}, os.path.join(directory, self.WEIGHTS),
                  metadata={"format": "pt"})
        with open(os.path.join(directory, self.CONFIG), "wb") as fh:
            fh.write(self.config_bytes)


_SAVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""PEFT model -> its :class:`AdapterSaver` (dropped with the model)."""
