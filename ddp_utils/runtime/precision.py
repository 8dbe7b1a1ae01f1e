"""The forward's autocast and fp16's loss scaler, from ``--amp {auto,none,bf16,fp16,torchvision}``
(auto: bf16 on a GPU that computes it natively, fp32 elsewhere; torchvision: its train.py's bare
``--amp``, fp16 on CUDA and fp32 elsewhere). Training and the kNN monitor's feature extraction
both take them."""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

AMP_MODES = ("auto", "none", "bf16", "fp16", "torchvision")


def resolve_amp(amp: str, device: torch.device) -> str:
    """``auto`` -> bf16 on a GPU with native bf16 (Ampere and later), fp32 ("none") elsewhere;
    ``torchvision`` -> fp16 on CUDA, fp32 elsewhere (its autocast is CUDA's, which leaves a CPU's
    operations in fp32)."""
    if amp == "torchvision":
        return "fp16" if device.type == "cuda" else "none"
    if amp != "auto":
        return amp
    return "bf16" if native_bf16(device) else "none"


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` is a GPU that computes bf16 natively. ``is_bf16_supported()`` alone also
    says yes where CUDA emulates it (a V100, a T4: no bf16 tensor cores), slower than fp32 there."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def precision_name(amp: str, device: torch.device) -> str:
    """What ``--amp`` trains in on ``device``, in words: "fp32", "bf16", "fp16", and why where
    the choice was made for this machine (``auto``, a bare ``--amp`` off CUDA)."""
    name = resolve_amp(amp, device).replace("none", "fp32")
    if amp == "torchvision" and device.type != "cuda":
        return name + " (bare --amp, torchvision's: fp16 with a GradScaler on CUDA)"
    if amp != "auto" or device.type != "cuda":
        return name
    if name == "bf16":
        return name + " (--amp auto: this GPU computes bf16 natively)"
    return name + (" (--amp auto: this GPU has no native bf16, at most an emulated one; --amp fp16 uses its fp16 "
                   "tensor cores)")


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
