"""grpo_kit.logs: worker output to files with errors still shown, and vLLM's reload warnings filtered.

The worker test runs a real LocalCluster (its workers inherit this process's stdout and stderr, as
a notebook kernel's do); the reload test a real vLLM engine in merged LoRA mode on the tiny model.
"""

from __future__ import annotations

import io
import logging

import pytest

from grpo_kit import cluster as cl
from grpo_kit import logs


def _log(name: str, level: int, msg: str, *args) -> None:
    logging.getLogger(name).log(level, msg, *args)


def test_reload_misses_drops_only_layers_without_checkpoint_weights(caplog):
    caplog.set_level(logging.WARNING, logger=logs.RELOAD_LOGGER)
    with logs.reload_misses() as misses:
        for layer in ("RotaryEmbedding", "ParallelLMHead", "YaRNScalingRotaryEmbedding", "QKVParallelLinear"):
            _log(logs.RELOAD_LOGGER, logging.WARNING, logs.RELOAD_MISS, layer)
        _log(logs.RELOAD_LOGGER, logging.WARNING, "%s: Delayed processing", "RowParallelLinear")
    assert misses.expected == ["RotaryEmbedding", "ParallelLMHead", "YaRNScalingRotaryEmbedding"]
    assert misses.unexpected == ["QKVParallelLinear"]
    # the real failure and any other message are still logged; the expected two are not
    assert [r.getMessage() for r in caplog.records] == [
        "QKVParallelLinear: Failed to load weights",
        "RowParallelLinear: Delayed processing",
    ]
    caplog.clear()
    _log(logs.RELOAD_LOGGER, logging.WARNING, logs.RELOAD_MISS, "RotaryEmbedding")  # outside the block: logged
    assert len(caplog.records) == 1


def test_error_echo_sees_every_logger_and_only_errors():
    stream = io.StringIO()
    own = logging.getLogger("grpo_kit_test.library")  # a library logger with its own handler, like vLLM's
    own.propagate, own.handlers = False, [logging.StreamHandler(io.StringIO())]
    echo = logs.ErrorEcho(stream, prefix="[worker w] ")
    echo.install()
    try:
        own.warning("just noise")
        own.error("engine failed: %s", "out of memory")
        _log("somewhere.else", logging.CRITICAL, "worse")
    finally:
        echo.uninstall()
    own.error("after uninstall")
    assert stream.getvalue().splitlines() == [
        "[worker w] ERROR grpo_kit_test.library: engine failed: out of memory",
        "[worker w] CRITICAL somewhere.else: worse",
    ]
    assert logging.getLogRecordFactory() is not echo


def _worker_noise() -> str:
    import os
    import sys
    import warnings

    print("vLLM start-up banner")
    warnings.warn("a FutureWarning from a library", FutureWarning, stacklevel=1)
    os.write(2, b"C++ says hello\n")  # below Python: written to file descriptor 2
    lib = logging.getLogger("grpo_kit_test.vllm_like")
    lib.propagate, lib.handlers = False, [logging.StreamHandler(sys.stdout)]
    lib.warning("RotaryEmbedding: Failed to load weights")
    lib.error("the engine is broken")
    sys.stdout.flush()
    sys.stderr.flush()
    return "done"


def test_worker_output_goes_to_a_file_and_errors_to_the_kernel(tmp_path, capfd):
    from grpo_kit import cluster

    # spawned: the worker's stderr is then this test's captured one. A forked worker's (connect's
    # default) is the forkserver's, the streams of the test that started the server: in a kernel or a
    # script those never change, under pytest's per-test capture they do
    client = cluster.connect(n_rollout_workers=1, n_trainer_workers=0, worker_start="spawn", quiet=True)
    try:
        capfd.readouterr()
        directory = logs.route_worker_logs(client, tmp_path / "logs")
        assert "worker logs" in capfd.readouterr().out  # the one line that says where they go
        [worker] = cl.worker_resources(client)
        assert client.run(_worker_noise, workers=[worker])[worker] == "done"
        text = (directory / "rollout-0.log").read_text()
        for line in (
            "worker rollout-0",
            "vLLM start-up banner",
            "a FutureWarning",
            "C++ says hello",
            "Failed to load weights",
            "the engine is broken",
        ):
            assert line in text, line
        # what the kernel (this process's captured stdout/stderr) got from the worker: the error only
        client.run(lambda: __import__("sys").stderr.flush(), workers=[worker])
        seen = capfd.readouterr()
        seen = seen.out + seen.err
        assert "[worker rollout-0] ERROR grpo_kit_test.vllm_like: the engine is broken" in seen
        for noise in ("banner", "FutureWarning", "C++", "Failed to load"):
            assert noise not in seen, seen
        # routing again to the same directory (a notebook's cluster cell, then loop.run) changes nothing:
        # no second teardown and set-up of the workers' file descriptors, one header in the file
        assert logs.route_worker_logs(client, tmp_path / "logs", quiet=True) == directory
        client.run(lambda: print("after the second route", flush=True), workers=[worker])
        text = (directory / "rollout-0.log").read_text()
        assert text.count("==== ") == 1 and "after the second route" in text, text
        # another directory (the next run on this client) takes the output from the last one
        moved = logs.route_worker_logs(client, tmp_path / "next", quiet=True)
        client.run(lambda: print("in the next run", flush=True), workers=[worker])
        assert "in the next run" in (moved / "rollout-0.log").read_text()
        assert "in the next run" not in (directory / "rollout-0.log").read_text()
        # unregistering restores the worker's own streams
        logs.unroute_worker_logs(client)
        client.run(lambda: print("back on the inherited stdout", flush=True), workers=[worker])
        assert "back on the inherited stdout" in capfd.readouterr().out
    finally:
        cluster.shutdown(client)
        cluster.use_worker_start("forkserver")  # connect's default again for the modules after this one


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_worker_killed_outright_keeps_its_last_prints(tmp_path):
    """Review finding (2026-12-03): a worker's stdout (a pipe) stayed block-buffered after the redirect,
    so a worker killed outright (memory limit, OOM, segfault) lost the lines printed before it died."""
    import os
    import subprocess
    import sys

    code = ("import os, signal, types\nfrom grpo_kit import logs\n"
            f"logs.WorkerLogs({str(tmp_path)!r}).setup(types.SimpleNamespace(name='rollout-0', address='tcp://x'))\n"
            "print('last words before the crash')\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert "last words before the crash" in (tmp_path / "rollout-0.log").read_text()


def test_merged_reload_is_quiet_and_a_layer_without_weights_raises(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from grpo_kit import data, lora_merge, tiny, vllm_engine
    from grpo_kit.adapters import AdapterStore
    from grpo_kit.testing import perturbed_adapter

    path = str(tiny.ensure_tiny_model())
    store = AdapterStore(str(tmp_path / "store"))
    store.publish(perturbed_adapter(path, seed=1), 1)
    store.publish(perturbed_adapter(path, seed=2, targets=("o_proj", "gate_proj", "up_proj", "down_proj")), 2)
    # the engine reads the base checkpoint once, on its first merged load; this test then breaks it
    checkpoint = lora_merge.base_weights(path)
    monkeypatch.setattr(lora_merge, "base_weights", lambda _: checkpoint)
    problems = data.synthetic_problems(2, split="train", seed=0)
    engine = vllm_engine.VLLMEngine(path, store=store, max_batch_seqs=8, lora_mode="merged")
    seen = _Records()  # after the engine: configuring vLLM's logging empties its child loggers' handlers
    logging.getLogger(logs.RELOAD_LOGGER).addHandler(seen)
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)  # as VLLM_LOGGING_LEVEL=ERROR (import trl) leaves it: still checked
    try:
        engine.generate(problems, 2, 1, max_new_tokens=8, seed=0)
        assert seen.messages == []  # the tied LM head and the rotary embedding no longer warn
        # a real failure: the first layer's q/k/v projections are gone from the checkpoint (v2 does
        # not target them), so vLLM's fused qkv layer gets no tensor and would keep v1's weights
        for key in [k for k in checkpoint if any(f"layers.0.self_attn.{p}_proj" in k for p in "qkv")]:
            del checkpoint[key]
        with pytest.raises(RuntimeError, match=r"loaded no weights into \['QKVParallelLinear'\] for adapter v2"):
            engine.generate(problems, 2, 2, max_new_tokens=8, seed=0)
        assert seen.messages == ["QKVParallelLinear: Failed to load weights"]  # vLLM's own warning still logged
    finally:
        vllm_logger.setLevel(level)
        logging.getLogger(logs.RELOAD_LOGGER).removeHandler(seen)
        engine.close()
