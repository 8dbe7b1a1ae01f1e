"""Host synchronisations per step, counted: on a GPU each one stalls the CPU until the device has
caught up, so the training loop may read the device at most once per optimizer step (the
ranks' stop/non-finite/overflow agreement) and never inside a window's other micro-steps.

``host_sync_probe`` counts, over the real training loop, every operation that would wait on a
GPU (device reads, data-dependent shapes, blocking host-to-device copies); see its docstring.
One process in this process, two ranks forked with torchrun's environment (MoCo's shuffle BN
is then an all_to_all), and planted syncs that must be caught.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_ok, run_ranks
from host_sync_probe import HostSyncCounter, count_per_micro_step

import train_classifier
import train_moco
from ddp_utils.runtime.stopping import StepGuard

COMMON = ["--device", "cpu", "--dataset", "digits", "--arch", "small_cnn", "--image-size", "16", "--batch-size", "16",
          "--accum-steps", "3", "--max-steps", "4", "--log-every", "1000", "--epochs", "1"]
# fp16 (the scaler's overflow test) and clipping (the norm) must add no read of their own: both
# travel in the step's one agreement. lenet: fp16 convolutions are slow on a CPU.
CLASSIFIER = COMMON + ["--arch", "lenet", "--amp", "fp16", "--clip-grad", "1.0"]
MOCO = COMMON + ["--moco-k", "512", "--knn-every", "0"]
ONE_READ_PER_WINDOW = [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0]  # micro-steps 2..12 of 4 windows of 3


def _counts(monkeypatch, main, args, plant=None) -> dict:
    result = count_per_micro_step(main, args, monkeypatch.setattr, plant)
    assert result["code"] == 0
    return result


def test_classifier_reads_the_device_once_per_optimizer_step(monkeypatch, tmp_path):
    result = _counts(monkeypatch, train_classifier.main, CLASSIFIER + ["--out", str(tmp_path)])
    assert result["per_micro_step"] == ONE_READ_PER_WINDOW, result["events"]
    assert set(map(tuple, result["events"])) == {("read", "Tensor.tolist")}  # the agreement


@pytest.mark.parametrize("aug_on", ["device", "loader"])
def test_moco_reads_the_device_once_per_optimizer_step(monkeypatch, tmp_path, aug_on):
    """One process: split BN, the momentum update and the queue (its pointer is a Python int)
    read nothing. On the device path the next batch's augmentation is queued after the
    window's last backward and before the step's read, so the device has work while the host waits."""
    result = _counts(monkeypatch, train_moco.main, MOCO + ["--aug-on", aug_on, "--out", str(tmp_path)])
    assert result["per_micro_step"] == ONE_READ_PER_WINDOW, result["events"]
    if aug_on == "device":
        assert result["prepared"] == [(3, True), (6, True), (9, True), (12, True)]


@pytest.mark.parametrize("decode_on", ["loader", "device"])
def test_moco_on_image_files_reads_the_device_once_per_optimizer_step(monkeypatch, tmp_path, jpeg_folder, decode_on):
    """ImageFolder on the device path: packed batches (their places and indices copied without
    a wait), the boxes drawn and every view cropped there; with --decode-on device the batch is
    decoded there too. Still the agreement's one read per window."""
    args = ["--device", "cpu", "--dataset", "imagefolder", "--data-dir", str(jpeg_folder), "--arch", "small_cnn",
            "--image-size", "16", "--batch-size", "4", "--accum-steps", "3", "--max-steps", "3", "--log-every",
            "1000", "--epochs", "1", "--moco-k", "64", "--knn-every", "0", "--bn-splits", "2", "--aug-on", "device", "--decode-on",
            decode_on, "--workers", "0", "--out", str(tmp_path)]
    result = _counts(monkeypatch, train_moco.main, args)
    assert result["per_micro_step"] == ONE_READ_PER_WINDOW[:8], result["events"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """Both scripts on 2 gloo ranks, each rank counting its own syncs."""
    results = {}
    for name, script, args in (("classifier", "train_classifier.py", CLASSIFIER), ("moco", "train_moco.py", MOCO)):
        out = tmp_path_factory.mktemp(name)
        proc = run_ranks("tests/host_sync_probe.py", [str(out), script, *args, "--out", str(out / "run")], out)
        assert_ok(proc)
        results[name] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return results


@pytest.mark.slow
@pytest.mark.torch_versions  # DDP's reducer (its bucket rebuild) and the collectives of this release
@pytest.mark.parametrize("script", ["classifier", "moco"])
def test_two_ranks_read_the_device_once_per_optimizer_step(two_ranks, script):
    """DDP's bucketed all-reduce, the agreement's all_reduce and (MoCo) shuffle BN's all_to_all
    and key all_gather: still one read per window on each rank. Apart from it, DDP rebuilds its
    buckets once, at the second step's first forward (with NCCL a copy through the host)."""
    for rank in two_ranks[script]:
        assert rank["per_micro_step"] == ONE_READ_PER_WINDOW, rank["events"]
        assert 1 <= len(rank["ddp_rebuild"]) <= 2, rank["ddp_rebuild"]


@pytest.mark.parametrize("plant, caught", [("mask", "aten._local_scalar_dense.default"),
                                           ("tensor", "torch.tensor(device=...)")])
def test_a_planted_sync_is_caught_in_every_micro_step(monkeypatch, tmp_path, plant, caught):
    """The negative control: ``loss[loss > 0]`` (a data-dependent size) or a tensor made from
    Python data on the device, added to every micro-step's loss."""
    result = _counts(monkeypatch, train_moco.main, MOCO + ["--out", str(tmp_path)], plant=plant)
    assert result["per_micro_step"] == [n + 1 for n in ONE_READ_PER_WINDOW]
    assert [what for what in result["events"] if what[1] == caught]


def test_the_counter_tells_host_tensors_from_device_tensors():
    """Reads and data-dependent operators of host tensors (the sampler's, the shuffle plan's)
    are free; the same operations on a device tensor, and blocking copies to it, are counted."""
    device = torch.device("cpu", 0)
    with HostSyncCounter() as counter:
        host, on_device = torch.arange(6), torch.arange(6, device=device)
        host.tolist(), host[host > 2], host.sum().item(), torch.unique(host)
        assert counter.events == []
        on_device.tolist()
        on_device[on_device > 2]
        on_device.sum().item()
        on_device.to("cpu")
        on_device.copy_(host)
        on_device.copy_(host, non_blocking=True)  # from pinned memory on a GPU: no wait
        on_device[0] = 1  # a Python number: a host-to-device copy
    kinds = [kind for kind, _ in counter.events]
    assert kinds == ["read", "read", "read", "read", "host-to-device copy", "host-to-device copy"], counter.events


def test_the_step_agreement_writes_its_flags_on_the_device():
    """A stop signal and Ctrl-C set their flags with a fill kernel: ``flags[i] = 1`` would copy
    a host scalar to the device and wait for it. The agreement's one read is all that remains."""
    with HostSyncCounter() as counter:
        guard = StepGuard(SimpleNamespace(preempt_signal=15, interrupted=True), torch.device("cpu", 0))
        verdict = guard(torch.zeros((), dtype=torch.bool, device=torch.device("cpu", 0)))
    assert verdict.preempted and verdict.interrupted
    assert counter.events == [("read", "Tensor.tolist")]
