"""bench/gpu_check.sh on a machine that cannot run it: one line naming what is missing, exit 2,
at once, nothing measured (the GPU run itself is the check's job, not the tests')."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import REPO, cli_env


def gpu_check(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], cwd="/",
                          env=cli_env({"PYTHON": python}), capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable GPU")
def test_without_a_gpu_the_check_stops_at_once_with_one_line():
    proc = gpu_check()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no usable NVIDIA GPU" in proc.stderr and "--cpu-smoke" in proc.stderr


def test_a_python_without_torch_is_named(tmp_path):
    bare = tmp_path / "python"  # this interpreter without site-packages: torch cannot import
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S -I "$@"\n')
    bare.chmod(0o755)
    proc = gpu_check(python=str(bare))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "cannot import torch" in proc.stderr and "PYTHON=" in proc.stderr
    missing = gpu_check(python=str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no python at PYTHON=" in missing.stderr


def test_a_wrong_argument_is_a_usage_error():
    proc = gpu_check("--cpu-smoek")
    assert proc.returncode == 2 and proc.stderr.strip() == "usage: bash bench/gpu_check.sh [--cpu-smoke]"
