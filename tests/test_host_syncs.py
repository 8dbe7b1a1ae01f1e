"""Host synchronisations per step, counted: on a GPU each one stalls the CPU until the device
has caught up, so the training loop may read the device at most once per optimizer step (the
ranks' stop/non-finite/overflow agreement) and never inside a window's other micro-steps.

On the CPU nothing really waits, so the test counts the calls that would wait on a GPU
(``Tensor.item``, ``tolist``, ``int()``, ``float()``, ``bool()``, ``.cpu()``, ``.numpy()``) made
by the training code (the scripts and ddp_utils, PyTorch's own functions included when they call
them), while the real training loop runs in this process.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import train_classifier
import train_moco

REPO = Path(__file__).resolve().parent.parent
SYNCING = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")


class SyncCounter:
    """Counts device reads whose call stack passes through the training code (not through the
    data-loading machinery, whose sampler works on CPU tensors by design)."""

    def __init__(self, monkeypatch):
        self.count = 0
        ours = (str(REPO / "ddp_utils"), str(REPO / "train_"))
        for name in SYNCING:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, __original=original, **kwargs):
                frame, from_us = sys._getframe(1), False
                while frame is not None:
                    path = frame.f_code.co_filename
                    if "torch/utils/data" in path:
                        break
                    from_us = from_us or path.startswith(ours)
                    frame = frame.f_back
                else:
                    self.count += from_us
                return __original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def syncs_per_micro_step(monkeypatch, main, args: list[str]) -> list[int]:
    """Run ``main(args)`` and return the syncs made between the end of one micro-step's backward
    and the end of the next one's (the scripts call ``backward()`` once per micro-step); the
    set-up before the first is left out. The optimizer step's agreement, made after the last
    backward of a window, falls into the interval that ends with the next window's first."""
    counter, marks = SyncCounter(monkeypatch), []
    backward = torch.Tensor.backward

    def marked(self, *args, **kwargs):
        result = backward(self, *args, **kwargs)
        marks.append(counter.count)
        return result

    monkeypatch.setattr(torch.Tensor, "backward", marked)
    assert main(args) == 0
    return [b - a for a, b in zip(marks, marks[1:])]


COMMON = ["--device", "cpu", "--dataset", "digits", "--arch", "small_cnn", "--image-size", "16", "--batch-size", "16",
          "--accum-steps", "3", "--max-steps", "4", "--log-every", "1000", "--epochs", "1"]


def test_classifier_reads_the_device_once_per_optimizer_step_with_fp16_and_clipping(monkeypatch, tmp_path):
    """fp16 (the scaler's overflow test) and clipping (the norm) add no read of their own: both
    travel in the step's one agreement."""
    syncs = syncs_per_micro_step(monkeypatch, train_classifier.main,  # lenet: fp16 convolutions are slow on a CPU
                                 COMMON + ["--arch", "lenet", "--amp", "fp16", "--clip-grad", "1.0", "--out", str(tmp_path)])
    assert syncs == [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0]  # micro-steps 2..12 of 4 windows of 3


@pytest.mark.parametrize("aug_on", ["device", "loader"])
def test_moco_reads_the_device_once_per_optimizer_step(monkeypatch, tmp_path, aug_on):
    """MoCo adds shuffle BN (one process: split BN), the momentum update and the queue: the
    queue pointer is a Python int, so none of them reads the device."""
    syncs = syncs_per_micro_step(monkeypatch, train_moco.main,
                                 COMMON + ["--moco-k", "512", "--knn-every", "0", "--aug-on", aug_on,
                                           "--out", str(tmp_path)])
    assert syncs == [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0]


def test_the_counter_sees_a_sync(monkeypatch):
    """The negative control: a read made by our code is counted."""
    from ddp_utils.train.checkpoint import weights_finite

    counter = SyncCounter(monkeypatch)
    assert weights_finite(torch.nn.Linear(2, 2), torch.device("cpu"))
    assert counter.count == 1
