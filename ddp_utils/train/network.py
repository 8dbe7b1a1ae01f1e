"""The network on its device: placed (channels_last on CUDA), wrapped in DDP, compiled with
--compile; and the process-wide switches of the GPU fast path (TF32, cuDNN's autotuner). On the
CPU only what changes nothing numerically applies, through the same code."""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..runtime.device import memory_format
from ..runtime.dist import DistInfo


def configure_backends(device: torch.device, tf32: bool = True, deterministic: bool = False) -> Callable[[], None]:
    """Process-wide switches: on CUDA TF32 and cuDNN's autotuner (every training batch has the
    same shape), unless ``deterministic``, which also makes PyTorch use (or demand) deterministic
    kernels on every device. Returns a function that puts the previous switches back."""
    cuda, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (torch.are_deterministic_algorithms_enabled(), cuda.allow_tf32, cudnn.allow_tf32, cudnn.benchmark,
              cudnn.deterministic)

    def restore() -> None:
        torch.use_deterministic_algorithms(before[0])
        cuda.allow_tf32, cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic = before[1:]

    if deterministic:
        # cuBLAS repeats its results only with a fixed workspace; read when its handle is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        cuda.allow_tf32 = cudnn.allow_tf32 = tf32 and not deterministic
        cudnn.benchmark = not deterministic
        cudnn.deterministic = deterministic
    return restore


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    return model.to(device=device, memory_format=memory_format(device))


def maybe_compile(module: nn.Module, enabled: bool) -> nn.Module:
    """``torch.compile(module)`` when asked (the wrapper forwards attributes: DDP's ``no_sync``)."""
    return torch.compile(module) if enabled else module


def wrap_network(module: nn.Module, info: DistInfo, compile: bool) -> nn.Module:
    """DDP around ``module`` when distributed, then torch.compile when asked. Every rank must
    call it (DDP broadcasts rank 0's weights). Gradients live in DDP's all-reduce buckets
    (``gradient_as_bucket_view``): one copy of them fewer."""
    if info.is_distributed:
        module = DDP(module, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                     gradient_as_bucket_view=True)
    return maybe_compile(module, compile)
