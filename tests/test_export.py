"""grpo_kit.export on a tiny-model run directory whose adapter versions the real trainer wrote
(:func:`grpo_kit.trainer.train_rank`, world size 1, in this process): the merged checkpoint's
float32 logits are the trainer's policy's within 1e-5, the adapter directory loads in PEFT with the
same logits, both load in vLLM (one engine) with the greedy tokens and log-probs of transformers;
embedding LoRAs merged where the embedding is untied and refused where it is tied; the errors."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import make_samples  # pytest puts tests/ on sys.path
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from grpo_kit import config, data, export, tasks, tiny, trainer
from grpo_kit.adapters import AdapterStore, VersionNotFoundError
from grpo_kit.logprobs import token_logprobs
from grpo_kit.testing import perturbed_adapter
from grpo_kit.train_step import collate

STEPS = 2
TOL = 1e-5
"""Logits: relative to the largest logit in float32 (float32's own noise here is above an absolute 1e-5:
the trainer's float32 and float64 logits differ by 2.6e-5 at a largest logit of 14); absolute elsewhere."""


@pytest.fixture(scope="module")
def tiny_path():
    return str(tiny.ensure_tiny_model())


def write_run(run_dir, cfg) -> None:
    """The ``config.json`` a run writes (``loop.run``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({**cfg.to_dict(), "task": tasks.for_config(cfg).describe()}))


@pytest.fixture(scope="module")
def run(tiny_path, tmp_path_factory):
    """A run directory with versions 1..STEPS trained by the trainer (lr high enough that the
    policy moves away from the base), and that trainer's live state."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = config.profile("tiny", run_dir=str(run_dir), lr=2e-2)
    write_run(run_dir, cfg)
    spec = trainer.RankSpec.for_run(cfg, "export-test", tiny_path, cfg.run.store_root, None)
    for v in range(STEPS):
        trainer.train_rank(spec, make_samples(tiny_path, n=4, flip=bool(v % 2)), v, v)
    yield run_dir, spec
    trainer.drop_state()


@pytest.fixture(scope="module")
def batch(tiny_path):
    """Held-out prompts with their solutions, right-padded."""
    tok = AutoTokenizer.from_pretrained(tiny_path)
    rows = []
    for p in data.synthetic_problems(6, split="heldout", seed=3):
        comp = tok.encode(p.solution, add_special_tokens=False) + [tok.eos_token_id]
        rows.append((tok.encode(p.prompt, add_special_tokens=False), comp, [0.0] * len(comp), 0.0))
    return collate(rows, pad_id=tok.pad_token_id or 0)


def logits(model, batch) -> torch.Tensor:
    """(N, V) logits (in the model's dtype) at the batch's real (unpadded) positions."""
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return out[batch.attention_mask.bool()]


def assert_close(got, want, rel=TOL) -> None:
    """Equal within ``rel`` times the largest logit."""
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rel * scale, f"max |logit difference| {err:.2e} at a largest logit of {scale:.1f}"


def trainer_logits(spec, version: int, batch) -> torch.Tensor:
    """The trainer's own policy at ``version`` (its in-memory PEFT model, synced to the version)."""
    state = trainer.get_state(spec)
    state.sync_to(version)
    return logits(state.model, batch)


def test_merged_checkpoint_is_the_trainers_policy(run, batch, tiny_path, tmp_path, capsys):
    run_dir, spec = run
    out = export.merged(run_dir, tmp_path / "merged")  # the latest version by default
    assert json.loads((out / export.EXPORT_RECORD).read_text())["version"] == STEPS
    assert f"exporting v{STEPS}" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    got, want = logits(model, batch), trainer_logits(spec, STEPS, batch)
    assert_close(got, want)
    base = logits(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval(), batch)
    assert (want - base).abs().max().item() > 0.1  # the adapter matters: a merge that dropped it fails above
    # tokenizer and generation config come along unchanged
    assert AutoTokenizer.from_pretrained(out)(["12 + 34"])["input_ids"] == AutoTokenizer.from_pretrained(tiny_path)(["12 + 34"])["input_ids"]
    assert GenerationConfig.from_pretrained(out).eos_token_id == GenerationConfig.from_pretrained(tiny_path).eos_token_id

    # an earlier version through the command line, in float64: there the merge is exact
    export.main([str(run_dir), "--version", "1", "--merged", str(tmp_path / "v1"), "--dtype", "float64", "--quiet"])
    assert json.loads((tmp_path / "v1" / "config.json").read_text())["dtype"] == "float64"
    v1 = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float64).eval(), batch)
    state = trainer.get_state(spec)
    state.sync_to(1)
    assert (v1 - logits(copy.deepcopy(state.model).double(), batch)).abs().max().item() <= 1e-10
    assert (v1.float() - want).abs().max().item() > 0.01


def test_adapter_directory_loads_in_peft_with_the_trainers_logits(run, batch, tiny_path, tmp_path):
    from peft import PeftModel

    run_dir, spec = run
    out = export.adapter(run_dir, tmp_path / "adapter", progress=False)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors", export.EXPORT_RECORD]
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    assert (logits(model, batch) - trainer_logits(spec, STEPS, batch)).abs().max().item() <= TOL * 1e-2  # same sums


def test_errors(run, tiny_path, tmp_path):
    run_dir, _ = run
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        export.merged(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export.merged(tmp_path, tmp_path / "out")
    with pytest.raises(VersionNotFoundError, match=r"version 9 not found .*available: \[1, 2\]"):
        export.adapter(run_dir, tmp_path / "out", version=9)
    with pytest.raises(ValueError, match="version 0 is the base model"):
        export.adapter(run_dir, tmp_path / "out", version=0)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty; pass --force"):
        export.adapter(run_dir, full, progress=False)
    assert (full / "keep.txt").read_text() == "mine"
    export.adapter(run_dir, full, force=True, progress=False)
    assert not (full / "keep.txt").exists() and (full / "adapter_model.safetensors").is_file()
    # even --force never replaces what it reads, nor a published version inside the store (review finding)
    for protected in (run_dir, run_dir / "store", tiny_path, run_dir / "store" / "adapters" / "v000001", Path(tiny_path) / "sub"):
        with pytest.raises(ValueError, match="refusing to export into"):
            export.merged(run_dir, protected, force=True)
    assert (run_dir / "config.json").is_file()
    link = tmp_path / "link"
    link.symlink_to(full)  # review finding: rmtree refused the link only after the whole export, leaking its staging
    with pytest.raises(FileExistsError, match="is a symbolic link"):
        export.adapter(run_dir, link, force=True, progress=False)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging dir left behind
    empty = tmp_path / "empty-run"
    write_run(empty, config.profile("tiny", run_dir=str(empty)))
    with pytest.raises(VersionNotFoundError, match="no published versions"):
        export.merged(empty, tmp_path / "out")
    export.merged(empty, tmp_path / "base-copy", version=0, progress=False)  # version 0: the base model
    with pytest.raises(SystemExit, match="error: .*version 7 not found"):
        export.main([str(run_dir), "--version", "7", "--adapter", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        export.main([str(run_dir)])  # neither --merged nor --adapter


def test_a_forced_export_that_fails_to_land_keeps_the_previous_one(run, tmp_path, monkeypatch):
    """Review finding: --force deleted the old export before renaming the new one in, so a failed
    rename left neither (and a staging directory nothing cleaned up)."""
    run_dir, _ = run
    out = tmp_path / "served"
    export.adapter(run_dir, out, version=1, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def no_rename(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(export.os, "rename", no_rename)
    with pytest.raises(OSError, match="rename failed"):
        export.adapter(run_dir, out, version=2, force=True, progress=False)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["served"]  # no staging or set-aside directory left
    export.adapter(run_dir, out, version=2, force=True, progress=False)
    assert json.loads((out / export.EXPORT_RECORD).read_text())["version"] == 2


def test_a_merged_export_carries_no_unmerged_copy_of_the_base(run, batch, tiny_path, tmp_path):
    """Review finding: every non-safetensors file was copied, so a base's pytorch_model.bin came along
    unmerged (a loader that read it served the base), and every *.safetensors counted as a shard, so a
    Mistral-style consolidated.safetensors beside an index was copied unmerged too."""
    import shutil

    from safetensors.torch import load_file

    run_dir, spec = run
    base = tmp_path / "base"
    shutil.copytree(tiny_path, base)
    weights = load_file(str(base / "model.safetensors"))
    torch.save(weights, base / "pytorch_model.bin")
    shutil.copyfile(base / "model.safetensors", base / "consolidated.safetensors")
    (base / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: "model.safetensors" for name in weights}}))
    out = export.merged(run_dir, tmp_path / "merged", base_model=str(base), progress=False)
    names = {p.name for p in out.iterdir()}
    assert "pytorch_model.bin" not in names and "consolidated.safetensors" not in names
    assert {"model.safetensors", "model.safetensors.index.json", "config.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_close(logits(model, batch), trainer_logits(spec, STEPS, batch))


def test_an_export_does_not_replace_what_was_written_into_its_directory_meanwhile(run, tmp_path, monkeypatch):
    """Review finding: without --force, OUT was only checked for emptiness at the start; what was
    written into it during the export was moved aside and deleted at the end."""
    run_dir, _ = run
    out = tmp_path / "served"
    out.mkdir()
    write_record = export._write_record

    def meanwhile(*args, **kw):
        (out / "notes.txt").write_text("mine")
        return write_record(*args, **kw)

    monkeypatch.setattr(export, "_write_record", meanwhile)
    with pytest.raises(FileExistsError, match="written to during the export"):
        export.adapter(run_dir, out, version=1, progress=False)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["served"]  # no staging directory left


def untied_copy(path, dest):
    """The tiny model with its output layer untied from its embedding (a copy of it)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(path).save_pretrained(dest)
    return str(dest)


def test_embedding_lora_is_merged_when_untied_and_refused_when_tied(tiny_path, batch, tmp_path):
    """PEFT stores an embedding's LoRA transposed (A: (r, vocab), B: (hidden, r)); merged into a
    tied embedding it would change the output layer too, which the unmerged adapter does not."""
    from peft import PeftModel

    targets = ("embed_tokens", "q_proj", "down_proj")
    for name, base in (("tied", tiny_path), ("untied", untied_copy(tiny_path, tmp_path / "untied-base"))):
        run_dir = tmp_path / name
        write_run(run_dir, config.profile("tiny", run_dir=str(run_dir), model=base))
        lora = perturbed_adapter(base, seed=1, targets=targets)
        with torch.no_grad():  # embedding LoRAs start with A = 0 (B random): make both random
            for n, p in lora.named_parameters():
                if "lora_embedding" in n:
                    p.normal_(0.0, 0.2)
        AdapterStore(str(run_dir / "store")).publish(lora, 1)
        if name == "tied":
            with pytest.raises(ValueError, match="tie_word_embeddings.*--adapter"):
                export.merged(run_dir, tmp_path / "m-tied", progress=False)
            continue
        out = export.merged(run_dir, tmp_path / "m-untied", progress=False)
        want = logits(lora, batch)
        got = logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), batch)
        assert_close(got, want)
        unmerged_embedding = PeftModel.from_pretrained(  # the embedding's delta matters
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(export.adapter(
                run_dir, tmp_path / "a-untied", progress=False))).eval()
        assert (logits(unmerged_embedding, batch) - want).abs().max().item() <= TOL * 1e-2
        with torch.no_grad():
            lora.base_model.model.model.embed_tokens.lora_embedding_B["default"].zero_()
        assert (logits(lora, batch) - want).abs().max().item() > 0.01


def test_adapter_tensors_a_merge_would_drop_are_refused(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    save_file({"base_model.model.lm_head.weight": torch.zeros(3, 2),
               "base_model.model.q_proj.lora_A.weight": torch.zeros(2, 2)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="not LoRA A/B pairs.*lm_head"):
        export.check_mergeable(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ValueError, match="modules_to_save"):
        export.check_mergeable(tmp_path)
    # PEFT saves an embedding's whole weight beside its LoRA: handed back, for the merge to compare with the base's
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    save_file({"base_model.model.model.embed_tokens.base_layer.weight": torch.ones(3, 2),
               "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(2, 3)},
              str(tmp_path / "adapter_model.safetensors"))
    copies = export.check_mergeable(tmp_path)
    assert list(copies) == ["model.embed_tokens.weight"] and torch.equal(copies["model.embed_tokens.weight"], torch.ones(3, 2))


VLLM_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

merged, base, adapter, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
llm = LLM(model=merged, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
          seed=0, enable_lora=True, max_lora_rank=8, max_loras=1)
params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0)

def run(lora=None):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora, use_tqdm=False)
    return [{"ids": list(c.token_ids), "logprobs": [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)]}
            for c in (o.outputs[0] for o in outs)]

result = {"merged": run()}  # the exported checkpoint as vllm.LLM(model=OUT) loads it
llm.collective_rpc("reload_weights", kwargs={"weights_path": base, "is_checkpoint_format": True})
assert llm.reset_prefix_cache()
result["base"] = run()  # the base model's weights, reloaded into the same engine
result["adapter"] = run(LoRARequest("exported", 1, adapter))  # the exported PEFT directory on the base
print("RESULT " + json.dumps(result))
"""


def test_vllm_loads_the_merged_checkpoint_and_the_adapter(run, tiny_path, tmp_path):
    """One vLLM engine (a build costs about 40 s here): built on the merged export (``LLM(model=OUT)``),
    then the base model's weights reloaded into it and the exported adapter attached with a
    ``LoRARequest``. Each gives the greedy tokens of transformers and the trainer's log-probs of them.
    The export's config and tokenizer files are the tiny model's, byte for byte, so the base run is
    also the check that the tiny model loads in vLLM and matches transformers (once test_tiny's)."""
    pytest.importorskip("vllm")
    run_dir, spec = run
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    export.main([str(run_dir), "--merged", str(merged), "--adapter", str(adapter), "--quiet"])
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (merged / f).read_bytes() == (Path(tiny_path) / f).read_bytes(), f
    tok = AutoTokenizer.from_pretrained(tiny_path)
    prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in data.synthetic_problems(4, split="heldout", seed=5)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core in the script's process
    proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(merged), tiny_path, str(adapter), json.dumps(prompts)],
                          capture_output=True, text=True, timeout=600, env=env)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, f"vLLM failed:\n{proc.stderr[-3000:]}"
    got = json.loads(line[0][7:])

    state = trainer.get_state(spec)
    state.sync_to(STEPS)
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    for name, model in (("merged", state.model), ("adapter", state.model), ("base", base)):
        for p, out in zip(prompts, got[name], strict=True):
            with torch.no_grad():
                hf = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)[0, len(p):]
            hf = hf.tolist()
            if tok.eos_token_id in hf:  # generate pads after EOS; vLLM stops at it
                hf = hf[: hf.index(tok.eos_token_id) + 1]
            assert out["ids"] == hf, name
            b = collate([(p, out["ids"], out["logprobs"], 0.0)], pad_id=0)
            with torch.no_grad():
                lp = token_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask)[b.completion_mask.bool()]
            assert (lp - torch.tensor(out["logprobs"])).abs().max().item() <= 1e-3, name
    assert got["merged"] != got["base"]  # the policy is not the base: the checks above can fail


def test_the_default_version_is_the_committed_one_not_an_orphan(tiny_path, tmp_path):
    """Review finding (2026-12-03): the default was the store's highest version, here v3 past a gap (v2
    taken back, a step the fence missed published v3), which a resume deletes."""
    from grpo_kit import checkpoint

    run_dir = tmp_path / "run"
    write_run(run_dir, config.profile("tiny", run_dir=str(run_dir)))
    store = AdapterStore(str(run_dir / "store"))
    store.publish(perturbed_adapter(tiny_path, seed=1), 1)
    checkpoint.save_state(store, {**checkpoint.fresh_state("r"), "version": 1, "next_iteration": 1})
    store.publish(perturbed_adapter(tiny_path, seed=3), 3)
    out = export.adapter(run_dir, tmp_path / "a", progress=False)
    assert json.loads((out / "grpo_kit_export.json").read_text())["version"] == 1
    assert checkpoint.committed_version(store) == 1
    store.publish(perturbed_adapter(tiny_path, seed=2), 2)  # v2 published after v1 (no parent recorded: adopted)
    assert checkpoint.committed_version(store) == 3  # the chain a resume folds in


def test_both_outputs_are_checked_before_either_is_written(run, tmp_path):
    """Review finding (2026-12-03): --merged X --adapter X --force left only the adapter in X, and a
    refused --adapter came after the merged export had been written."""
    run_dir, _ = run
    with pytest.raises(SystemExit):
        export.main([str(run_dir), "--merged", str(tmp_path / "x"), "--adapter", str(tmp_path / "x" / "a"), "--force"])
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty"):
        export.main([str(run_dir), "--merged", str(tmp_path / "m"), "--adapter", str(full), "--quiet"])
    assert not (tmp_path / "m").exists() and not (tmp_path / "x").exists()


def test_a_lora_on_a_tied_output_layer_is_refused_with_the_way_out(tiny_path, tmp_path):
    """Review finding (2026-12-03): the error named lm_head.weight twice, as a weight of another base model."""
    run_dir = tmp_path / "tied"
    write_run(run_dir, config.profile("tiny", run_dir=str(run_dir)))
    AdapterStore(str(run_dir / "store")).publish(perturbed_adapter(tiny_path, seed=1, targets=("q_proj", "lm_head")), 1)
    with pytest.raises(ValueError, match=r"output layer \(lm_head\) of a model that ties it.*--adapter") as e:
        export.merged(run_dir, tmp_path / "m", progress=False)
    assert "lacks" not in str(e.value)


def test_a_run_with_a_cell_registered_plug_in_is_inspected_in_a_fresh_process(tmp_path):
    """Review finding (2026-12-03): config.json records a cell-registered name ("sign"); rebuilding the
    Config for sampling (notebook 04's open_run(...).engine()) in a kernel that never registered it
    raised "advantage must be one of"."""
    cfg = config.profile("tiny", run_dir=str(tmp_path)).to_dict()
    cfg["loss"].update(advantage="sign", policy_loss="__main__:dual_clip")
    with pytest.raises(ValueError, match="advantage must be one of"):
        config.Config.from_dict(cfg)
    got = config.Config.from_dict(export.samplable({**cfg, "task": {"name": "synthetic"}}))
    assert (got.loss.advantage, got.loss.policy_loss) == ("grpo", "__main__:dual_clip")  # module:qualname kept
    assert got.sampling == config.Config.from_dict({**cfg, "loss": config.LossConfig().__dict__}).sampling
