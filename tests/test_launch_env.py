"""init_distributed for torchrun, srun and a plain process, and the rank helpers without a group."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import REPO, cli_env, free_port

from ddp_utils.config import UsageError
from ddp_utils.runtime import dist as ddp_dist
from ddp_utils.runtime.device import cuda_index, select_device, shared_gpu_problem
from ddp_utils.runtime.dist import init_distributed
from ddp_utils.runtime.launch import LaunchEnv, detect_launch, first_slurm_host, tasks_on_this_node

LAUNCH_VARS = ("CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_JOB_ID",
               "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NODEID", "SLURM_TASKS_PER_NODE",
               "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "GROUP_RANK", "SLURMD_NODENAME")


@pytest.fixture
def clean_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_plain_process_is_world_size_one_without_a_group(clean_env):
    info = init_distributed("cpu")
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (0, 0, 1, 1)
    assert info.launcher == "single" and info.backend is None and info.is_main
    assert info.device == torch.device("cpu")
    assert not torch.distributed.is_initialized()
    assert ddp_dist.get_rank() == 0 and ddp_dist.get_world_size() == 1 and ddp_dist.is_main_process()
    ddp_dist.barrier()  # a no-op, not an error, without a process group
    with pytest.raises(Exception):
        info.rank = 3  # frozen


def test_torchrun_environment(clean_env):
    clean_env.setenv("RANK", "5")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    clean_env.setenv("MASTER_ADDR", "10.1.2.3")
    clean_env.setenv("MASTER_PORT", "4321")
    clean_env.setenv("GROUP_RANK", "1")
    launch = detect_launch()
    assert launch == LaunchEnv("torchrun", 5, 1, 8, 4, "10.1.2.3", 4321, node="1")


def test_torchrun_with_one_process_initialises_nothing(clean_env):
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        clean_env.setenv(name, value)
    info = init_distributed("cpu")
    assert info.launcher == "torchrun" and info.world_size == 1 and info.backend is None


def test_srun_environment(clean_env):
    for name, value in dict(SLURM_PROCID="6", SLURM_LOCALID="2", SLURM_NTASKS="8",
                            SLURM_STEP_NUM_TASKS="8", SLURM_JOB_ID="123456",
                            SLURM_JOB_NODELIST="gpu[07-08]", SLURM_NODEID="1",
                            SLURM_STEP_TASKS_PER_NODE="4(x2)").items():
        clean_env.setenv(name, value)
    launch = detect_launch()
    assert launch.launcher == "slurm"
    assert (launch.rank, launch.local_rank, launch.world_size, launch.local_world_size) == (6, 2, 8, 4)
    assert launch.master_addr == "gpu07"
    # Port derived from the job id: stable for every task of the job, different across jobs.
    assert launch.master_port == 15000 + 123456 % 15000
    clean_env.setenv("SLURM_JOB_ID", "123457")
    assert detect_launch().master_port == launch.master_port + 1


def test_sbatch_shell_without_srun_stays_single(clean_env):
    """A batch script has SLURM_NTASKS=8 but runs once: treating it as rank 0 of 8 would hang."""
    for name, value in dict(SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_JOB_ID="1",
                            SLURM_JOB_NODELIST="n1").items():
        clean_env.setenv(name, value)
    assert detect_launch().launcher == "single"


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("gpu[03-05,9]", "gpu03"), ("a[1,4],b7", "a1"), ("x-y[010-012]", "x-y010"),
    ("n12,n13", "n12"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_uneven_tasks_per_node(clean_env):
    env = {"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}
    assert tasks_on_this_node(env) == 3


def test_device_cuda_requested_without_cuda_fails_clearly():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UsageError, match="--device cpu"):
        select_device("cuda", LaunchEnv("single", 0, 0, 1, 1))


_WORKER = textwrap.dedent("""
    import torch, torch.distributed as dist
    from ddp_utils.runtime.dist import cleanup_distributed, init_distributed
    info = init_distributed("cpu", timeout_s=60)
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    print(f"RESULT {info.launcher} {info.rank} {info.local_rank} {info.world_size} {info.backend} {t.item()}")
    cleanup_distributed()
""")


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_two_real_processes_form_a_group(launcher):
    """Two processes started with the launcher's variables (no launcher) really all_reduce."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        if launcher == "torchrun":
            extra = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        else:
            extra = dict(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                         SLURM_STEP_NUM_TASKS="2", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="localhost",
                         SLURM_STEP_TASKS_PER_NODE="2", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER], cwd=REPO, env=cli_env(extra),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, err
        assert f"RESULT {launcher} {rank} {rank} 2 gloo 3.0" in out


_DEAD_PEER = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from ddp_utils.train.session import RunSession
    from train_classifier import ClassifierConfig
    cfg = ClassifierConfig(device="cpu", dist_timeout=float(sys.argv[1]), out=sys.argv[2])
    with RunSession(cfg) as session:  # what the training scripts run inside
        if session.info.rank == 1:
            os._exit(0)  # dies without a word, like a crashed node
        start = time.time()
        try:
            dist.all_reduce(torch.ones(1))
            print("NO ERROR")
        except Exception:  # gloo: connection reset/closed, or the timeout
            print(f"FAILED after {time.time() - start:.1f}s", flush=True)
            raise
""")


@pytest.mark.slow
@pytest.mark.torch_versions  # how gloo and the process group fail, and a process exits, when a peer dies
def test_dead_peer_ends_the_job_instead_of_hanging(tmp_path):
    """Rank 1 vanishes; rank 0's collective fails and it leaves with exit code 1 and one line.
    Leaving with sys.exit while the group was alive aborted the process (exit -6) in about one
    run of six; the test repeats the scenario to catch that."""
    for _ in range(3):
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, "-c", _DEAD_PEER, "20", str(tmp_path)], cwd=REPO,
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=cli_env(dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)))
                 for r in range(2)]
        out, err = procs[0].communicate(timeout=120)  # well past the 20 s collective timeout: no hang
        procs[1].wait(timeout=30)
        assert procs[0].returncode == 1, out + err
        assert "FAILED after" in out
        assert out.count("lost contact with another rank") == 1 and "Traceback" not in out + err, out + err
        assert "terminate called" not in err


_OWN_ERROR = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from ddp_utils.train.session import RunSession
    from train_classifier import ClassifierConfig
    cfg = ClassifierConfig(device="cpu", dist_timeout=20.0, out=sys.argv[1])
    # NCCL's words, held apart from the raise: Python 3.13 shows a -c script's failing line in
    # the traceback, and the test counts the message itself
    words = ("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5: "
             "Cuda failure 'out of memory'")
    with RunSession(cfg) as session:
        if session.info.rank == 1:  # this rank's own failure
            raise RuntimeError(words)
        dist.all_reduce(torch.ones(1))
""")


def test_a_ranks_own_error_is_its_traceback_once_and_one_line_on_the_others(tmp_path):
    """A rank's own error keeps its traceback, whatever words it uses (here NCCL's); the rank that
    only lost its peer says so in one line. Both leave with exit code 1."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _OWN_ERROR, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=cli_env(dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port)))
             for r in range(2)]
    survivor, failing = (p.communicate(timeout=120)[0] for p in procs)
    assert [p.returncode for p in procs] == [1, 1], (survivor, failing)
    assert failing.count("Traceback") == 1 and failing.count("Cuda failure 'out of memory'") == 1, failing
    assert "rank 1 failed:" in failing and "lost contact" not in failing
    assert survivor.count("rank 0 stops: lost contact with another rank (") == 1, survivor
    assert "Traceback" not in survivor


@pytest.mark.parametrize("text, lost", [
    # measured here with gloo: a peer that died, a peer that hangs past --dist-timeout
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
     "[127.0.0.1]:6064. This is typically caused by a remote worker crashing.", True),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:7578: "
     "Connection reset by peer.", True),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
     "3000ms for recv operation to complete", True),
    # NCCL's watchdog and abort after a peer failure
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 ms", True),
    ("NCCL error: remote process exited or there was a network error", True),
    # this rank's own bugs, in gloo's and NCCL's words
    ("ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (5), got (3))", False),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:464] op.preamble.length <= op.nbytes. "
     "8 vs 4. Received data size doesn't match expected size.", False),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error: Cuda failure 'out of memory'", False),
    ("DataLoader worker (pid 123) timed out after 30 seconds", False),
])
def test_peer_loss_is_told_from_a_ranks_own_error(text, lost):
    from ddp_utils.train.session import lost_a_peer

    assert lost_a_peer(RuntimeError(text)) is lost


# ----------------------------------------------------------------------------- GPU placement
@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend this process sees N GPUs; record which one set_device picked."""
    chosen = []

    def install(count: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen
    return install


def test_srun_with_one_bound_gpu_per_task_uses_cuda_0(clean_env, fake_gpus):
    """srun --gpus-per-task=1: task 3 sees one GPU (CUDA_VISIBLE_DEVICES=3) as cuda:0."""
    chosen = fake_gpus(1)
    for name, value in dict(SLURM_PROCID="3", SLURM_LOCALID="3", SLURM_STEP_NUM_TASKS="4", SLURM_JOB_ID="9",
                            SLURM_JOB_NODELIST="gpu01", SLURM_STEP_TASKS_PER_NODE="4",
                            CUDA_VISIBLE_DEVICES="3").items():
        clean_env.setenv(name, value)
    device, backend = select_device("auto", detect_launch())
    assert (device, backend, chosen) == (torch.device("cuda", 0), "nccl", [0])


@pytest.mark.parametrize("local_rank, local_world_size, visible, expected",
                         [(0, 4, 4, 0), (3, 4, 4, 3), (5, 8, 8, 5), (3, 4, 2, 1), (2, 4, 1, 0)])
def test_cuda_index_is_local_rank_mod_visible_under_slurm(local_rank, local_world_size, visible, expected):
    assert cuda_index(local_rank, local_world_size, visible, "slurm") == expected


def test_torchrun_with_more_workers_than_gpus_fails_in_one_line(clean_env, fake_gpus):
    fake_gpus(2)
    for name, value in dict(RANK="3", LOCAL_RANK="3", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4").items():
        clean_env.setenv(name, value)
    with pytest.raises(UsageError, match=r"4 processes on this node but only 2 visible GPU\(s\): start at most 2"):
        select_device("auto", detect_launch())


def test_no_visible_gpu_with_device_cuda_fails_in_one_line():
    with pytest.raises(UsageError, match="sees no CUDA device"):
        cuda_index(0, 1, 0, "single")


def test_two_ranks_on_one_gpu_are_found_after_the_group_forms():
    """srun without binding on a node with fewer GPUs than tasks: both see 'their' cuda:0."""
    assert shared_gpu_problem([("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a")]) is None
    problem = shared_gpu_problem([("n1", "GPU-a"), ("n1", "GPU-b"), ("n1", "GPU-a")])
    assert problem.startswith("ranks 0 and 2 share one GPU on n1") and "--gpus-per-task=1" in problem
    assert shared_gpu_problem([("n1", None), ("n1", None)]) is None  # CPU ranks
