"""The device of this process: which GPU a rank takes (one-line errors where none can work), the
backend that goes with it, whether two ranks share a GPU, and the memory format a batch and the
model take on the device (:func:`to_device`, :func:`place_model`)."""
from __future__ import annotations

import os
import socket

import torch
from torch import nn

from ..config import UsageError
from .launch import LaunchEnv


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


def gpu_identity(device: torch.device) -> tuple[str, str | None]:
    """(host name, GPU UUID) of this process, for :func:`shared_gpu_problem`."""
    if device.type != "cuda":
        return socket.gethostname(), None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return socket.gethostname(), None if uuid is None else str(uuid)


def memory_format(device: torch.device) -> torch.memory_format:
    """NHWC on CUDA (faster convolutions with tensor cores), NCHW on the CPU."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def to_device(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on the training device in its memory format; asynchronous from pinned memory
    (and a no-op for a batch already there)."""
    return images.to(device, non_blocking=True, memory_format=memory_format(device))


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` on ``device``, in the memory format its convolutions run fastest in there."""
    return model.to(device=device, memory_format=memory_format(device))
