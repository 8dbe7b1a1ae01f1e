"""The GPU fast path: TF32 and cuDNN's autotuner (every training batch has the same shape),
channels_last weights and inputs, fused SGD, and ``torch.compile`` with --compile. On the CPU
only what changes nothing numerically applies (foreach SGD), through the same code."""
from __future__ import annotations

import torch
from torch import nn


def configure_backends(device: torch.device) -> None:
    """Process-wide switches for CUDA: TF32 and cuDNN's autotuner."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True


def memory_format(device: torch.device) -> torch.memory_format:
    """NHWC on CUDA (faster convolutions with tensor cores), NCHW on the CPU."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def to_device(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on the training device in its memory format; asynchronous from pinned memory."""
    return images.to(device, non_blocking=True, memory_format=memory_format(device))


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    return model.to(device=device, memory_format=memory_format(device))


def sgd(params, lr: float, momentum: float, weight_decay: float, device: torch.device) -> torch.optim.SGD:
    """Fused SGD on CUDA, the multi-tensor (foreach) one elsewhere: the same update rule."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **fast)


def maybe_compile(module: nn.Module, enabled: bool) -> nn.Module:
    """``torch.compile(module)`` when asked (the wrapper forwards attributes: DDP's ``no_sync``)."""
    return torch.compile(module) if enabled else module
