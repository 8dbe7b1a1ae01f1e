"""End-to-end promises of train_classifier.py: it learns, resumes exactly, frees every graph,
runs under anomaly detection, and counts every validation sample once."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_ok, load_ckpt, read_scalars, run_cli
from memory_probe import peak_saved_bytes

from ddp_utils.data.loading import ShardedEvalSampler
from ddp_utils.train.schedule import LRSchedule

CPU = ["--device", "cpu"]


def test_small_cnn_learns_digits_on_two_ranks(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train_classifier.py", CPU + [
        "--dataset", "digits", "--arch", "small_cnn", "--batch-size", "32", "--lr", "0.05",
        "--warmup-steps", "20", "--epochs", "14", "--log-every", "10", "--out", str(out)], nproc=2)
    assert_ok(proc)
    scalars = read_scalars(out / "tb")
    for tag in ("train/loss", "train/lr", "train/images_per_sec", "val/loss", "val/acc1"):
        assert scalars.get(tag), f"TensorBoard has no {tag}"
    final_step, final_acc = scalars["val/acc1"][-1]
    assert final_acc >= 95.0, scalars["val/acc1"]
    assert scalars["val/acc1"][0][1] < final_acc
    assert final_step == 14 * 22  # 719 samples per rank // 32 = 22 steps per epoch
    # The whole validation split, each sample once (359 = 20% of 1,797), on 2 ranks.
    assert "(359 images)" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["config"]["batch_size"] == 32


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_shards_cover_every_sample_exactly_once(world_size):
    data = range(359)
    shards = [list(ShardedEvalSampler(data, world_size, r)) for r in range(world_size)]
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == list(data)


def test_resume_continues_exactly(tmp_path):
    """Stop mid-epoch at step 5, resume to step 8 (same epoch), resume to step 14 (across an epoch
    end): weights, BatchNorm buffers, momentum buffers, LR and step equal an uninterrupted run."""
    common = CPU + ["--arch", "small_cnn", "--batch-size", "32", "--accum-steps", "2", "--lr", "0.05",
                    "--warmup-steps", "3", "--epochs", "3", "--log-every", "1"]
    assert_ok(run_cli("train_classifier.py", common + ["--max-steps", "14", "--out", str(tmp_path / "ref")], nproc=2))
    part = tmp_path / "part"
    assert_ok(run_cli("train_classifier.py", common + ["--max-steps", "5", "--out", str(part)], nproc=2))
    stopped = load_ckpt(part / "checkpoint_last.pt")
    assert (stopped["epoch"], stopped["step"], stopped["batches_done"]) == (0, 5, 10)
    # Resume and stop again inside the same epoch: the epoch must still count as unfinished.
    assert_ok(run_cli("train_classifier.py", common + ["--max-steps", "8", "--resume", "auto",
                                                        "--out", str(part)], nproc=2))
    stopped = load_ckpt(part / "checkpoint_last.pt")
    assert (stopped["epoch"], stopped["step"], stopped["batches_done"]) == (0, 8, 16)
    resumed_run = run_cli("train_classifier.py", common + ["--max-steps", "14", "--resume", "auto",
                                                            "--out", str(part)], nproc=2)
    assert_ok(resumed_run)
    assert "resumed from" in resumed_run.stdout and "step 8, in epoch 1, 16 batches" in resumed_run.stdout
    ref, resumed = load_ckpt(tmp_path / "ref/checkpoint_last.pt"), load_ckpt(part / "checkpoint_last.pt")
    assert (resumed["epoch"], resumed["step"]) == (ref["epoch"], ref["step"]) == (1, 14)
    for name, value in ref["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    ref_opt, res_opt = ref["optimizer"], resumed["optimizer"]
    assert ref_opt["param_groups"][0]["lr"] == res_opt["param_groups"][0]["lr"]
    for key, state in ref_opt["state"].items():
        assert torch.equal(state["momentum_buffer"], res_opt["state"][key]["momentum_buffer"])
    # The LR is a function of the step (nothing of it is saved): step 14 ran at schedule(13), 11 steps/epoch.
    assert "lr_scheduler" not in ref and "lr_scheduler" not in resumed
    assert ref_opt["param_groups"][0]["lr"] == LRSchedule(0.05, "cosine", 3 * 11, 3)(13)
    # TensorBoard of the resumed run continues the step axis instead of restarting at 0.
    steps = [s for s, _ in read_scalars(part / "tb")["train/loss"]]
    assert steps == sorted(set(steps)) and steps[0] == 1 and steps[-1] == 14


def test_no_graph_survives_a_micro_step():
    """What autograd keeps for backward peaks at one micro-batch's graph whatever A is; the
    summed-loss mistake keeps all A graphs alive at once. Counted exactly (tests/memory_probe.py):
    resident memory varied by over 100 MiB between identical runs and made this test flaky."""
    ours = {a: peak_saved_bytes(a, "ours") for a in (1, 8)}
    mistake = {a: peak_saved_bytes(a, "summed_loss") for a in (1, 8)}
    assert ours[8] == ours[1] == mistake[1], (ours, mistake)
    one_graph = ours[1]  # 65.5 MiB: input and activations of one micro-batch (+ 40 KB of weights)
    assert mistake[8] > 7.9 * one_graph, f"the negative control held only {mistake[8] / one_graph:.2f} graphs"


def test_debug_run_under_anomaly_detection(tmp_path):
    out = tmp_path / "debug"
    proc = run_cli("train_classifier.py", CPU + ["--debug", "--arch", "lenet", "--accum-steps", "2",
                                                 "--batch-size", "16", "--epochs", "2", "--out", str(out)])
    assert_ok(proc)
    assert "autograd anomaly detection on" in proc.stdout
    ckpt = load_ckpt(out / "checkpoint_last.pt")
    assert ckpt["step"] == 2 * 8  # 256-sample debug subset / (16 x 2) per step, 2 epochs
    assert "(128 images)" in proc.stdout


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_runs_and_checkpoints_the_scaler(tmp_path, amp):
    out = tmp_path / amp
    proc = run_cli("train_classifier.py", CPU + ["--debug", "--amp", amp, "--arch", "small_cnn",
                                                 "--accum-steps", "2", "--batch-size", "16", "--max-steps", "3",
                                                 "--clip-grad", "5", "--out", str(out)])
    assert_ok(proc)
    ckpt = load_ckpt(out / "checkpoint_last.pt")
    assert ckpt["step"] == 3
    if amp == "fp16":
        assert ckpt["grad_scaler"]["scale"] > 0
    else:
        assert ckpt["grad_scaler"] is None  # bf16 needs no loss scaling


def test_resume_follows_this_runs_schedule_not_the_checkpoints(tmp_path):
    """Resuming with more --epochs continues at the saved step on the *new* schedule: the LR is a
    function of the step and of this run's flags; nothing of the schedule comes from a checkpoint."""
    from ddp_utils.train.accumulation import GradientAccumulator
    from ddp_utils.train.schedule import warmup_cosine_factor

    def lr_of_step(total, step):  # the accumulator of a run resumed at `step` (TrainRun sets it so)
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        acc = GradientAccumulator(model, opt, 1, lr_at=LRSchedule(0.5, "cosine", total, 2), step=step)
        (micro, x), = acc.micro_batches([torch.ones(1, 1)])
        acc.backward(model(x).sum(), micro)
        return opt.param_groups[0]["lr"]

    assert lr_of_step(200, 30) == 0.5 * warmup_cosine_factor(30, 2, 200)
    assert lr_of_step(100, 30) == 0.5 * warmup_cosine_factor(30, 2, 100) != lr_of_step(200, 30)



def test_top5_counts_each_validation_sample_once():
    """Top-1 and top-5 against logits known in advance: sample r (r = 0..9) puts its label's
    logit at rank r of 12, so exactly 1 of 10 samples is top-1 correct and 5 are top-5 correct."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_utils.runtime.dist import init_distributed
    from train_classifier import evaluate

    class RankedLogits(nn.Module):
        def forward(self, x):  # x: B x 1, the rank of class 0 among 12
            logits = torch.zeros(len(x), 12)
            for row, rank in enumerate(x.long().squeeze(1).tolist()):
                ranking = list(range(1, 12))
                ranking.insert(rank, 0)  # classes from the highest logit down; class 0 at position rank
                logits[row, ranking] = torch.arange(12.0, 0.0, -1.0)
            return logits

    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.zeros(10, dtype=torch.long))
    metrics = evaluate(RankedLogits(), DataLoader(data, batch_size=4), init_distributed("cpu"), "none")
    assert metrics["count"] == 10 and metrics["acc1"] == 10.0 and metrics["acc5"] == 50.0
