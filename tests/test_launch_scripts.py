"""launch/: two torchrun "nodes" on one machine, and the sbatch scripts against a real SLURM
(the `slurm` fixture in conftest.py), including preemption by USR1 and requeue."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    CLASSIFIER_REF,
    REPO,
    assert_ok,
    assert_same_state,
    cli_env,
    free_port,
    load_ckpt,
    read_scalars,
    run_ranks,
    wait_until,
)
from slurm_cluster import descendants

DIGITS_CPU = ["--device", "cpu", "--dataset", "digits", "--log-every", "1"]


@pytest.mark.slow
@pytest.mark.torch_versions  # the c10d rendezvous waits for a lost node and forms the group anew
def test_two_torchrun_nodes_lose_one_and_resume_when_it_is_back(classifier_reference, tmp_path):
    """launch/torchrun_multinode.sh on two "nodes" (one agent and worker each, c10d on 127.0.0.1),
    restarts on. The node that does not hold the rendezvous store (the endpoint's host: losing
    that one ends the job) dies mid-run (its launcher, agent and worker, SIGKILL); the other's
    worker stops and its agent waits at the rendezvous; the node is started again, the group forms
    anew and resumes from the last checkpoint, ending bit for bit as the reference."""
    port = free_port()
    env = cli_env({"NNODES": "2", "NPROC": "1", "RDZV_ENDPOINT": f"127.0.0.1:{port}",
                   "RDZV_ID": "test-two-nodes", "MAX_RESTARTS": "1", "PYTHON": sys.executable})
    out = tmp_path / "r"
    args = CLASSIFIER_REF + ["--ckpt-every", "5", "--out", str(out)]

    def node(name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(["bash", str(REPO / "launch/torchrun_multinode.sh"), "train_classifier.py", *args,
                                     *extra], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        return proc, log

    nodes = {"a": node("a"), "b": node("b")}
    try:
        _lose_a_node_and_bring_it_back(nodes, node, port, classifier_reference, out)
    finally:  # nothing left behind, whatever failed
        for proc, _ in nodes.values():
            _kill_tree(proc.pid)


def _kill_tree(pid: int) -> None:
    for victim in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def _lose_a_node_and_bring_it_back(nodes: dict, node, port: int, classifier_reference, out: Path) -> None:
    deadline = time.time() + 120
    # The step-10 checkpoint is on disk once its line is logged (a step's own line comes before it).
    while not any(re.search(r"saved checkpoint .*\(step 10\b", log.read_text()) for _, log in nodes.values()):
        assert time.time() < deadline, [log.read_text()[-2000:] for _, log in nodes.values()]
        time.sleep(0.1)
    listening = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
    store = {int(pid) for pid in re.findall(r"pid=(\d+)", listening)}
    lost = next(name for name, (proc, _) in nodes.items() if not store & {proc.pid, *descendants(proc.pid)})
    survivor = "b" if lost == "a" else "a"
    _kill_tree(nodes[lost][0].pid)
    _wait_for(nodes[survivor][1], r"rank \d stops: lost contact with another rank", timeout=30)
    # The lost node comes back: the same command plus --resume auto (its launcher is a first
    # attempt: without it, its check would refuse the used --out).
    nodes["again"] = node("again", "--resume", "auto")
    for name in (survivor, "again"):
        assert nodes[name][0].wait(timeout=300) == 0, nodes[name][1].read_text()[-3000:]
    text = nodes[survivor][1].read_text() + nodes["again"][1].read_text()
    assert "--nnodes=2" in text and "--rdzv-backend=c10d" in text and "--max-restarts=1" in text  # printed command
    resumed = int(_wait_for_text(text, r"resumed from .*: step (\d+)").group(1))
    assert resumed % 5 == 0 and resumed >= 10  # the last checkpoint before the loss
    assert "weights identical on all 2 ranks" in text
    assert_same_state(load_ckpt(out / "checkpoint_last.pt"), load_ckpt(classifier_reference.checkpoint(44)))


# ----------------------------------------------------------------------------- SLURM
def sbatch_env(**extra: str) -> dict[str, str]:
    return cli_env({"PYTHON": sys.executable, **extra})


def submit(slurm, script: str | Path, sbatch_args: list[str], train_args: list[str], log: Path,
           wait: bool = True, cwd: Path = REPO, **env: str):
    """``sbatch --wait`` of a launch script (by its absolute path), from ``cwd``."""
    path = script if isinstance(script, Path) else REPO / "launch" / script
    cmd = ["sbatch", "--wait", "--parsable", f"--output={log}", "--gpus-per-node=0", *sbatch_args,
           str(path), *train_args]
    if wait:
        return subprocess.run(cmd, cwd=cwd, env={**sbatch_env(**env), **slurm.env},
                              capture_output=True, text=True, timeout=600)
    return subprocess.Popen(cmd, cwd=cwd, env={**sbatch_env(**env), **slurm.env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def running_job(slurm, script: str, sbatch_args: list[str], train_args: list[str], log: Path, **env: str):
    """A job submitted without waiting for it: (its ``sbatch --wait`` process, its id); cancelled
    if still running when the block ends, so that a failed test leaves no job holding the nodes."""
    job = submit(slurm, script, sbatch_args, train_args, log, wait=False, **env)
    job_id = job.stdout.readline().strip()
    try:
        assert job_id.isdigit(), job.stderr.read() if job.poll() is not None else job_id
        yield job, job_id
    finally:
        if job.poll() is None:
            slurm.run("scancel", job_id)
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(timeout=60)  # sbatch --wait returns once the job has ended
            job.kill()
            wait_until(lambda: not slurm.job_processes(job_id), timeout=60)


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_classifier_with_torchrun_from_another_directory(slurm, tmp_path):
    """SLURM runs a spooled copy of the batch script; the repository is found from the job's
    command, and relative paths are taken from where sbatch was called. Job lines carry times."""
    log = tmp_path / "job.log"
    proc = submit(slurm, "slurm_classifier.sbatch", ["--cpus-per-task=2", "--time=10"],
                  DIGITS_CPU + ["--arch", "lenet", "--max-steps", "6", "--out", "run"], log, cwd=tmp_path,
                  MAX_RESTARTS="0")
    text = log.read_text()
    assert proc.returncode == 0, proc.stderr + text
    assert "torch.distributed.run --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d" in text
    assert "--max-restarts=0" in text and "torchrun launch: world size 2" in text
    assert load_ckpt(tmp_path / "run/checkpoint_last.pt")["step"] == 6
    assert read_scalars(tmp_path / "run/tb")["train/loss"][-1][0] == 6
    assert re.search(r"^\d\d:\d\d:\d\d \[job\] job \d+ \(restart 0\) on 1 node", text, re.M), text
    assert re.search(r"^\d\d:\d\d:\d\d \[job\] training exited with code 0$", text, re.M), text


def _wait_for(path: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        match = re.search(pattern, path.read_text()) if path.exists() else None
        if match:
            return match
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} never appeared in {path}:\n{path.read_text() if path.exists() else ''}")


# ----------------------------------------------------------------------------- two nodes
# MoCo (shuffle BN across the nodes' ranks): 60 steps, across the end of epoch 1, a step logged each time.
MOCO_JOB = DIGITS_CPU + ["--image-size", "16", "--batch-size", "16", "--moco-k", "64", "--epochs", "5",
                         "--max-steps", "60", "--knn-every", "0"]
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=10"]  # torchrun: one agent per node


def _placement(text: str) -> dict[str, list[int]]:
    """The job log's "ranks by node: a: 0; b: 1" line, as {node: [ranks]}."""
    line = _wait_for_text(text, r"ranks by node: (.*)$").group(1)
    return {node: [int(r) for r in ranks.split(", ")] for node, ranks in
            (part.split(": ") for part in line.split("; "))}


def _wait_for_text(text: str, pattern: str) -> re.Match:
    match = re.search(pattern, text, re.M)
    assert match, f"{pattern!r} not in the log:\n{text}"
    return match


def _one_rank_per_node(slurm, text: str) -> None:
    placement = _placement(text)
    assert sorted(placement) == sorted(slurm.nodes) and sorted(placement.values()) == [[0], [1]], placement


@pytest.fixture(scope="module")
def two_node_moco(slurm, tmp_path_factory) -> tuple[Path, str]:
    """The uninterrupted two-node job in torchrun mode (its run folder and job log)."""
    root = tmp_path_factory.mktemp("two_nodes")
    proc = submit(slurm, "slurm_moco.sbatch", TWO_NODES, MOCO_JOB + ["--out", str(root / "run")], root / "job.log",
                  NPROC_PER_NODE="1")
    text = (root / "job.log").read_text()
    assert proc.returncode == 0, proc.stderr + text
    return root / "run", text


@pytest.mark.slow
@pytest.mark.slurm
def test_two_node_moco_job_with_torchrun(slurm, two_node_moco):
    """One torchrun agent per node, meeting by c10d at the head node: world size 2 across the
    nodes, shuffle BN across them, identical replicas, one run folder written by rank 0."""
    out, text = two_node_moco
    assert re.search(r"\[job\] job \d+ \(restart 0\) on 2 node\(s\)", text), text
    assert re.search(r"--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=\S+:\d+", text), text
    assert "torchrun launch: world size 2" in text and "shuffle BN: key batches are shuffled across 2 ranks" in text
    _one_rank_per_node(slurm, text)
    assert "encoders, queue and pointer identical on all 2 ranks" in text
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1  # rank 0's writer only
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint_last.pt", "checkpoint_prev1.pt", "config.json", "tb"]
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 60


@pytest.mark.slow
@pytest.mark.slurm
def test_two_node_moco_job_with_srun(slurm, tmp_path):
    """One task per node, no torchrun: ranks from SLURM_PROCID across the two nodes."""
    out, log = tmp_path / "run", tmp_path / "job.log"
    proc = submit(slurm, "slurm_moco.sbatch", TWO_NODES, MOCO_JOB + ["--max-steps", "4", "--out", str(out)], log,
                  LAUNCH_MODE="srun")
    text = log.read_text()
    assert proc.returncode == 0, proc.stderr + text
    assert "slurm launch: world size 2" in text  # init_distributed's SLURM branch
    # the command it printed is the one it ran, --cpus-per-task included
    assert re.search(r"\[job\] \+ MASTER_ADDR=\S+ MASTER_PORT=\d+ srun --cpus-per-task=1 \S*python \S*/train_moco.py", text)
    _one_rank_per_node(slurm, text)
    assert "encoders, queue and pointer identical on all 2 ranks" in text
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 4


@pytest.mark.slow
@pytest.mark.slurm
def test_a_job_from_a_bucket_requeues_itself_for_the_store_and_for_a_preemption_and_ends_as_never_stopped(
        slurm, far, one_per_shard, s3_server, tmp_path):
    """MoCo on 2 nodes from shards in an S3 server behind the far network. The store is cut at step 3
    for longer than --store-timeout: every rank stops with exit 75 after a checkpoint, the job
    script sees STORE_UNAVAILABLE and requeues the job. Once the store answers, the requeued attempt
    empties each node's shard cache, resumes at that checkpoint, and is preempted with USR1: every
    rank stops after the same step, rank 0 checkpoints, the job requeues itself again and resumes.
    The run ends bit for bit as the same run never stopped (on 2 ranks outside SLURM); every step is
    in TensorBoard once."""
    proxy, env = far
    _, bucket = one_per_shard
    args = ["--device", "cpu", "--dataset", "shards", "--data-dir", bucket, "--image-size", "32", "--batch-size",
            "4", "--workers", "1", "--moco-k", "32", "--knn-every", "0", "--epochs", "4", "--log-every", "1",
            "--shard-read-ahead", "0", "--store-timeout", "3"]  # 9 steps an epoch; a node cache of 9 shards a rank
    whole = tmp_path / "whole"
    assert_ok(run_ranks("train_moco.py", args + ["--out", str(whole), "--shard-cache-dir", str(whole / "cache")],
                        tmp_path, env=s3_server))
    out, log, cache_dir = tmp_path / "run", tmp_path / "job.log", tmp_path / "cache"
    proxy.set(latency_s=0.05)  # downloads spread over the steps: the cut meets those still to come
    with contextlib.ExitStack() as stack:
        stack.callback(proxy.set, latency_s=None)
        stack.callback(proxy.end_cut)
        job, job_id = stack.enter_context(running_job(
            slurm, "slurm_moco.sbatch", TWO_NODES,
            args + ["--out", str(out), "--shard-cache-dir", str(cache_dir), "--keep-shard-cache"], log,
            NPROC_PER_NODE="1", MAX_RESTARTS="0", AWS_ENDPOINT_URL=env["AWS_ENDPOINT_URL"]))
        _wait_for(log, r"step 3/36", timeout=180)
        proxy.cut(600)
        _wait_for(log, rf"requeueing job {job_id}", timeout=180)
        caches = sorted(cache_dir.iterdir())  # the job's: a folder per node, kept (--keep-shard-cache)
        assert [cache.name.rsplit("-", 1)[1] for cache in caches] == ["node0", "node1"]
        left_behind = [cache / "shard-000000.tar.part-1-1-100" for cache in caches]  # as by a kill mid-download
        for path in left_behind:
            path.write_bytes(b"partial")
        proxy.end_cut()
        _wait_for(log, r"\(restart 1\)[\s\S]*step (1[4-9]|2\d|3[0-4])/36", timeout=180)
        signal = slurm.run("scancel", "--signal=USR1", job_id)
        assert signal.returncode == 0, signal.stderr
        job.wait(timeout=400)
    text = log.read_text()
    assert job.returncode == 0, job.stderr.read() + text
    cut = int(_wait_for_text(text, r"ERROR step (\d+) \(not taken\): s3://ddp-test/one-per-shard/train/shard-\d+\.tar: "
                                   r"the object store did not answer").group(1))
    assert f"[job] training stopped because the object store did not answer ({out}/STORE_UNAVAILABLE); " \
           f"requeueing job {job_id}" in text, text
    preempted = int(_wait_for_text(text, r"preempted \(SIGUSR1\): checkpoint written at step (\d+)").group(1))
    assert re.search(r"\(restart 2\) on 2 node\(s\)", text)
    resumed = [int(step) for step in re.findall(r"resumed from .*: step (\d+)", text)]
    assert resumed == [cut - 1, preempted] and 3 < cut < preempted < 36  # each from its stop's checkpoint
    assert "encoders, queue and pointer identical on all 2 ranks" in text
    assert not (out / "PREEMPTED").exists() and not (out / "STORE_UNAVAILABLE").exists()
    assert [s for s, _ in read_scalars(out / "tb")["train/loss"]] == list(range(1, 37))
    assert_same_moco(load_ckpt(out / "checkpoint_last.pt"), load_ckpt(whole / "checkpoint_last.pt"), steps=36)
    assert not any(path.exists() for path in left_behind)  # the requeued attempt started with empty caches
    assert all((cache / "downloads.txt").exists() for cache in caches)


@pytest.mark.slow
@pytest.mark.slurm
def test_a_lost_node_stops_the_survivor_and_the_requeued_job_ends_as_if_never_stopped(slurm, two_node_moco, tmp_path):
    """The node without the batch script dies mid-run (its slurmd, its torchrun agent and worker,
    SIGKILL): the surviving rank stops at once, well within --dist-timeout; SLURM declares the node
    down (SlurmdTimeout) and requeues the job (--requeue), which waits for the node to come back,
    resumes from the last checkpoint and ends bit for bit as the uninterrupted job."""
    out, log = tmp_path / "run", tmp_path / "job.log"
    with running_job(slurm, "slurm_moco.sbatch", TWO_NODES,
                     MOCO_JOB + ["--ckpt-every", "10", "--dist-timeout", "30", "--out", str(out)], log,
                     NPROC_PER_NODE="1") as (job, job_id):
        _wait_for(log, r"step (2[0-9])/60", timeout=180)
        batch_host = re.search(r"BatchHost=(\S+)", slurm.run("scontrol", "show", "job", job_id).stdout).group(1)
        lost = next(node for node in slurm.nodes if node != batch_host)
        # The head node's agent alone holds the rendezvous store (slurm_job.sh: is_host), so losing the
        # other node leaves the store to the survivor, which waits there for the node to come back.
        processes = slurm.job_processes(job_id)
        said = {(env["SLURMD_NODENAME"], env["PET_RDZV_CONF"]) for env in processes.values() if "PET_RDZV_CONF" in env}
        assert said == {(batch_host, "is_host=1"), (lost, "is_host=0")}, said
        listening = subprocess.run(["ss", "-Hltnp", f"sport = :{15000 + int(job_id) % 15000}"], capture_output=True,
                                   text=True).stdout
        assert {processes[int(pid)]["SLURMD_NODENAME"] for pid in re.findall(r"pid=(\d+)", listening)} == {batch_host}
        slurm.lose_node(lost, job_id)
        lost_at = time.time()
        _wait_for(log, r"rank \d stops: lost contact with another rank", timeout=30)  # --dist-timeout
        assert time.time() - lost_at < 30
        # the controller's pings decide (11-29 s on a quiet machine); a suite loading both cores took longer
        _wait_for(log, rf"JOB {job_id} ON \S+ CANCELLED AT \S+ DUE TO NODE FAILURE", timeout=300)
        saved = load_ckpt(out / "checkpoint_last.pt")  # intact: it loads, and is a whole number of saves
        assert saved["step"] % 10 == 0 and 10 <= saved["step"] < 60
        slurm.start_node(lost)  # the node comes back; the requeued job runs again on both nodes
        job.wait(timeout=400)
    text = log.read_text()
    assert job.returncode == 0, job.stderr.read() + text
    assert re.search(r"\(restart 1\) on 2 node\(s\)", text)
    resumed = int(_wait_for_text(text, r"resumed from .*: step (\d+)").group(1))
    assert resumed == saved["step"]
    assert_same_moco(load_ckpt(out / "checkpoint_last.pt"), load_ckpt(two_node_moco[0] / "checkpoint_last.pt"))
    assert [s for s, _ in read_scalars(out / "tb")["train/loss"]] == list(range(1, 61))  # the lost steps once


def assert_same_moco(a: dict, b: dict, steps: int = 60) -> None:
    assert a["step"] == b["step"] == steps
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():  # both encoders, the queue and its pointer
        assert torch.equal(tensor, b["model"][name]), name
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"]), key


@pytest.mark.slow
@pytest.mark.slurm
def test_stale_marker_does_not_requeue_a_failing_job(slurm, tmp_path):
    """A PREEMPTED file left by an earlier attempt must not requeue a job that fails at start."""
    out, log = tmp_path / "run", tmp_path / "job.log"
    out.mkdir()
    (out / "PREEMPTED").write_text("step 3\n")
    proc = submit(slurm, "slurm_classifier.sbatch", ["--cpus-per-task=2", "--time=5"],
                  DIGITS_CPU + ["--batch-size", "0", "--out", str(out)], log, MAX_RESTARTS="1")
    text = log.read_text()
    assert proc.returncode == 2, text
    # the job's --check stops it before srun: one line, no worker started, nothing to restart
    assert text.count("--batch-size must be positive") == 1 and "+ srun" not in text, text
    assert "requeueing" not in text and "(restart 1)" not in text
    assert not (out / "PREEMPTED").exists()


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_of_a_copy_outside_the_repository_says_how_to_submit(slurm, tmp_path):
    copy = tmp_path / "my_moco.sbatch"
    copy.write_text((REPO / "launch/slurm_moco.sbatch").read_text())
    log = tmp_path / "job.log"
    proc = submit(slurm, copy, ["--cpus-per-task=1", "--time=2"], ["--out", "run"], log, cwd=tmp_path)
    text = log.read_text()
    assert proc.returncode == 2, text
    assert text.strip() == ("cannot find the repository: submit with its path (sbatch "
                            "/path/to/repo/launch/slurm_moco.sbatch ...) or set REPO_DIR")
    assert not (tmp_path / "run").exists()
