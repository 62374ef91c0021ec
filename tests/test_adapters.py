"""AdapterStore on a local directory and on a real S3-protocol server (moto, on 127.0.0.1)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import time
import uuid

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from grpo_kit.adapters import AdapterStore, ChecksumError, VersionExistsError, VersionNotFoundError

BUCKET = "grpo-kit-test"


@pytest.fixture(scope="module")
def s3_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    access_log = logging.getLogger("werkzeug")
    level = access_log.level
    access_log.setLevel(logging.WARNING)  # one INFO line per request would bury failure reports
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        boto3.client(
            "s3",
            endpoint_url=url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # cached clients point at the server about to stop
        server.stop()
        access_log.setLevel(level)


@pytest.fixture(params=["local", "s3"])
def make_store(request, tmp_path):
    """A factory of stores on one fresh root: ``make_store(cache_dir=...)``."""
    if request.param == "local":
        root, opts = str(tmp_path / "store"), None
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        root = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}

    def make(cache_dir: str | None = None) -> AdapterStore:
        return AdapterStore(root, storage_options=opts, cache_dir=cache_dir or str(tmp_path / "cache"))

    return make


@pytest.fixture
def store(make_store):
    return make_store()


def tiny_base() -> Qwen3ForCausalLM:
    torch.manual_seed(0)  # the same base weights on every call
    config = Qwen3Config(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_peft(seed: int = 1):
    model = get_peft_model(tiny_base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # zero at init: perturb so that the adapter changes the logits
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """One adapter saved with save_pretrained, for tests that only need files to publish."""
    path = tmp_path_factory.mktemp("adapter")
    tiny_peft().save_pretrained(str(path))
    return str(path)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_round_trip_gives_the_published_logits(store):
    assert store.versions() == [] and store.latest() is None
    model = tiny_peft()
    url = store.publish(model, 0, meta={"step": 0, "reward": 0.25})
    store.publish(tiny_peft(seed=2), 1, meta={"step": 1}, parent=0)

    assert url == store.version_url(0)
    assert store.versions() == [0, 1] and store.latest() == 1
    assert store.exists(1) and not store.exists(2)
    man = store.manifest(1)
    assert man["version"] == 1 and man["parent"] == 0 and man["meta"] == {"step": 1}
    assert abs(man["created"] - time.time()) < 60
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(man["files"])

    path = store.fetch(0)
    assert os.path.isfile(os.path.join(path, "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(tiny_base(), path).eval()
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)
    assert not torch.allclose(logits(loaded, ids), logits(tiny_base(), ids))  # the adapter does matter

    t0 = time.perf_counter()
    assert store.fetch(0) == path  # cached in this process
    assert time.perf_counter() - t0 < 0.05


def test_overwrite_refused(store, adapter_dir):
    store.publish_dir(adapter_dir, 3, meta={"run": "a"})
    with pytest.raises(VersionExistsError, match="version 3 already exists"):
        store.publish_dir(adapter_dir, 3, meta={"run": "b"})
    with pytest.raises(VersionExistsError):
        store.publish(tiny_peft(), 3)
    assert store.manifest(3)["meta"] == {"run": "a"}


def test_racing_writers_one_manifest_wins(store, adapter_dir, monkeypatch):
    """The exclusive manifest write (link on local disks, If-None-Match PUT on S3) catches a writer
    that passed the existence check before the other one finished."""
    store.publish_dir(adapter_dir, 4, meta={"writer": 1})
    monkeypatch.setattr(store, "exists", lambda version: False)
    with pytest.raises(VersionExistsError, match="version 4 already exists"):
        store.publish_dir(adapter_dir, 4, meta={"writer": 2})
    monkeypatch.undo()
    assert store.manifest(4)["meta"] == {"writer": 1} and store.versions() == [4]


def test_missing_version(store, adapter_dir):
    with pytest.raises(VersionNotFoundError, match="no published versions"):
        store.fetch(0)
    store.publish_dir(adapter_dir, 1)
    store.publish_dir(adapter_dir, 2)
    with pytest.raises(VersionNotFoundError, match=r"version 7 not found .*available: \[1, 2\]") as info:
        store.fetch(7)
    assert isinstance(info.value, KeyError)
    with pytest.raises(KeyError):
        store.manifest(7)
    with pytest.raises(ValueError, match="non-negative int"):
        store.fetch(-1)


def test_tampered_file_fails_verification(store, adapter_dir):
    url = store.publish_dir(adapter_dir, 0)
    target = f"{url}/adapter_model.safetensors"
    data = bytearray(store.fs.cat_file(target))
    data[-1] ^= 0xFF
    store.fs.pipe_file(target, bytes(data))
    for _ in range(2):  # a failed fetch caches nothing
        with pytest.raises(ChecksumError, match="version 0: adapter_model.safetensors has sha256"):
            store.fetch(0)


def test_interrupted_publish_leaves_no_version(store, adapter_dir, monkeypatch):
    real_put, calls = store.fs.put_file, []

    def crash_on_second(lpath, rpath, *args, **kwargs):
        calls.append(rpath)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real_put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(store.fs, "put_file", crash_on_second)
    with pytest.raises(RuntimeError, match="simulated crash"):
        store.publish_dir(adapter_dir, 5)
    monkeypatch.undo()

    assert store.fs.exists(calls[0])  # the first file landed: a partial version is in the store
    assert store.versions() == [] and store.latest() is None and not store.exists(5)
    with pytest.raises(VersionNotFoundError):
        store.fetch(5)

    store.publish_dir(adapter_dir, 5, meta={"retry": True})
    assert store.versions() == [5]
    assert os.path.isfile(os.path.join(store.fetch(5), "adapter_config.json"))


def test_concurrent_reader_never_sees_a_partial_version(make_store, adapter_dir, tmp_path, monkeypatch):
    writer, reader = make_store(), make_store(cache_dir=str(tmp_path / "reader-cache"))
    n_versions, seen, errors = 4, {}, []
    real_put = writer.fs.put_file

    def slow_put(*args, **kwargs):  # widen the window in which a version is partial
        time.sleep(0.03)
        return real_put(*args, **kwargs)

    monkeypatch.setattr(writer.fs, "put_file", slow_put)
    done = threading.Event()

    def read():
        try:
            while True:
                finished = done.is_set()  # read before listing: the last listing sees everything
                for v in reader.versions():
                    if v not in seen:
                        path = reader.fetch(v)
                        seen[v] = json.loads(open(os.path.join(path, "manifest.json")).read())["meta"]["i"]
                if finished:
                    return
        except Exception as e:  # surfaced in the main thread below
            errors.append(e)

    thread = threading.Thread(target=read)
    thread.start()
    try:
        for i in range(n_versions):
            writer.publish_dir(adapter_dir, i, meta={"i": i}, parent=i - 1 if i else None)
    finally:
        done.set()
        thread.join(timeout=30)
    assert not errors, errors
    assert seen == {i: i for i in range(n_versions)}


def test_state_round_trip_adamw(store):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    store.save_state("optimizer", opt.state_dict())
    store.save_state("runs/step_000001/optimizer", opt.state_dict())  # nested names are fine

    loaded = store.load_state("optimizer")
    assert loaded["param_groups"] == opt.state_dict()["param_groups"]
    for k, v in opt.state_dict()["state"].items():
        for name, t in v.items():
            torch.testing.assert_close(loaded["state"][k][name], t, rtol=0, atol=0)
    opt2 = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())
    opt2.load_state_dict(loaded)
    with pytest.raises(FileNotFoundError, match="no state 'nope'"):
        store.load_state("nope")


class NotWeights:
    pass


def test_load_state_does_not_unpickle_objects(store):
    store.save_state("evil", {"x": NotWeights()})
    with pytest.raises(pickle.UnpicklingError):
        store.load_state("evil")


def test_json_round_trip(store):
    with pytest.raises(FileNotFoundError, match="no run state 'loop'"):
        store.read_json("loop")
    store.write_json("loop", {"step": 1, "versions": [0, 1]})
    store.write_json("loop", {"step": 2, "versions": [0, 1, 2], "done": False})
    assert store.read_json("loop") == {"step": 2, "versions": [0, 1, 2], "done": False}
    leftovers = [p for p in store.fs.find(f"{store.path}/state") if ".tmp-" in p]
    assert leftovers == []


@pytest.mark.parametrize("name", ["", "../escape", "a/../b", "/abs", "a//b", "sp ace"])
def test_bad_state_names(tmp_path, name):
    store = AdapterStore(str(tmp_path))
    with pytest.raises(ValueError, match="state name"):
        store.write_json(name, {})


def test_pickles_for_workers(store, adapter_dir):
    store.publish_dir(adapter_dir, 2)
    clone = pickle.loads(pickle.dumps(store))
    assert clone.root == store.root and clone.versions() == [2]
    assert os.path.isdir(clone.fetch(2))
    default_cache = AdapterStore(store.root, store.storage_options)  # per-process temp cache
    assert os.path.isfile(os.path.join(default_cache.fetch(2), "adapter_model.safetensors"))


def test_save_adapter_writes_what_save_pretrained_writes(tmp_path):
    """The store saves without PEFT's model card; the weights and config are PEFT's own."""
    import json

    from safetensors import safe_open

    from grpo_kit.adapters import save_adapter

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


def test_fetch_cache_keeps_the_last_few_versions(make_store, adapter_dir, tmp_path):
    """A rollout worker fetches every version it samples from; the cache must not keep them all
    (at 8B and r16 each is ~175 MB: 200 versions were ~35 GB per worker)."""
    s = make_store(cache_dir=str(tmp_path / "cache"))
    s.cache_versions = 3
    for v in range(1, 9):
        s.publish_dir(adapter_dir, v)
    paths = {v: s.fetch(v) for v in range(1, 7)}
    cached = lambda: sorted(v for v, p in paths.items() if os.path.isdir(p))  # noqa: E731
    assert cached() == [4, 5, 6]
    s.fetch(4)  # used again: now the most recent, so 5 goes next
    s.fetch(7)
    assert cached() == [4, 6] and os.path.isdir(s.fetch(7))
    # an evicted version comes back on demand, verified against its manifest
    again = s.fetch(1)
    assert again == paths[1] and os.path.isfile(os.path.join(again, "adapter_model.safetensors"))
    versions_on_disk = [d for d in os.listdir(os.path.dirname(again)) if d.startswith("v")]
    assert len(versions_on_disk) == 3
    assert pickle.loads(pickle.dumps(s)).cache_versions == 3
    with pytest.raises(ValueError, match="cache_versions"):
        AdapterStore(str(tmp_path / "x"), cache_versions=0)
