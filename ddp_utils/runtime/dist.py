"""Process-group set-up for the three ways this project is launched.

1. ``torchrun``: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set by the agent.
2. ``srun`` with one task per GPU and no torchrun: SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS give
   the ranks; the master is the first host of the allocation and the port is derived from the job id,
   so two jobs sharing a node do not collide.
3. ``python script.py``: one process, no process group at all.

Every helper here also works when no process group exists, so the same training code runs
unchanged in a debugger.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from ..config import UsageError

# Ports derived from a SLURM job id fall in [_PORT_BASE, _PORT_BASE + _PORT_SPAN): above the
# well-known and registered ranges most services use, below Linux's default ephemeral range.
_PORT_BASE = 15000
_PORT_SPAN = 15000


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process, read from the environment (no side effects)."""

    launcher: str  # "torchrun", "slurm" or "single"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None


@dataclass(frozen=True)
class DistInfo:
    """The distributed context of this process, returned by :func:`init_distributed`."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None when running as one process without a process group
    launcher: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def first_slurm_host(nodelist: str) -> str:
    """First host name of a SLURM compressed host list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``.

    Same answer as the first line of ``scontrol show hostnames``, without needing scontrol.
    """
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first  # the range keeps its zero padding, e.g. "03"


def tasks_on_this_node(env: Mapping[str, str]) -> int:
    """Tasks SLURM placed on this node, from e.g. SLURM_STEP_TASKS_PER_NODE="4(x2),3"."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return int(env.get("SLURM_NTASKS_PER_NODE", "1"))
    node_id = int(env.get("SLURM_NODEID", "0"))
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            raise ValueError(f"cannot parse SLURM tasks per node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[min(node_id, len(counts) - 1)]


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Work out how this process was launched from its environment variables."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also sets LOCAL_*; plain env:// too)
        world_size = int(env["WORLD_SIZE"])
        return LaunchEnv(
            launcher="torchrun",
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=world_size,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
        )
    # srun sets SLURM_STEP_NUM_TASKS for the job step; a batch script only has SLURM_NTASKS,
    # which counts tasks that do not exist yet, so a bare `python` in an sbatch script stays single.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        world_size = int(env["SLURM_STEP_NUM_TASKS"])
        if world_size > 1:
            nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
            job_id = int(env.get("SLURM_JOB_ID", "0"))
            return LaunchEnv(
                launcher="slurm",
                rank=int(env["SLURM_PROCID"]),
                local_rank=int(env.get("SLURM_LOCALID", "0")),
                world_size=world_size,
                local_world_size=tasks_on_this_node(env),
                master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
                master_port=int(env.get("MASTER_PORT") or _PORT_BASE + job_id % _PORT_SPAN),
            )
    return LaunchEnv(launcher="single", rank=0, local_rank=0, world_size=1, local_world_size=1)


def node_name() -> str:
    """The node this process runs on: SLURM's name for it inside a job (two slurmd on one machine
    are two nodes of one host name), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times this job was restarted: by torchrun (--max-restarts) or by a SLURM requeue."""
    env = os.environ if env is None else env
    return int(env.get("TORCHELASTIC_RESTART_COUNT") or 0) + int(env.get("SLURM_RESTART_COUNT") or 0)


def cuda_index(local_rank: int, local_world_size: int, visible: int, launcher: str) -> int:
    """The GPU of this process: ``cuda:(local_rank mod visible)``.

    torchrun starts every worker of a node with the same visible GPUs, so more workers than GPUs
    means sharing one, which NCCL refuses: fail with one line instead. Under ``srun
    --gpus-per-task=1`` (or ``--gpu-bind``) each task sees only its own GPU, as ``cuda:0``, while
    SLURM_LOCALID counts 0..n-1; the modulo maps it there. Whether srun tasks really got
    different GPUs is checked after the process group exists (:func:`shared_gpu_problem`).
    """
    if visible == 0:
        raise UsageError("--device cuda: this process sees no CUDA device "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                         "use --device cpu")
    if local_world_size > visible and launcher != "slurm":
        raise UsageError(f"{local_world_size} processes on this node but only {visible} visible GPU(s): "
                         f"start at most {visible} per node (--nproc-per-node={visible}) or use --device cpu")
    return local_rank % visible


def shared_gpu_problem(gpus: list[tuple[str, str | None]]) -> str | None:
    """One line if two ranks run on the same GPU; ``gpus[rank]`` is (host name, GPU UUID)."""
    owner: dict[tuple[str, str], int] = {}
    for rank, (host, uuid) in enumerate(gpus):
        if uuid is None:
            continue
        if (host, uuid) in owner:
            return (f"ranks {owner[host, uuid]} and {rank} share one GPU on {host}: this node has more "
                    f"ranks than GPUs; give each task its own (srun --gpus-per-task=1) or start fewer")
        owner[host, uuid] = rank
    return None


def visible_cuda_devices() -> int:
    """The CUDA devices this process sees (0 without CUDA): the machine fact the device checks take."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(requested: str, launch: LaunchEnv, cuda_devices: int | None = None) -> None:
    """Raise :class:`UsageError` (one line) if ``--device`` cannot work with ``cuda_devices``
    visible devices (None: ask this machine)."""
    cuda_devices = visible_cuda_devices() if cuda_devices is None else cuda_devices
    if requested not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {requested}: choose auto, cpu or cuda")
    if requested == "cuda" and not cuda_devices:
        raise UsageError("--device cuda: CUDA is not available on this machine; use --device cpu (or auto)")
    if requested != "cpu" and cuda_devices:
        cuda_index(launch.local_rank, launch.local_world_size, cuda_devices, launch.launcher)


def device_type(requested: str, cuda_devices: int | None = None) -> str:
    """"cuda" or "cpu": what ``--device`` resolves to with ``cuda_devices`` visible devices
    (None: ask this machine)."""
    cuda_devices = visible_cuda_devices() if cuda_devices is None else cuda_devices
    return "cuda" if requested != "cpu" and cuda_devices else "cpu"


def select_device(requested: str, launch: LaunchEnv) -> tuple[torch.device, str]:
    """Pick the device and the matching backend: CUDA + NCCL where possible, else CPU + gloo."""
    check_device(requested, launch)
    if device_type(requested) == "cuda":
        index = cuda_index(launch.local_rank, launch.local_world_size, torch.cuda.device_count(),
                           launch.launcher)
        torch.cuda.set_device(index)
        return torch.device("cuda", index), "nccl"
    return torch.device("cpu"), "gloo"


def init_distributed(device: str = "auto", timeout_s: float = 600.0,
                     env: Mapping[str, str] | None = None) -> DistInfo:
    """Initialise the process group for torchrun, srun or a single process.

    ``timeout_s`` bounds every collective: a peer that died makes the others fail after this many
    seconds instead of hanging the job until its wall-clock limit. A device that cannot work
    raises :class:`UsageError` before any rendezvous (see :func:`check_device`).
    """
    launch = detect_launch(env)
    torch_device, backend = select_device(device, launch)
    if launch.world_size == 1:
        return DistInfo(0, 0, 1, 1, torch_device, None, launch.launcher)
    if not dist.is_initialized():
        if launch.launcher == "torchrun":
            init_method = "env://"  # torchrun may hand over a TCPStore; env:// reuses it
        else:
            init_method = f"tcp://{_bracket_ipv6(launch.master_addr)}:{launch.master_port}"
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch_device if backend == "nccl" else None,
        )
    return DistInfo(launch.rank, launch.local_rank, launch.world_size,
                    launch.local_world_size, torch_device, backend, launch.launcher)


def gpu_identity(device: torch.device) -> tuple[str, str | None]:
    """(host name, GPU UUID) of this process, for :func:`shared_gpu_problem`."""
    if device.type != "cuda":
        return socket.gethostname(), None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return socket.gethostname(), None if uuid is None else str(uuid)


def _bracket_ipv6(host: str | None) -> str:
    if host is None:
        raise RuntimeError("no master address: set MASTER_ADDR or launch with torchrun/srun")
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def memory_format(device: torch.device) -> torch.memory_format:
    """NHWC on CUDA (faster convolutions with tensor cores), NCHW on the CPU."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def to_device(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on the training device in its memory format; asynchronous from pinned memory
    (and a no-op for a batch already there)."""
    return images.to(device, non_blocking=True, memory_format=memory_format(device))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module under DistributedDataParallel and torch.compile (what checkpoints store)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's wrapper
            model = model._orig_mod
        else:
            return model


def cleanup_distributed() -> None:
    """Leave the process group together. Call it once no DistributedDataParallel model is
    referenced any more.

    Why no model: a DDP model's reducer holds the group too, and when it is the group's last
    holder it destroys the group while holding the GIL; gloo's destructor then joins its worker
    threads, one of which may be waiting for the GIL to free a finished collective's tensors: a
    rank that never exits (pytorch/pytorch#56297). Released here first (``gc.collect()`` frees
    a model caught in a reference cycle), the group's last holders are its Python handles, which
    let go of the GIL while it is destroyed.

    Why a barrier: a gloo rank that closes its connections while a peer is still tearing its own
    down can abort that peer ("terminate called without an active exception", exit -6); the
    ranks first meet in a barrier, bounded so that a peer already gone delays the exit by 30 s
    at most."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        if dist.get_backend() == "gloo":
            with contextlib.suppress(RuntimeError):  # a missing peer: leave anyway
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        dist.destroy_process_group()


# Rank helpers: valid before, after and without init_process_group.
def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_dist():
        dist.barrier()
