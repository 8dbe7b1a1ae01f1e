"""bench/gpu_check.sh's pre-flight: can this machine run the check at all?

    python bench/gpu_preflight.py          # needs a usable CUDA GPU
    python bench/gpu_preflight.py --cpu    # imports only (gpu_check.sh --cpu-smoke)

Imports what the check runs (torch, torchvision with its compiled ops, tensorboard, numpy) and
asks torch for the GPU. Prints one line: what it found (exit 0), or what is missing and what to
do (exit 2). Only the standard library is imported before torch, so that a missing torch is
reported too.
"""
from __future__ import annotations

import importlib
import shutil
import subprocess
import sys


def fail(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr)
    sys.exit(2)


def nvidia_smi(query: str) -> str | None:
    """First GPU's ``--query-gpu`` fields, or None without a working nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def imports() -> str:
    found = []
    for name, fix in (("torch", "install PyTorch"), ("torchvision", "install the torchvision that pairs with torch"),
                      ("numpy", "install numpy"), ("tensorboard", "pip install tensorboard")):
        try:
            module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure is reported the same way
            fail(f"{sys.executable} cannot import {name} ({type(err).__name__}: {str(err).splitlines()[0]}); {fix}, "
                 "or set PYTHON=/path/to/python")
        found.append(f"{name} {getattr(module, '__version__', '?')}")
    try:  # torchvision's compiled ops fail to load next to a torch it was not built for
        from torchvision.ops import roi_align  # noqa: F401
        importlib.import_module("torch.utils.tensorboard")
    except Exception as err:  # noqa: BLE001
        fail(f"{type(err).__name__}: {str(err).splitlines()[0]}; torch and torchvision must be a matching pair")
    return ", ".join(found)


def gpu(torch) -> str:
    built_for = torch.version.cuda
    if built_for is None:
        fail(f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch")
    if not torch.cuda.is_available():
        driver = nvidia_smi("driver_version")
        if driver is None:
            fail("no usable NVIDIA GPU (torch.cuda.is_available() is False, nvidia-smi absent or failing); this "
                 "check needs one (--cpu-smoke runs its commands on the CPU)")
        fail(f"torch {torch.__version__} (built for CUDA {built_for}) cannot use the GPU with NVIDIA driver {driver}: "
             f"install a driver that supports CUDA {built_for}, or a torch build for the driver's CUDA version; "
             "--device auto would silently train on the CPU")
    props = torch.cuda.get_device_properties(0)
    driver = nvidia_smi("driver_version") or "?"
    bf16 = "bf16" if torch.cuda.is_bf16_supported() else "no bf16"
    return (f"{torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB, {bf16}), "
            f"{torch.cuda.device_count()} visible, driver {driver}, CUDA {built_for}")


def main() -> None:
    cpu_only = sys.argv[1:] == ["--cpu"]
    if sys.argv[1:] not in ([], ["--cpu"]):
        fail("usage: python bench/gpu_preflight.py [--cpu]")
    found = imports()
    import torch

    where = "CPU smoke test" if cpu_only else gpu(torch)
    print(f"python {sys.version.split()[0]}, {found}; {where}")


if __name__ == "__main__":
    main()
