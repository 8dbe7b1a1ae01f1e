"""The forward's autocast and fp16's loss scaler, from ``--amp {auto,none,bf16,fp16,torchvision}``
(auto: bf16 on CUDA, fp32 elsewhere; torchvision: its train.py's bare ``--amp``, fp16 on CUDA and
fp32 elsewhere). Training and the kNN monitor's feature extraction both take them."""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

AMP_MODES = ("auto", "none", "bf16", "fp16", "torchvision")


def resolve_amp(amp: str, device: torch.device) -> str:
    """``auto`` -> bf16 on CUDA (when the GPU supports it), fp32 ("none") elsewhere;
    ``torchvision`` -> fp16 on CUDA, fp32 elsewhere (its autocast is CUDA's, which leaves a CPU's
    operations in fp32)."""
    if amp == "torchvision":
        return "fp16" if device.type == "cuda" else "none"
    if amp != "auto":
        return amp
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "none"


def precision_name(amp: str, device: torch.device) -> str:
    """What ``--amp`` trains in on ``device``, in words: "fp32", "bf16", "fp16"; a bare ``--amp``
    adds what it is on CUDA where this device is not."""
    name = resolve_amp(amp, device).replace("none", "fp32")
    return name + (" (bare --amp, torchvision's: fp16 with a GradScaler on CUDA)"
                   if amp == "torchvision" and device.type != "cuda" else "")


def autocast(amp: str, device: torch.device) -> ContextManager:
    """Autocast for the forward pass and loss only; backward runs outside it, as PyTorch advises."""
    amp = resolve_amp(amp, device)
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling for fp16, whose small gradients underflow; bf16 has fp32's range. Disabled
    (``scale()`` returns its input, ``unscale_`` and ``update`` do nothing) for anything else."""
    return torch.amp.GradScaler(device.type, enabled=resolve_amp(amp, device) == "fp16")
