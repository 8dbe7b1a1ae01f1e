"""launch/: two torchrun "nodes" on one machine, and the sbatch scripts against a real SLURM
(the `slurm` fixture in conftest.py), including preemption by USR1 and requeue."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, cli_env, load_ckpt, read_scalars

from ddp_utils.runtime.spawn import free_port

DIGITS_CPU = ["--device", "cpu", "--dataset", "digits", "--log-every", "1"]


@pytest.mark.slow
def test_two_torchrun_nodes_train_together(tmp_path):
    """Two torchrun agents, one worker each, meet by c10d rendezvous on 127.0.0.1 like two nodes."""
    env = cli_env({"NNODES": "2", "NPROC": "1", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
                   "RDZV_ID": "test-two-nodes", "PYTHON": sys.executable})
    args = DIGITS_CPU + ["--arch", "lenet", "--batch-size", "16", "--max-steps", "5", "--out", str(tmp_path / "r")]
    nodes = [subprocess.Popen(["bash", str(REPO / "launch/torchrun_multinode.sh"), "train_classifier.py", *args],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert all("--nnodes=2" in out and "--rdzv-backend=c10d" in out for out in outputs)  # printed command
    main_log = next(out for out in outputs if "world size 2" in out)
    # init_distributed saw 2 ranks; the end-of-run check compared every weight across the nodes.
    assert "weights identical on all 2 ranks" in main_log
    assert load_ckpt(tmp_path / "r/checkpoint_last.pt")["step"] == 5


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


@pytest.mark.slow
@pytest.mark.slurm
def test_sbatch_moco_in_srun_mode(slurm, tmp_path):
    """One task per rank, no torchrun (torchrun mode: the preemption test below)."""
    out, log = tmp_path / "run", tmp_path / "job.log"
    proc = submit(slurm, "slurm_moco.sbatch", ["--ntasks-per-node=2", "--cpus-per-task=1", "--time=10"],
                  DIGITS_CPU + ["--image-size", "16", "--batch-size", "16", "--moco-k", "64", "--max-steps", "4",
                                "--knn-every", "0", "--out", str(out)], log, LAUNCH_MODE="srun")
    text = log.read_text()
    assert proc.returncode == 0, proc.stderr + text
    assert "slurm launch: world size 2" in text  # init_distributed's SLURM branch
    # the command it printed is the one it ran, --cpus-per-task included
    assert re.search(r"\[job\] \+ MASTER_ADDR=\S+ MASTER_PORT=\d+ srun --cpus-per-task=1 \S*python \S*/train_moco.py", text)
    assert "encoders, queue and pointer identical on all 2 ranks" in text
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == 4
    assert read_scalars(out / "tb")["train/loss"]


def _wait_for(path: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        match = re.search(pattern, path.read_text()) if path.exists() else None
        if match:
            return match
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} never appeared in {path}:\n{path.read_text() if path.exists() else ''}")


@pytest.mark.slow
@pytest.mark.slurm
def test_preempted_moco_job_checkpoints_requeues_and_resumes(slurm, tmp_path):
    out, log = tmp_path / "run", tmp_path / "job.log"
    max_steps = 120  # about 3 epochs: the signal lands with ~100 steps to go, never after the end
    job = submit(slurm, "slurm_moco.sbatch", ["--cpus-per-task=2", "--time=10"],
                 DIGITS_CPU + ["--image-size", "16", "--batch-size", "16", "--moco-k", "64", "--epochs", "5",
                               "--max-steps", str(max_steps), "--knn-every", "0", "--out", str(out)],
                 log, wait=False)
    job_id = job.stdout.readline().strip()  # --parsable: the job id, printed at submission
    assert job_id.isdigit(), job.stderr.read() if job.poll() is not None else job_id
    _wait_for(log, rf"step (1[0-9])/{max_steps}", timeout=180)  # mid-run
    signal = slurm.run("scancel", "--signal=USR1", job_id)
    assert signal.returncode == 0, signal.stderr
    job.wait(timeout=400)
    text = log.read_text()
    assert job.returncode == 0, job.stderr.read() + text
    stopped = int(_wait_for(log, r"preempted \(SIGUSR1\): checkpoint written at step (\d+)", 1).group(1))
    assert 10 <= stopped < max_steps
    assert f"requeueing job {job_id}" in text
    assert "(restart 1)" in text and "torchrun launch: world size 2" in text
    assert "encoders, queue and pointer identical on all 2 ranks" in text
    resumed = int(_wait_for(log, r"resumed from .*: step (\d+)", 1).group(1))
    assert resumed == stopped  # from the preemption checkpoint, not from zero
    final = load_ckpt(out / "checkpoint_last.pt")
    assert final["step"] == max_steps
    assert not (out / "PREEMPTED").exists()
    steps = [s for s, _ in read_scalars(out / "tb")["train/loss"]]
    assert steps[-1] == max_steps and stopped + 1 in steps


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
