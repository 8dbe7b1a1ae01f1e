"""The GPU fast path: TF32 and cuDNN's autotuner (every training batch has the same shape),
channels_last weights and inputs, fused SGD, and ``torch.compile`` with --compile. On the CPU
only what changes nothing numerically applies (foreach SGD), through the same code."""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch import nn

from ..runtime.dist import memory_format


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


def sgd(params, lr: float, momentum: float, weight_decay: float, device: torch.device) -> torch.optim.SGD:
    """Fused SGD on CUDA, the multi-tensor (foreach) one elsewhere: the same update rule."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **fast)


def maybe_compile(module: nn.Module, enabled: bool) -> nn.Module:
    """``torch.compile(module)`` when asked (the wrapper forwards attributes: DDP's ``no_sync``)."""
    return torch.compile(module) if enabled else module
