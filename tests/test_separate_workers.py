"""The kit on separately started processes, as on any cluster: ``dask scheduler`` and ``dask worker``
from the command line, each worker in its own working directory, nothing shared with the driver but
the S3-protocol object store (moto on 127.0.0.1), the model path and Dask itself. Once over plain
TCP and once over TLS with certificates from files (as a cluster's nodes get them).

The driver's directory (its run dir: metrics, rollouts, config) is hidden from the workers: each
worker runs in its own mount namespace with an empty tmpfs over that directory (``unshare -m``,
root), so a worker that tried to read the driver's files would fail the run, and anything it wrote
there would stay in its private tmpfs (checked: the worker sees the directory empty).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from grpo_kit import cluster as cl
from grpo_kit import config, loop
from grpo_kit.adapters import AdapterStore
from grpo_kit.testing import assert_run_exact

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[1]
DASK = str(Path(sys.executable).parent / "dask")
BUCKET = "grpo-kit-separate"
ROLES = {"rollout-0": "rollout", "trainer-0": "trainer", "trainer-1": "trainer"}


def _can_hide() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True).returncode == 0


HIDE = _can_hide()


@pytest.fixture(scope="module")
def s3():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    access_log = logging.getLogger("werkzeug")
    level = access_log.level
    access_log.setLevel(logging.WARNING)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield {"client_kwargs": {"endpoint_url": url}, "key": "testing", "secret": "testing"}
    finally:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()
        access_log.setLevel(level)


def make_certs(d: Path) -> dict[str, str]:
    """A CA and one certificate it signed for 127.0.0.1 / localhost (scheduler, workers and client
    share it here; a real cluster would give each its own). PEM files in ``d``."""
    from ipaddress import IPv4Address

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, key, issuer, issuer_key, ca: bool):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                              x509.IPAddress(IPv4Address("127.0.0.1"))]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("grpo-kit test CA", ca_key, "grpo-kit test CA", ca_key, ca=True)
    leaf = cert("grpo-kit node", key, "grpo-kit test CA", ca_key, ca=False)
    d.mkdir(parents=True, exist_ok=True)
    paths = {"ca": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return {k: str(v) for k, v in paths.items()}


class Processes:
    """Command-line processes this test started, each in its own session; stopped by their ids."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], cwd: Path, env: dict, log: Path, hide: Path | None = None) -> subprocess.Popen:
        cwd.mkdir(parents=True, exist_ok=True)
        if hide is not None:  # a private mount namespace in which `hide` is an empty tmpfs
            argv = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs {shlex.quote(str(hide))} && exec {shlex.join(argv)}"]
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _start_cluster(base: Path, procs: Processes, driver_dir: Path, tls: dict | None) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GRPO_KIT_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    tls_args = ["--tls-ca-file", tls["ca"], "--tls-cert", tls["cert"], "--tls-key", tls["key"]] if tls else []
    head = base / "head"
    sched_file = head / "scheduler.json"
    procs.start([DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
                 "--scheduler-file", str(sched_file), *(["--protocol", "tls"] if tls else []), *tls_args],
                cwd=head, env=env, log=base / "scheduler.log")
    deadline, address = time.time() + 60, None
    while address is None and time.time() < deadline:  # the file exists before its JSON is written
        try:  # (a review caught it empty under load)
            address = json.loads(sched_file.read_text())["address"]
        except (FileNotFoundError, ValueError, KeyError):
            time.sleep(0.2)
    assert address is not None, (base / "scheduler.log").read_text()
    for name, role in ROLES.items():
        procs.start([DASK, "worker", address, "--name", name, "--host", "127.0.0.1", "--nthreads", "1",
                     "--memory-limit", "0", "--resources", f"{role}=1", "--local-directory", ".", *tls_args],
                    cwd=base / name, env=env, log=base / f"{name}.log", hide=driver_dir if HIDE else None)
    return address


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_loop_on_separately_started_workers(tmp_path, s3, tls):
    from distributed import Security

    def worker_view(dask_worker, driver_dir: str) -> dict:  # nested: sent by value (workers can't import tests)
        import multiprocessing
        import os

        return {"name": dask_worker.name, "cwd": os.getcwd(),
                "driver_dir": sorted(os.listdir(driver_dir)) if os.path.isdir(driver_dir) else None,
                "daemon": multiprocessing.current_process().daemon}

    driver_dir = tmp_path / "driver"
    driver_dir.mkdir()
    (driver_dir / "only-the-driver-has-this").write_text("x")
    certs = make_certs(tmp_path / "certs") if tls else None
    procs = Processes()
    try:
        address = _start_cluster(tmp_path, procs, driver_dir, certs)
        assert address.startswith("tls://127.0.0.1:" if tls else "tcp://127.0.0.1:")
        security = (Security(tls_ca_file=certs["ca"], tls_client_cert=certs["cert"], tls_client_key=certs["key"],
                             require_encryption=True) if tls else None)
        client = cl.connect(address, security=security, quiet=True)
        try:
            client.wait_for_workers(len(ROLES), timeout=180)
            cfg = config.profile(
                "tiny", engine="hf", iterations=3, eval_every=2, eval_size=8, prompts_per_step=4, group_size=4,
                max_new_tokens=32, world_size=2, lr=1e-3, collective_timeout_s=60, scheduler_address=address,
                run_dir=str(driver_dir / "run"), store_url=f"s3://{BUCKET}/{uuid.uuid4().hex}",
            )
            res = loop.run(cfg, client=client, storage_options=s3, progress=False)
            assert [r["iteration"] for r in res.records] == [0, 1, 2] and res.summary["acc_after"] is not None
            assert_run_exact(driver_dir / "run", cfg, AdapterStore(cfg.run.store_root, s3))
            assert not (driver_dir / "run" / "store").exists()  # adapters went to the object store only
            views = client.run(worker_view, driver_dir=str(driver_dir))
            assert sorted(v["name"] for v in views.values()) == sorted(ROLES)
            for v in views.values():
                assert v["cwd"] == str(tmp_path / v["name"]) and not v["daemon"]
                if HIDE:  # the worker never saw the driver's files, and left nothing there
                    assert v["driver_dir"] == [], v
            if tls:
                assert (addrs := cl.worker_resources(client)) and all(a.startswith("tls://127.0.0.1:") for a in addrs)
                info = client.scheduler_info()
                assert info["address"].startswith("tls://127.0.0.1:")
            assert client.dashboard_link and "127.0.0.1" in client.dashboard_link
        finally:
            client.close()
    finally:
        procs.stop()
