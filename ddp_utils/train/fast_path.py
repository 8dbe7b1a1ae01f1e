"""The GPU fast path: what a CUDA run turns on so that a step costs the model's arithmetic.

* bf16 autocast by default (``--amp auto``; ``--amp none`` for fp32, ``fp16`` with a scaler);
* TF32 for fp32 matmuls and convolutions, ``cudnn.benchmark`` (input shapes are fixed: every
  training batch has ``--batch-size`` samples, ``drop_last``);
* ``channels_last`` for the conv nets' weights and inputs (tensor cores want NHWC);
* fused SGD (one kernel for all parameters instead of several per tensor);
* ``torch.compile`` with ``--compile`` (off by default: minutes of compilation at start).

On the CPU only the choices that change nothing numerically apply (foreach SGD, contiguous
tensors), so the CPU tests exercise the same code paths.
"""
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
    """Fused SGD on CUDA; the multi-tensor (foreach) implementation elsewhere. Same update rule,
    same state dict: a checkpoint moves between them."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **fast)


def maybe_compile(module: nn.Module, enabled: bool) -> nn.Module:
    """``torch.compile(module)`` when asked. The compiled wrapper forwards attribute access to the
    module (DDP's ``no_sync`` included); checkpoints keep saving the uncompiled module."""
    return torch.compile(module) if enabled else module
