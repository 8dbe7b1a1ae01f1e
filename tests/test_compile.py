"""``--compile``: torch.compile of the network (MoCo: the query and the key encoder, separately)
trains the same model as eager mode, through the real scripts, with accumulation (``no_sync``
under DDP on 2 ranks) and split BN. Compiled kernels fuse and reorder float operations, so the
comparison is within a tolerance, not bit for bit."""
from __future__ import annotations

import shutil

import pytest
import torch
from helpers import CLASSIFIER_REF, assert_ok, load_ckpt, run_ranks

import train_moco

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                                 reason="torch.compile's CPU backend (inductor) needs a C++ compiler")]

STEPS = ["--device", "cpu", "--dataset", "digits", "--batch-size", "16", "--accum-steps", "2",
         "--max-steps", "3", "--epochs", "1", "--image-size", "16"]


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()  # compiling changed no state-dict key
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a.values(), b.values())
               if x.is_floating_point())


@pytest.mark.torch_versions  # dynamo, inductor and DDP's graph splitting change every release
def test_compiled_classifier_on_two_ranks_matches_eager(classifier_reference, tmp_path):
    """The reference run's first 3 steps (2 ranks, accumulation, eager), compiled."""
    # run_ranks: the script's main on 2 gloo ranks without torchrun's agent and fresh interpreters
    # (the launcher is not what this test is about; tests/test_launch_*.py cover it)
    proc = run_ranks("train_classifier.py", CLASSIFIER_REF + ["--max-steps", "3", "--compile",
                                                              "--out", str(tmp_path / "compiled")], tmp_path)
    assert_ok(proc)
    eager = load_ckpt(classifier_reference.checkpoint(3))
    compiled = load_ckpt(tmp_path / "compiled/checkpoint_last.pt")
    assert compiled["step"] == eager["step"] == 3
    assert "compiled" in proc.stdout  # the start line says so
    assert _max_difference(eager["model"], compiled["model"]) < 1e-4


# The newest pair only: of what differs between torch releases, this run meets nothing that the
# oldest pair does not meet in the test above (DDP's graph splits, accumulation) and in
# test_shuffle_bn.py's compiled key encoder (split BN's forward, the wrapper outside the module tree).
def test_compiled_moco_with_split_bn_matches_eager(tmp_path):
    args = STEPS + ["--arch", "small_cnn", "--moco-k", "128", "--knn-every", "0", "--bn-splits", "4"]
    torch._dynamo.reset()
    for mode in ("eager", "compiled"):
        extra = ["--compile"] if mode == "compiled" else []
        assert train_moco.main(args + extra + ["--out", str(tmp_path / mode)]) == 0
    # both encoders went through the compiler: at least two graphs (query forward, key forward)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2
    eager, compiled = (load_ckpt(tmp_path / m / "checkpoint_last.pt")["model"] for m in ("eager", "compiled"))
    assert torch.equal(eager["queue_ptr"], compiled["queue_ptr"])
    assert _max_difference(eager, compiled) < 1e-4  # encoder_q, encoder_k and the queue
