"""AdapterStore on a local directory and on a real S3-protocol server (moto, on 127.0.0.1)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
import uuid

import boto3
import pytest
import torch
from moto.server import ThreadedMotoServer
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from grpo_kit import adapters
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

    stamp = os.stat(os.path.join(path, "adapter_model.safetensors")).st_mtime_ns
    assert store.fetch(0) == path  # cached in this process: not copied again (a time bound of 50 ms flaked
    assert os.stat(os.path.join(path, "adapter_model.safetensors")).st_mtime_ns == stamp  # under a GC pause)


def test_overwrite_refused(store, adapter_dir):
    store.publish_dir(adapter_dir, 3, meta={"run": "a"})
    with pytest.raises(VersionExistsError, match="version 3 already exists"):
        store.publish_dir(adapter_dir, 3, meta={"run": "b"})
    with pytest.raises(VersionExistsError):
        store.publish(tiny_peft(), 3)
    assert store.manifest(3)["meta"] == {"run": "a"}


def test_a_publish_records_the_attempt_its_writer_chose_and_a_fresh_read_sees_a_replaced_version(store, adapter_dir):
    """The trainer names its own attempt (so it knows the manifest's without reading it back), and
    reads a version fresh where it may have been deleted and published anew since it was cached."""
    with pytest.raises(ValueError, match="16 lowercase hex"):
        store.publish_dir(adapter_dir, 1, attempt="not-an-attempt")
    assert store.versions() == []
    first = adapters.new_attempt()
    store.publish_dir(adapter_dir, 1, attempt=first)
    assert store.manifest(1)["attempt"] == first  # now cached in this process
    old_copy = load_file(os.path.join(store.fetch(1), "adapter_model.safetensors"))
    other = AdapterStore(store.root, store.storage_options)
    other.delete(1)
    second = adapters.new_attempt()
    other.publish(tiny_peft(seed=2), 1, attempt=second)
    assert store.manifest(1)["attempt"] == first  # the cache: a version is immutable while it exists
    assert store.attempt(1) == second == store.manifest(1, fresh=True)["attempt"]
    assert store.manifest(1)["attempt"] == second
    # and the copy fetched for the first attempt is checked again, and replaced
    new_copy = load_file(os.path.join(store.fetch(1), "adapter_model.safetensors"))
    assert new_copy.keys() == old_copy.keys() and any(not torch.equal(new_copy[k], old_copy[k]) for k in new_copy)
    other.delete(1)
    with pytest.raises(VersionNotFoundError):
        store.manifest(1, fresh=True)
    with pytest.raises(VersionNotFoundError):  # a deleted version's copy is forgotten too
        store.fetch(1)


def test_racing_writers_one_manifest_wins(store, adapter_dir, monkeypatch):
    """The exclusive manifest write (link on local disks, If-None-Match PUT on S3) catches a writer
    that passed the existence check before the other one finished."""
    store.publish_dir(adapter_dir, 4, meta={"writer": 1})
    monkeypatch.setattr(store, "exists", lambda version: False)
    with pytest.raises(VersionExistsError, match="version 4 already exists"):
        store.publish_dir(adapter_dir, 4, meta={"writer": 2})
    monkeypatch.undo()
    assert store.manifest(4)["meta"] == {"writer": 1} and store.versions() == [4]


def stored_files(store, version: int) -> list[str]:
    """Every object under ``version``'s folder in the store, relative to it."""
    vpath = f"{store.path}/adapters/v{version:06d}"
    store.fs.invalidate_cache(vpath)
    try:
        return sorted(p[len(vpath) + 1:] for p in store.fs.find(vpath))
    except FileNotFoundError:
        return []


def test_losing_attempts_late_upload_leaves_the_committed_version_intact(make_store, adapter_dir, tmp_path, monkeypatch):
    """Two attempts at one version (a retried task whose first try still runs): attempt A uploads its
    files and its manifest lands; attempt B passed the existence check before that, so its uploads
    of other weights land after A's manifest. The committed version must verify and fetch in a
    fresh process (a resumed run) whatever B did; B's files go with the version when it is deleted."""
    a, b = make_store(), make_store(cache_dir=str(tmp_path / "b-cache"))
    other = tmp_path / "other-adapter"
    tiny_peft(seed=2).save_pretrained(str(other))
    a.publish_dir(adapter_dir, 3, meta={"attempt": "a"})
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))

    def check_committed(fresh):
        assert fresh.versions() == [3] and fresh.manifest(3)["meta"] == {"attempt": "a"}
        path = fresh.fetch(3)  # ChecksumError when B's upload had replaced A's weights
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            with open(os.path.join(path, name), "rb") as got, open(os.path.join(adapter_dir, name), "rb") as want:
                assert got.read() == want.read(), name
        torch.testing.assert_close(logits(PeftModel.from_pretrained(tiny_base(), path).eval(), ids),
                                   logits(tiny_peft(), ids), rtol=0, atol=0)

    monkeypatch.setattr(b, "exists", lambda version: False)  # B checked before A's manifest landed
    with pytest.raises(VersionExistsError, match="version 3 already exists"):
        b.publish_dir(str(other), 3, meta={"attempt": "b"})  # B's uploads land, then its manifest is refused
    check_committed(make_store(cache_dir=str(tmp_path / "resumed-cache")))  # nothing cached: a fresh process
    n = len(a.manifest(3)["files"])
    assert len(stored_files(a, 3)) == 1 + n  # the loser removed its own files

    real_write = b._write_bytes

    def crash_before_manifest(path, data, exclusive=False):  # B dies between its uploads and its manifest
        if path.endswith("/manifest.json"):
            raise RuntimeError("simulated crash")
        return real_write(path, data, exclusive)

    monkeypatch.setattr(b, "_write_bytes", crash_before_manifest)
    with pytest.raises(RuntimeError, match="simulated crash"):
        b.publish_dir(str(other), 3, meta={"attempt": "b"})
    monkeypatch.undo()
    resumed = make_store(cache_dir=str(tmp_path / "resumed-again"))
    check_committed(resumed)
    assert len(stored_files(a, 3)) == 1 + 2 * n  # B's leftovers are in the store beside A's files

    resumed.delete(3)  # a frontier delete: the manifest and its attempt's files; another attempt's stay
    assert len(stored_files(resumed, 3)) == n and resumed.versions() == []
    resumed.delete(3, leftovers=True)  # retention: every attempt's files go, the leftovers too
    assert stored_files(resumed, 3) == [] and resumed.versions() == []


def test_old_layout_versions_still_fetch(store, adapter_dir):
    """Stores written before each attempt had its own folder (manifest format 1, files directly in
    the version folder, no keys) are read as before."""
    import hashlib

    vpath = f"{store.path}/adapters/v000002"
    store.fs.makedirs(vpath, exist_ok=True)  # a local directory; nothing on S3
    files = {}
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = open(os.path.join(adapter_dir, name), "rb").read()
        store.fs.pipe_file(f"{vpath}/{name}", data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    manifest = {"format": 1, "version": 2, "parent": None, "created": time.time(), "files": files, "meta": {}}
    store.fs.pipe_file(f"{vpath}/manifest.json", json.dumps(manifest).encode())
    assert store.versions() == [2]
    path = store.fetch(2)
    assert open(os.path.join(path, "adapter_model.safetensors"), "rb").read() == \
        open(os.path.join(adapter_dir, "adapter_model.safetensors"), "rb").read()


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
    target = f"{url}/{store.manifest(0)['files']['adapter_model.safetensors']['key']}"
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


def evict_in_another_process(root: str, cache_dir: str, versions: list[int]) -> None:
    """A second process sharing ``cache_dir``: keeps one version and fetches ``versions`` in turn,
    so it evicts every one but the last (a multiprocessing target)."""
    s = AdapterStore(root, cache_dir=cache_dir, cache_versions=1)
    for v in versions:
        s.fetch(v)


def test_eviction_spares_a_copy_another_process_holds(adapter_dir, tmp_path):
    """Two processes share cache_dir: this one fetched v1 and is about to load it while the other
    fetches v1, v2, v3 with room for one version. The other's eviction must leave this one's copy
    alone; once no process holds a version, evicting it removes it (and its lock file)."""
    import multiprocessing

    root, cache = str(tmp_path / "store"), str(tmp_path / "shared-cache")
    writer = AdapterStore(root)
    for v in (1, 2, 3):
        writer.publish_dir(adapter_dir, v)
    holder = AdapterStore(root, cache_dir=cache, cache_versions=1)
    path = holder.fetch(1)

    proc = multiprocessing.get_context("spawn").Process(target=evict_in_another_process, args=(root, cache, [1, 2, 3]))
    proc.start()
    proc.join(timeout=300)
    assert proc.exitcode == 0

    # the holder's copy survived the other process's eviction and loads
    assert sorted(os.listdir(path)) == sorted([*os.listdir(adapter_dir), "manifest.json"])
    for name in os.listdir(adapter_dir):
        with open(os.path.join(path, name), "rb") as got, open(os.path.join(adapter_dir, name), "rb") as want:
            assert got.read() == want.read(), name
    PeftModel.from_pretrained(tiny_base(), path)
    entries = lambda: sorted(re.sub(r"-[0-9a-f]{16}", "", n) for n in os.listdir(os.path.dirname(path)))  # noqa: E731 (attempts dropped)
    assert entries() == [".v000001.lock", ".v000003.lock", "v000001", "v000003"]  # v2: nobody held it
    holder.fetch(3)  # evicts v1, which no other process holds now
    assert entries() == [".v000003.lock", "v000003"]


def test_concurrent_download_keeps_the_copy_another_process_reads(adapter_dir, tmp_path, monkeypatch):
    """Two stores sharing cache_dir fetch one version at once: the second one's download, finishing
    after the first put its copy in place, must not replace the copy the first one is reading."""
    root, cache = str(tmp_path / "store"), str(tmp_path / "shared-cache")
    AdapterStore(root).publish_dir(adapter_dir, 1)
    first, second = (AdapterStore(root, cache_dir=cache) for _ in range(2))
    path = first.fetch(1)
    weights = os.path.join(path, "adapter_model.safetensors")
    inode = os.stat(weights).st_ino

    checks = []
    real_ok = adapters.copy_matches

    def missed_once(dest, man):  # the second store looked before the first one's copy was in place
        checks.append(dest)
        return False if len(checks) == 1 else real_ok(dest, man)

    monkeypatch.setattr(adapters, "copy_matches", missed_once)  # only the second store fetches from here on
    assert second.fetch(1) == path
    assert os.stat(weights).st_ino == inode  # still the first store's file, never removed under it
    assert len(checks) > 1  # the second store did download (and found the first one's copy good)


@pytest.mark.parametrize("root", ["local", "memory://kit-versions/run"])
def test_only_manifests_where_the_store_puts_them_list_a_version(tmp_path, root):
    """Review finding: a manifest at any depth (a stray copy in adapters/old/) or in a folder not named
    v000012 (adapters/v12) was listed, so latest() named a version exists() and fetch() cannot find."""
    store = AdapterStore(str(tmp_path / "s") if root == "local" else root)
    src = tmp_path / "src"
    src.mkdir()
    (src / "adapter_config.json").write_text("{}")
    (src / "adapter_model.safetensors").write_bytes(b"x")
    for v in (3, 10):
        store.publish_dir(str(src), v)
    for stray in ("old/v000012", "v12"):
        store.fs.makedirs(f"{store.path}/adapters/{stray}", exist_ok=True)
        store.fs.pipe(f"{store.path}/adapters/{stray}/manifest.json", b"{}")
    assert store.versions() == [3, 10] and store.latest() == 10 and all(store.exists(v) for v in store.versions())


def test_a_version_published_anew_never_replaces_a_copy_another_holder_reads(adapter_dir, tmp_path):
    """Review finding: with a shared cache_dir, fetching a version published anew deleted and replaced
    the folder another store still held (it changed under that store's reader). Copies are kept per
    publish attempt."""
    root, cache = str(tmp_path / "store"), str(tmp_path / "shared-cache")
    writer = AdapterStore(root)
    writer.publish_dir(adapter_dir, 5)
    a, b = AdapterStore(root, cache_dir=cache), AdapterStore(root, cache_dir=cache)
    old = a.fetch(5)
    before = {n: open(os.path.join(old, n), "rb").read() for n in os.listdir(old)}
    writer.delete(5)
    changed = tmp_path / "changed"
    shutil.copytree(adapter_dir, changed)
    (changed / "adapter_model.safetensors").write_bytes(b"other weights")
    writer.publish_dir(str(changed), 5)
    new = b.fetch(5)
    assert new != old and open(os.path.join(new, "adapter_model.safetensors"), "rb").read() == b"other weights"
    assert {n: open(os.path.join(old, n), "rb").read() for n in os.listdir(old)} == before  # a's copy untouched
    assert a.attempt(5) == b.attempt(5) and a.fetch(5) == new  # a fresh read moves a to the new attempt's copy
    assert not os.path.exists(old)  # ... and its old copy, held by nobody now, is gone


def _adapter_dir(root, name: str, payload: bytes) -> str:
    d = os.path.join(root, name)
    os.makedirs(d)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write(json.dumps({"r": 1}))
    with open(os.path.join(d, "adapter_model.safetensors"), "wb") as f:
        f.write(payload)
    return d


def test_a_delete_does_not_take_the_files_of_a_publish_of_the_same_version_running_meanwhile(tmp_path):
    """Review finding: delete removed the manifest, then the whole version folder; a publish of the
    same version that uploaded in between had its files removed from under its manifest, leaving a
    version that exists but can never be fetched (or republished)."""
    root = str(tmp_path / "store")
    deleter = AdapterStore(root, cache_dir=str(tmp_path / "a"))
    publisher = AdapterStore(root, cache_dir=str(tmp_path / "b"))
    deleter.publish_dir(_adapter_dir(str(tmp_path), "orphan", b"old" * 10), 5)
    uploaded, removed = threading.Event(), threading.Event()
    write = publisher._write_bytes

    def manifest_after_the_delete(path, data, exclusive=False):
        if path.endswith("manifest.json"):  # the new attempt's files are uploaded; its manifest comes next
            uploaded.set()
            removed.wait(10)
        return write(path, data, exclusive)

    publisher._write_bytes = manifest_after_the_delete
    out = {}
    racer = threading.Thread(target=lambda: out.setdefault("v", publisher.publish_dir(
        _adapter_dir(str(tmp_path), "new", b"new" * 10), 5)))
    fs, rm_file = deleter.fs, deleter.fs.rm_file

    class Fs:  # the publish uploads once the old manifest is gone, before its files are removed
        def __getattr__(self, name):
            return getattr(fs, name)

        def rm_file(self, path):
            rm_file(path)
            if path.endswith("manifest.json"):
                racer.start()
                uploaded.wait(10)

    deleter.fs = Fs()
    deleter.delete(5)
    removed.set()
    racer.join()
    reader = AdapterStore(root, cache_dir=str(tmp_path / "c"))
    with open(os.path.join(reader.fetch(5), "adapter_model.safetensors"), "rb") as f:
        assert f.read() == b"new" * 10


def test_a_failed_fresh_read_keeps_what_the_process_knew_of_a_version(tmp_path):
    """Review finding: a fresh manifest read dropped the cached manifest before reading; when the
    read failed (an S3 503), the fetched copy stayed without it, so once the version was deleted and
    published anew the next fresh read saw no change and fetch served the old attempt's weights."""
    root = str(tmp_path / "store")
    driver, worker = AdapterStore(root), AdapterStore(root, cache_dir=str(tmp_path / "w"))
    driver.publish_dir(_adapter_dir(str(tmp_path), "a1", b"OLD" * 10), 5)
    worker.fetch(5)
    fs = worker.fs

    class Flaky:
        def __getattr__(self, name):
            return getattr(fs, name)

        def cat_file(self, *a, **kw):
            raise OSError("503 SlowDown")

    worker.fs = Flaky()
    with pytest.raises(OSError, match="503"):
        worker.attempt(5)
    worker.fs = fs
    driver.delete(5)
    driver.publish_dir(_adapter_dir(str(tmp_path), "a2", b"NEW" * 10), 5)
    assert worker.attempt(5) == driver.attempt(5)
    with open(os.path.join(worker.fetch(5), "adapter_model.safetensors"), "rb") as f:
        assert f.read() == b"NEW" * 10
