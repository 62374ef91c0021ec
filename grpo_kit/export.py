"""Export a run's policy at one adapter version for serving: a merged Hugging Face checkpoint, or a
PEFT adapter directory.

``python -m grpo_kit.export RUN_DIR [--version N] --merged OUT`` writes base + LoRA as one
checkpoint (``AutoModelForCausalLM.from_pretrained(OUT)``, ``vllm.LLM(model=OUT)``, ``vllm serve
OUT``); ``--adapter OUT`` writes the version's PEFT directory (``PeftModel.from_pretrained(base,
OUT)``, vLLM's ``LoRARequest(name, id, OUT)``, ``vllm serve BASE --enable-lora --lora-modules
name=OUT``). Both at once is one call. The version defaults to the run's latest committed one
(:func:`grpo_kit.checkpoint.committed_version`: the run state's version and the unbroken chain
published above it, which is what a resumed run continues from; until 2026-12-03 the highest
version in the store, which could be an orphan a resume deletes); ``--version 0`` merged is a copy
of the base model.

Where things come from: ``RUN_DIR/config.json`` names the base model (:func:`grpo_kit.models.resolve_model`)
and the store (``run.store_url``, else ``RUN_DIR/store``); the version is fetched through
:class:`grpo_kit.adapters.AdapterStore`, every file checked against its manifest's sha256.

The merge is the one the vLLM engine's merged LoRA mode does (:func:`grpo_kit.lora_merge.adapter_deltas`):
``W + (alpha/r) B A`` per target module in float32 (float64 for ``dtype="float64"``), cast to the
checkpoint's dtype (or ``dtype``),
shard by shard, every other tensor and file (config, tokenizer, chat template, generation config)
copied byte for byte. Refused rather than merged wrong: an embedding LoRA on a model whose
embedding is tied to its output layer (merged, it would change the output layer too), DoRA and
per-module rank patterns, adapter tensors other than LoRA A/B pairs (``modules_to_save``, LoRA
biases), a delta whose module the checkpoint lacks or whose shape differs. The largest relative
error the cast left in a merged delta is reported (float32: ~1e-7; bfloat16 rounds most of a
small delta away, so serve such a run with ``--adapter`` or merge with ``dtype="float32"``).
Each export directory gets a ``grpo_kit_export.json`` saying what it was made from. Output goes to
a temporary directory beside ``OUT`` and is renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .adapters import MANIFEST, AdapterStore, VersionNotFoundError
from .checkpoint import committed_version
from .models import MARKER as MODEL_MARKER
from .models import resolve_model

EXPORT_RECORD = "grpo_kit_export.json"
"""Written into every export: the run, the version, the base model and the adapter's checksums."""
SKIPPED_FILES = {MODEL_MARKER, "grpo_kit_tiny.json", "README.md", ".gitattributes"}
"""Base-checkpoint files not copied into a merged export (the kit's build records, the base's model card)."""
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".pkl", ".index.json")
"""Endings of the base's weights in other formats (and their shard indexes), never copied into a
merged export: a loader that found them would serve the unmerged base (``model.safetensors.index.json``
is copied: the merged shards keep their names)."""
MERGE_DTYPES = ("float32", "float64", "bfloat16", "float16")
"""The ``dtype`` values :func:`merged` accepts."""
ROUNDING_WARN = 1e-2
"""A merged delta whose relative rounding error exceeds this gets a warning (a bfloat16 merge)."""


def samplable(config: dict) -> dict:
    """A run's ``config.json`` as :meth:`grpo_kit.config.Config.from_dict` takes it in any process: the
    task left out, and a plug-in name registered only in the training process (a notebook cell's
    ``register_advantage("sign")``) replaced by the default, which sampling never reads (a review:
    inspecting such a run in a fresh kernel raised "advantage must be one of ...")."""
    from . import algorithms

    out = {k: v for k, v in config.items() if k != "task"}
    loss = dict(out.get("loss") or {})
    for kind, registry in algorithms.REGISTRIES.items():
        name = loss.get(kind)
        if isinstance(name, str) and name not in registry and ":" not in name:
            loss[kind] = "grpo"  # (the default of both)
    if "loss" in out:
        out["loss"] = loss
    return out


@dataclass(frozen=True)
class RunSource:
    """Where a run's policy lives: its directory's ``config.json``, the base model, the adapter store."""

    run_dir: Path
    """The run directory."""
    config: dict
    """Its ``config.json``."""
    model_path: str
    """The base model's local directory."""
    store: AdapterStore
    """The run's adapter store."""

    def version(self, version: int | None = None) -> int:
        """``version`` checked against the store (:class:`VersionNotFoundError` naming the available
        ones), or the latest committed version when None. Version 0 is the base model."""
        if version is None:
            latest = committed_version(self.store)
            if latest is None:
                raise VersionNotFoundError(
                    f"the run's adapter store {self.store.root} holds no published versions (no training step of "
                    f"{self.run_dir} finished yet); pass version 0 to export the base model"
                )
            return latest
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        if version:
            self.store.manifest(version)  # VersionNotFoundError, with the versions available
        return version

    def engine(self, **kw):
        """A transformers engine (:class:`grpo_kit.hf_engine.HFEngine`) on the base model and this store,
        with the run's dtype, prompt format (the task's instruction) and stop strings: ``generate`` or
        ``greedy`` with any ``version`` samples that version's policy. ``kw`` override those options."""
        from .config import Config
        from .hf_engine import HFEngine
        from .prompts import prompt_format

        cfg = Config.from_dict(samplable(self.config))
        instruction = (self.config.get("task") or {}).get("instruction")
        fmt = prompt_format(cfg) if instruction is None else prompt_format(cfg, instruction)
        return HFEngine(self.model_path, store=self.store, **{**HFEngine.options(cfg, fmt), **kw})


def open_run(run_dir: str | os.PathLike, *, store_url: str | None = None, storage_options: dict | None = None,
             base_model: str | None = None, progress: bool = False) -> RunSource:
    """The :class:`RunSource` of ``run_dir``. ``store_url`` and ``base_model`` replace what
    ``config.json`` names (a run directory copied from elsewhere); ``storage_options`` go to the store."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"no such run directory: {run}")
    conf_path = run / "config.json"
    if not conf_path.is_file():
        raise FileNotFoundError(f"{run} holds no run (no config.json)")
    conf = json.loads(conf_path.read_text())
    # the recorded run_dir may be relative to where the run was started: the store beside config.json
    url = store_url or (conf.get("run") or {}).get("store_url") or str(run / "store")
    model = base_model or (conf.get("model") or {}).get("model", "tiny")
    return RunSource(run, conf, resolve_model(model, progress=progress), AdapterStore(url, storage_options))


def adapter(run_dir: str | os.PathLike, out: str | os.PathLike, version: int | None = None, *, force: bool = False,
            store_url: str | None = None, storage_options: dict | None = None, base_model: str | None = None,
            progress: bool = True) -> Path:
    """Write adapter ``version`` (default: the latest) of the run at ``run_dir`` to ``out`` as a PEFT
    directory (``adapter_config.json``, ``adapter_model.safetensors``, as the trainer saved them).
    ``out`` must be missing or empty unless ``force``. Returns ``out``."""
    src = open_run(run_dir, store_url=store_url, storage_options=storage_options, base_model=base_model,
                   progress=progress)
    v = src.version(version)
    if v == 0:
        raise ValueError("version 0 is the base model: it has no adapter (export it with --merged, or serve the base)")
    out = _check_out(out, force, src)
    fetched = src.store.fetch(v)
    _say(progress, f"exporting adapter v{v} of {src.run_dir} ({src.store.version_url(v)}) to {out}")
    with _staging(out, force) as tmp:
        for name in sorted(os.listdir(fetched)):
            if name != MANIFEST and os.path.isfile(os.path.join(fetched, name)):
                shutil.copyfile(os.path.join(fetched, name), tmp / name)
        _write_record(tmp, src, v, "adapter")
    _say(progress, f"wrote {out}: PeftModel.from_pretrained(base, {str(out)!r}) or LoRARequest(..., {str(out)!r}) "
                   f"on the base model {src.model_path}")
    return out


def merged(run_dir: str | os.PathLike, out: str | os.PathLike, version: int | None = None, *, force: bool = False,
           dtype: str | None = None, store_url: str | None = None, storage_options: dict | None = None,
           base_model: str | None = None, progress: bool = True) -> Path:
    """Write the run's policy at ``version`` (default: the latest) to ``out`` as one Hugging Face
    checkpoint: the base model with the adapter merged into its weights (module docstring).
    ``dtype`` casts every floating tensor (and the config's dtype) to it; None keeps the
    checkpoint's. ``out`` must be missing or empty unless ``force``. Returns ``out``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .lora_merge import INDEX, adapter_deltas, safetensors_shards, ties_word_embeddings

    if dtype is not None and dtype not in MERGE_DTYPES:
        raise ValueError(f"dtype must be one of {MERGE_DTYPES} or None, got {dtype!r}")
    src = open_run(run_dir, store_url=store_url, storage_options=storage_options, base_model=base_model,
                   progress=progress)
    v = src.version(version)
    out = _check_out(out, force, src)
    base = Path(src.model_path)
    shards = [Path(f) for f in safetensors_shards(str(base))]
    if not shards:
        raise FileNotFoundError(f"the base model {base} holds no *.safetensors weights: the merged export reads those")
    deltas, copies = {}, {}
    if v:
        fetched = src.store.fetch(v)
        copies = check_mergeable(fetched)
        try:
            deltas = adapter_deltas(fetched, tied_embeddings=ties_word_embeddings(str(base)),
                                    dtype=_dtype("float64" if dtype == "float64" else "float32"))
        except ValueError as e:  # the engine's wording names its lora_mode; the way out here is --adapter
            raise ValueError(f"cannot merge adapter v{v}: {e}. Export it with --adapter (served as a LoRA, it is "
                             "applied as the trainer applies it)") from e
    _say(progress, f"exporting v{v} of {src.run_dir} merged into {base} to {out} "
                   f"({len(deltas)} weights get a LoRA delta)")
    worst, merged_names = 0.0, set()
    with _staging(out, force) as tmp:
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no iterator
            for name, w in tensors.items():
                if name in copies and not torch.equal((copy := copies.pop(name)), w.to(copy.dtype)):
                    raise ValueError(f"adapter v{v} carries its own {name} (PEFT's save_embedding_layers), which differs "
                                     "from the base model's: export it with --adapter")
                target = _dtype(dtype) if dtype is not None and w.is_floating_point() else w.dtype
                if name in deltas:
                    delta = deltas[name]
                    if tuple(delta.shape) != tuple(w.shape):
                        raise ValueError(f"adapter v{v}: the delta of {name} is {tuple(delta.shape)}, the base "
                                         f"model's weight is {tuple(w.shape)}: was it trained on another base model?")
                    new = (w.to(delta.dtype) + delta).to(target)
                    kept = new.double() - w.double()
                    scale = delta.double().norm().item()
                    if scale > 0:
                        worst = max(worst, (kept - delta.double()).norm().item() / scale)
                    tensors[name] = new.contiguous()
                    merged_names.add(name)
                elif target != w.dtype:
                    tensors[name] = w.to(target)
            save_file(tensors, str(tmp / shard.name), metadata={**meta, "format": meta.get("format", "pt")})
        missing = sorted((set(deltas) - merged_names) | set(copies))  # (a name in both was listed twice)
        if missing and ties_word_embeddings(str(base)) and all(n.rsplit(".", 2)[-2] == "lm_head" for n in missing):
            raise ValueError(f"adapter v{v} trains the output layer (lm_head) of a model that ties it to its input "
                             "embedding (tie_word_embeddings: the checkpoint holds one matrix for both), so merged it "
                             "would change the embedding too. Export it with --adapter (served as a LoRA, it is "
                             "applied as the trainer applies it)")
        if missing:
            raise ValueError(f"adapter v{v} targets weights the base checkpoint {base} lacks: {missing[:3]}"
                           f"{' ...' if len(missing) > 3 else ''}")
        for p in sorted(base.iterdir()):
            if p.is_file() and p.suffix != ".safetensors" and p.name not in SKIPPED_FILES and \
                    (p.name == INDEX or not p.name.endswith(OTHER_WEIGHTS)):
                shutil.copyfile(p, tmp / p.name)
        if dtype is not None:
            _set_config_dtype(tmp / "config.json", dtype)
        if not (tmp / "generation_config.json").exists():  # vLLM and generate() read EOS ids from it
            from transformers import AutoConfig, GenerationConfig

            GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp)).save_pretrained(tmp)
        _write_record(tmp, src, v, "merged", merge_rel_error=worst, dtype=dtype)
    if worst > ROUNDING_WARN:
        print(f"warning: casting the merged weights rounded away {100 * worst:.0f}% of the LoRA delta (relative "
              f"error); serve this version with --adapter, or export with --dtype float32", file=sys.stderr)
    _say(progress, f"wrote {out}: {len(merged_names)} weights merged, largest relative rounding of a delta "
                   f"{worst:.1e}; AutoModelForCausalLM.from_pretrained({str(out)!r}) or vllm.LLM(model={str(out)!r})")
    return out


LORA_KEYS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B")
"""Substrings of the adapter tensors a merge folds into the weights."""
PEFT_PREFIX = "base_model.model."


def check_mergeable(path: str | os.PathLike) -> dict:
    """The base-layer weights the PEFT adapter directory ``path`` carries (``{checkpoint name: tensor}``:
    PEFT saves an embedding's whole weight beside its LoRA, ``save_embedding_layers``), which a merge
    requires to equal the base model's. Raises ValueError for anything else that is not a LoRA A/B
    pair (``modules_to_save`` copies, LoRA biases): a merge of ``(alpha/r) B A`` would drop it."""
    from safetensors import safe_open

    conf = json.loads((Path(path) / "adapter_config.json").read_text())
    if conf.get("modules_to_save") or conf.get("lora_bias"):
        raise ValueError(f"the adapter in {path} has modules_to_save or LoRA biases, which the merge does not "
                         "fold in; export it with --adapter")
    copies, other = {}, []
    with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open has no iterator
            if any(s in k for s in LORA_KEYS):
                continue
            if k.endswith(".base_layer.weight"):
                name = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
                copies[name.replace(".base_layer.", ".")] = f.get_tensor(k)
            else:
                other.append(k)
    if other:
        raise ValueError(f"the adapter in {path} holds tensors that are not LoRA A/B pairs ({other[:3]}), which "
                         "the merge does not fold in; export it with --adapter")
    return copies


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _set_config_dtype(path: Path, dtype: str) -> None:
    conf = json.loads(path.read_text())
    conf["dtype"] = dtype
    if "torch_dtype" in conf:  # the name before transformers 5
        conf["torch_dtype"] = dtype
    text = conf.get("text_config")
    if isinstance(text, dict):
        for key in ("dtype", "torch_dtype"):
            if key in text:
                text[key] = dtype
    path.write_text(json.dumps(conf, indent=2) + "\n")


def _check_out(out: str | os.PathLike, force: bool, src: RunSource) -> Path:
    """``out`` as a Path, refused when it is a file, a symbolic link, a non-empty directory without
    ``force``, or (even with ``force``) the run directory, the base model or the local store, a folder
    above one, or a folder inside the base model or the store (a published version's)."""
    out = Path(out)
    if out.is_symlink():
        raise FileExistsError(f"{out} is a symbolic link; export to the directory it points to, {out.resolve()}")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    resolved = out.resolve()
    inside_too = [Path(src.model_path)] + ([Path(src.store.root)] if "://" not in src.store.root else [])
    for p, deep in [(src.run_dir, False), *((q, True) for q in inside_too)]:  # <run_dir>/export is fine
        p = p.resolve()
        if resolved == p or resolved in p.parents or (deep and p in resolved.parents):
            raise ValueError(f"refusing to export into {out}: it is, holds or sits inside {p}, which the export reads")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty; pass --force (force=True) to replace it")
    return out


class _staging:
    """A temporary directory beside ``out``, renamed to ``out`` (replacing it) when the block succeeds
    and removed when it fails, so ``out`` is never half written."""

    def __init__(self, out: Path, force: bool) -> None:
        self.out, self.force = out, force

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.tmp-"))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        try:
            if self.out.exists() and not self.force:  # empty when the export started: rmdir fails if it is not now
                try:
                    self.out.rmdir()
                except OSError:
                    raise FileExistsError(f"{self.out} was written to during the export; nothing was replaced") from None
            if self.out.exists():  # force (checked before the export started): set aside, not deleted
                old = Path(tempfile.mkdtemp(dir=self.out.parent, prefix=f".{self.out.name}.old-"))
                os.replace(self.out, old / "out")
            os.rename(self.tmp, self.out)
        except BaseException:
            if old is not None and not self.out.exists():
                os.replace(old / "out", self.out)  # the previous export back where it was
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)


def _write_record(tmp: Path, src: RunSource, version: int, kind: str, **extra) -> None:
    info = {
        "kind": kind,
        "version": version,
        "run_dir": str(src.run_dir.resolve()),
        "store": src.store.root,
        "base_model": (src.config.get("model") or {}).get("model"),
        "base_model_path": src.model_path,
        "adapter_sha256": {n: f["sha256"] for n, f in src.store.manifest(version)["files"].items()} if version else None,
        "prompt": src.config.get("prompt"),
        "instruction": (src.config.get("task") or {}).get("instruction"),
        "created": time.time(),
        **extra,
    }
    (tmp / EXPORT_RECORD).write_text(json.dumps(info, indent=1) + "\n")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m grpo_kit.export RUN_DIR [--version N] (--merged OUT | --adapter OUT)``."""
    ap = argparse.ArgumentParser(
        prog="python -m grpo_kit.export",
        description="Export a run's policy at one adapter version: a merged Hugging Face checkpoint (--merged) "
                    "and/or the PEFT adapter directory (--adapter).")
    ap.add_argument("run_dir", help="the run directory (holds config.json)")
    ap.add_argument("--version", type=int, default=None, help="adapter version (default: the run's latest committed one)")
    ap.add_argument("--merged", metavar="OUT", help="write base + adapter merged as one checkpoint to OUT")
    ap.add_argument("--adapter", metavar="OUT", help="write the PEFT adapter directory to OUT")
    ap.add_argument("--dtype", choices=MERGE_DTYPES, default=None,
                    help="dtype of the merged weights (default: the base checkpoint's)")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    ap.add_argument("--store", default=None, help="adapter store URL (default: config.json's store_url, else RUN_DIR/store)")
    ap.add_argument("--base", default=None, help="base model (default: the one config.json names)")
    ap.add_argument("--quiet", action="store_true", help="no progress messages")
    args = ap.parse_args(argv)
    if not args.merged and not args.adapter:
        ap.error("give --merged OUT and/or --adapter OUT")
    common = {"version": args.version, "force": args.force, "store_url": args.store, "base_model": args.base,
              "progress": not args.quiet}
    if args.merged and args.adapter:  # both outputs checked before either is written (a review: the second
        m, a = Path(args.merged).resolve(), Path(args.adapter).resolve()  # replaced the first, or was refused after it)
        if m == a or m in a.parents or a in m.parents:
            ap.error(f"--merged {args.merged} and --adapter {args.adapter} must be separate folders, neither inside the other")
    try:
        if args.merged and args.adapter:
            src = open_run(args.run_dir, store_url=args.store, base_model=args.base)
            for out in (args.merged, args.adapter):
                _check_out(out, args.force, src)
            if args.version is None:  # both of one version, even if a new one lands
                common["version"] = src.version()
        if args.merged:
            merged(args.run_dir, args.merged, dtype=args.dtype, **common)
        if args.adapter:
            adapter(args.run_dir, args.adapter, **common)
    except (OSError, ValueError, KeyError) as e:  # VersionNotFoundError is a KeyError, ModelNotFoundError an OSError
        sys.exit(f"{ap.prog}: error: {e}")


if __name__ == "__main__":
    main()
