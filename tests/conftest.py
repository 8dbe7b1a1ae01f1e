"""Shared fixtures: the reference runs that many tests compare against and the data sets that many
read, each made once per test run (``made_once``: the first xdist worker to need one makes it, the
other waits and reads it), and a real two-node SLURM cluster, started once when installed.

The suite runs on two pytest-xdist workers (pyproject.toml: ``-n 2 --dist loadfile``): a test file
stays on one worker, the longest files start first, and a test marked ``machine_alone`` (it bounds
something machine-wide: /dev/shm, the share of time spent waiting) runs while the other worker
waits. ``-n 0`` runs everything in this one process.

A reference run writes a checkpoint after every optimizer step; a resume test copies step k's
checkpoint into a new folder, resumes it once and compares the end with the reference's."""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from helpers import CLASSIFIER_REF, MOCO_REF, SYMMETRIC_REF, Reference, assert_ok, free_port, run_ranks
from slurm_cluster import missing_tools, start_cluster, stop_cluster

# The files that take longest, started first so that the two workers end together. (In order of
# their time alone, the heaviest ran side by side and the suite took a quarter longer.)
LONGEST_FIRST = ("test_launch_scripts.py", "test_gpu_check.py", "test_moco.py", "test_image_files.py",
                 "test_training.py", "test_zoo_steps.py")
# The workers' common folder, made by the controlling process: the turnstile's locks, made_once's folders
SHARED = "DDP_TESTS_SHARED"


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: one thread each, as two ranks on two cores
        torch.set_num_threads(1)
    else:  # made before the workers start, which inherit the variable
        os.environ[SHARED] = tempfile.mkdtemp(prefix="ddp-tests-")


def pytest_unconfigure(config):
    shared = None if hasattr(config, "workerinput") else os.environ.pop(SHARED, None)
    if shared:
        shutil.rmtree(shared, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A turnstile between the workers: every test holds a shared lock while it runs; a
    ``machine_alone`` test takes it exclusively, and holds the gate that every test passes first,
    so that the other worker stops before its next test until this one is done; it runs on every
    core, as in one process."""
    if not hasattr(item.config, "workerinput"):
        yield
        return
    alone = item.get_closest_marker("machine_alone") is not None
    shared = Path(os.environ[SHARED])
    with open(shared / "gate", "a") as gate, open(shared / "running", "a") as running:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        threads = torch.get_num_threads()
        torch.set_num_threads((os.cpu_count() or 1) if alone else threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            fcntl.flock(running, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def root_logger_as_it_was():
    """A run in this process sets the root logger's handler (on that test's captured stdout) and
    level (DEBUG with --debug); both are put back after each test, so that a later test's
    records (a library's DEBUG lines included) never reach a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def made_once(name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``name``, made by ``make(folder)`` once for the whole test run, in the workers'
    shared folder: the first worker to ask makes it while the other waits, then both read it (no
    test writes into it). A make that failed is made anew by the next ask."""
    root = Path(os.environ[SHARED])
    folder, made = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            make(folder)
            made.touch()
    return folder


def _reference(name: str, script: str, args: list[str]) -> Reference:
    def make(root: Path) -> None:
        root.mkdir()
        ckpts = ["--ckpt-every", "1", "--keep-checkpoints", "100", "--out", str(root / "run")]
        proc = run_ranks(script, args + ckpts, root)
        assert_ok(proc)
        (root / "stdout.txt").write_text(proc.stdout)

    root = made_once(name, make)
    return Reference(script, args, root / "run", (root / "stdout.txt").read_text())


@pytest.fixture(scope="session")
def classifier_reference() -> Reference:
    return _reference("classifier_reference", "train_classifier.py", CLASSIFIER_REF)


@pytest.fixture(scope="session")
def moco_reference() -> Reference:
    return _reference("moco_reference", "train_moco.py", MOCO_REF)


@pytest.fixture(scope="session")
def symmetric_reference() -> Reference:
    return _reference("symmetric_reference", "train_moco.py", SYMMETRIC_REF)


@pytest.fixture(scope="session")
def trained_moco() -> Path:
    """A one-process MoCo run folder (small_cnn, 16 px, 5 steps) with its exported backbone:
    what the probe, export, bad-input and recipe tests start from. Read it, never write into it."""
    def make(root: Path) -> None:
        import train_moco

        root.mkdir()
        args = ["--device", "cpu", "--image-size", "16", "--batch-size", "32", "--moco-k", "256", "--max-steps", "5",
                "--knn-every", "0", "--export-backbone", str(root / "backbone.pt"), "--out", str(root / "run")]
        assert train_moco.main(args) == 0

    return made_once("trained_moco", make)


@pytest.fixture(scope="session")
def jpeg_folder() -> Path:
    """An ImageNet-like ImageFolder of JPEGs made from real photographs (bench/imagenet_like.py):
    3 classes x 12 training images plus a CMYK, a grayscale and a PNG-named-JPEG file (39), and
    3 x 4 validation images, ImageNet's sizes. Read it, never write into it (copy it first)."""
    from bench.imagenet_like import write_imagenet_like

    return made_once("imagenet_like",
                     lambda root: write_imagenet_like(root, classes=3, train_per_class=12, val_per_class=4))


@pytest.fixture(scope="session")
def written(jpeg_folder) -> Path:
    """``jpeg_folder`` as ``write_shards.py`` writes it, in shards of 0.5 MB (several per split).
    Read it, never write into it."""
    import write_shards

    def make(root: Path) -> None:
        assert write_shards.main([str(jpeg_folder), str(root), "--shard-mb", "0.5"]) == 0

    return made_once("shards", make)


@pytest.fixture(scope="session")
def s3_server() -> dict[str, str]:
    """An S3-compatible server on localhost (moto's server mode, installed by
    requirements-dev.txt), for the session: the AWS_* variables that reach it, with credentials
    of its own (which no run may write down or log)."""
    server = Path(sys.executable).with_name("moto_server")
    if not server.exists():
        pytest.fail(f"{server} is missing; pip install -r requirements-dev.txt installs moto[server]")
    port = free_port()
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "key-id-never-logged",
           "AWS_SECRET_ACCESS_KEY": "secret-never-logged", "AWS_DEFAULT_REGION": "us-east-1"}
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("moto_server did not start within 30 s")
            time.sleep(0.1)
    old = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # for the tests' own clients and the runs in this process
    yield env
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def bucket(s3_server, written) -> str:
    """``written`` copied into a bucket of ``s3_server`` as it is: its ``s3://`` address."""
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="ddp-test")
    for path in written.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), "ddp-test", f"imagenet-like/{path.relative_to(written)}")
    return "s3://ddp-test/imagenet-like"


@pytest.fixture(scope="session")
def far(s3_server):
    """The far-network proxy (tests/far_network.py) in front of the S3 server (no latency, no cap
    unless a test sets them), and the AWS_* variables that go through it."""
    from far_network import FarNetwork

    port = int(s3_server["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    with FarNetwork(("127.0.0.1", port), latency_s=None, bytes_per_s=None) as proxy:
        yield proxy, {**s3_server, "AWS_ENDPOINT_URL": proxy.url}


@pytest.fixture
def proxied(far, bucket, monkeypatch):
    """This process's requests through the proxy (a client of its own made for it), the test
    bucket made; the proxy as it was afterwards: no rule, no cap, no hold, no cut."""
    from ddp_utils.data.object_store import forget_client

    proxy, env = far
    monkeypatch.setenv("AWS_ENDPOINT_URL", env["AWS_ENDPOINT_URL"])
    forget_client()
    proxy.set(latency_s=None, bytes_per_s=None)
    yield proxy
    proxy.rewrite(None)
    proxy.set(latency_s=None, bytes_per_s=None)
    proxy.release()
    proxy.end_cut()
    forget_client()


@pytest.fixture(scope="session")
def one_per_shard(bucket, tmp_path_factory) -> tuple[Path, str]:
    """An ImageNet-like folder of 72 + 12 JPEGs (bench/imagenet_like.py) in shards of one image,
    on disk and in the bucket: far more shards than a rank's share of a node cache sized to the
    read-ahead holds, so that every epoch downloads."""
    import boto3

    import write_shards
    from bench.imagenet_like import write_imagenet_like

    folder, dst = tmp_path_factory.mktemp("folder"), tmp_path_factory.mktemp("one_per_shard") / "out"
    write_imagenet_like(folder, classes=3, train_per_class=24, val_per_class=4, oddities=False)
    assert write_shards.main([str(folder), str(dst), "--shard-mb", "0.01"]) == 0
    client = boto3.client("s3")
    for path in dst.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), "ddp-test", f"one-per-shard/{path.relative_to(dst)}")
    return dst, "s3://ddp-test/one-per-shard"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    missing = missing_tools()
    if missing:
        reason = f"SLURM is not installed (missing: {', '.join(missing)}); .ci/run installs it"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + " - in CI a missing SLURM is a failure, not a skip")
        pytest.skip(reason)
    # One cluster per machine: two would number their jobs alike, and a job's rendezvous port and
    # id come from its number. (loadfile keeps the SLURM tests, all in one file, on one worker.)
    with open(Path(tempfile.gettempdir()) / "ddp-tests-slurm.lock", "a") as owner:
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pytest.fail("another test session runs its SLURM cluster on this machine; wait for it to end")
        cluster, pids = start_cluster(tmp_path_factory.mktemp("slurm"))
        try:
            yield cluster
        finally:
            stop_cluster(pids)
