"""Mixed precision: ``--amp {none,bf16,fp16}``."""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

AMP_MODES = ("none", "bf16", "fp16")


def autocast(amp: str, device: torch.device) -> ContextManager:
    """Autocast for the forward pass and loss only; backward runs outside it, as PyTorch advises."""
    if amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(amp: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
    if amp != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
