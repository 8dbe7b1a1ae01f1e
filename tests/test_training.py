"""End-to-end promises of train_classifier.py: it learns, resumes exactly (mid-epoch, across an
epoch end, onto another schedule or batch geometry), frees every graph, runs under anomaly
detection, and counts every validation sample once."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from helpers import (
    CLASSIFIER_REF,
    STEPS_PER_EPOCH,
    assert_ok,
    assert_same_state,
    in_process,
    load_ckpt,
    read_scalars,
    resume_folder,
    run_ranks,
)
from memory_probe import peak_saved_bytes

import train_classifier
from ddp_utils.data.order import ShardedEvalSampler
from ddp_utils.train.optimization import LRSchedule

CPU = ["--device", "cpu"]


@pytest.mark.slow
def test_small_cnn_learns_digits_on_two_ranks(tmp_path):
    out = tmp_path / "run"
    proc = run_ranks("train_classifier.py", CPU + [
        "--dataset", "digits", "--arch", "small_cnn", "--batch-size", "32", "--lr", "0.05",
        "--warmup-steps", "20", "--epochs", "14", "--log-every", "10", "--out", str(out)], tmp_path)
    assert_ok(proc)
    scalars = read_scalars(out / "tb")
    for tag in ("train/loss", "train/lr", "train/images_per_sec", "val/loss", "val/acc1"):
        assert scalars.get(tag), f"TensorBoard has no {tag}"
    final_step, final_acc = scalars["val/acc1"][-1]
    assert final_acc >= 95.0, scalars["val/acc1"]
    assert scalars["val/acc1"][0][1] < final_acc
    assert final_step == 14 * 22  # 719 samples per rank // 32 = 22 steps per epoch
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["config"]["batch_size"] == 32


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_shards_cover_every_sample_exactly_once(world_size):
    data = range(359)
    shard_of = torch.randperm(359, generator=torch.Generator().manual_seed(0)).numpy() % 12  # 12 shards, mixed
    for by_shard in (None, shard_of):  # by shard: each rank reads a run of whole shards
        shards = [list(ShardedEvalSampler(data, world_size, r, by_shard)) for r in range(world_size)]
        flat = [i for shard in shards for i in shard]
        assert sorted(flat) == list(data)
        if by_shard is not None:
            assert all(len({shard_of[i] for i in part}) <= 12 // world_size + 1 for part in shards)


def test_reference_run_counts_its_place_in_the_epoch(classifier_reference):
    """Every step's checkpoint of the 2-rank reference: mid-epoch ones hold the batches consumed
    (2 per step), the epoch's last one says the epoch ended; both evaluations count all 359
    validation images once."""
    for step in (1, 5, 8, STEPS_PER_EPOCH - 1, STEPS_PER_EPOCH, STEPS_PER_EPOCH + 3, 2 * STEPS_PER_EPOCH):
        ckpt = load_ckpt(classifier_reference.checkpoint(step))
        epoch, batches = divmod(2 * step, 2 * STEPS_PER_EPOCH)
        assert (ckpt["step"], ckpt["epoch"], ckpt["batches_done"]) == (step, epoch, batches)
    assert classifier_reference.stdout.count("(359 images)") == 4  # the model and its EMA, each epoch
    assert classifier_reference.stdout.count("ema val loss") == 2


def test_the_ema_is_updated_every_3_steps_identical_on_both_ranks(classifier_reference):
    """--model-ema on 2 ranks with A = 2: updated after optimizer steps 1, 4, 7, ... of each epoch
    (micro-steps not counted), a copy of the weights while the LR warms up (steps 1-3), then an
    average; the end-of-run check finds it identical on both ranks, BatchNorm statistics included."""
    assert "EMA of the weights identical on all 2 ranks" in classifier_reference.stdout
    for step, averaged in ((1, 0), (2, 0), (3, 0), (4, 1), (6, 1), (7, 2), (22, 7), (23, 8)):
        assert int(load_ckpt(classifier_reference.checkpoint(step))["model_ema"]["n_averaged"]) == averaged, step
    four = load_ckpt(classifier_reference.checkpoint(4))
    assert all(torch.equal(four["model_ema"][f"module.{k}"], v) for k, v in four["model"].items())  # a copy
    final = classifier_reference.final
    assert not torch.equal(final["model_ema"]["module.fc.weight"], final["model"]["fc.weight"])


def test_resume_mid_epoch_ends_exactly_as_the_uninterrupted_run(classifier_reference, tmp_path):
    """Step 5's checkpoint (mid epoch 1) resumed on 2 ranks to the end of epoch 2: weights,
    BatchNorm buffers, momentum buffers, the EMA of the weights, LR and step equal the reference's,
    and TensorBoard continues the step axis."""
    part = resume_folder(classifier_reference.checkpoint(5), tmp_path / "part")
    proc = run_ranks("train_classifier.py", CLASSIFIER_REF + ["--resume", "auto", "--out", str(part)], tmp_path)
    assert_ok(proc)
    assert "resumed from" in proc.stdout and "step 5, in epoch 1, 10 batches" in proc.stdout
    resumed, ref = load_ckpt(part / "checkpoint_last.pt"), classifier_reference.final
    assert_same_state(resumed, ref)
    assert resumed["step"] == 2 * STEPS_PER_EPOCH and "lr_scheduler" not in resumed
    # the LR is a function of the step: step 44 ran at schedule(43), in epoch 2 of cosine-epoch
    schedule = LRSchedule(0.05, "cosine-epoch", 2 * STEPS_PER_EPOCH, 3, steps_per_epoch=STEPS_PER_EPOCH)
    assert ref["optimizer"]["param_groups"][0]["lr"] == schedule(2 * STEPS_PER_EPOCH - 1)
    ref_lr, res_lr = read_scalars(classifier_reference.out / "tb")["train/lr"], read_scalars(part / "tb")["train/lr"]
    assert [s for s, _ in res_lr] == list(range(6, 2 * STEPS_PER_EPOCH + 1))
    assert dict(ref_lr) == {k: pytest.approx(schedule(k - 1), rel=1e-6) for k in range(1, 45)}  # float32 events
    assert dict(res_lr) == {k: dict(ref_lr)[k] for k in range(6, 45)}


def test_resume_follows_this_runs_schedule_not_the_checkpoints(classifier_reference, tmp_path, capsys):
    """The end of epoch 1 resumed with --epochs 4 (one process): the next step runs at the new
    schedule's LR for step 22 (epoch 1 of 4), not the old one's (epoch 2 of 2: zero)."""
    part = resume_folder(classifier_reference.checkpoint(STEPS_PER_EPOCH), tmp_path / "part")
    args = CLASSIFIER_REF + ["--epochs", "4", "--max-steps", str(STEPS_PER_EPOCH + 1), "--resume", "auto",
                             "--out", str(part)]
    assert_ok(in_process(train_classifier.main, args, capsys))
    steps_per_epoch = 45  # one process: 1,438 // 16 = 89 micro-batches, 45 windows of 2
    new = LRSchedule(0.05, "cosine-epoch", 4 * steps_per_epoch, 3, steps_per_epoch=steps_per_epoch)
    old = LRSchedule(0.05, "cosine-epoch", 2 * STEPS_PER_EPOCH, 3, steps_per_epoch=STEPS_PER_EPOCH)
    lr = load_ckpt(part / "checkpoint_last.pt")["optimizer"]["param_groups"][0]["lr"]
    assert lr == new(STEPS_PER_EPOCH) != old(STEPS_PER_EPOCH)


def test_another_batch_geometry_resumes_at_a_whole_window(classifier_reference, tmp_path, capsys):
    """Step 5 of 2 ranks x 16 (10 micro-batches into the epoch on each rank: 320 samples in all)
    resumed on one process with batch 24 and 4 micro-steps per window: 320 / 24 = 13.3
    micro-batches, rounded down to a whole window: 12."""
    part = resume_folder(classifier_reference.checkpoint(5), tmp_path / "part")
    args = CLASSIFIER_REF + ["--batch-size", "24", "--accum-steps", "4", "--max-steps", "6", "--resume", "auto", "--allow-changes",
                             "--out", str(part)]
    proc = in_process(train_classifier.main, args, capsys)
    assert_ok(proc)
    assert "step 5, in epoch 1, 12 batches into the epoch" in proc.stdout
    assert "the epoch continues near, not exactly at, the saved position" in proc.stdout
    assert load_ckpt(part / "checkpoint_last.pt")["batches_done"] == 16  # one more window of 4


def test_a_gpu_checkpoint_resumes_on_the_cpu_with_this_devices_optimizer(classifier_reference, tmp_path, capsys):
    """A CUDA run saves param groups that say fused=True and channels_last momentum buffers;
    loaded as saved, the CPU would run fused SGD pairing NCHW weights with channels_last
    buffers element by memory position. Resumed, it takes the same step as the plain checkpoint."""
    plain = load_ckpt(classifier_reference.checkpoint(5))
    from_gpu = copy.deepcopy(plain)
    for group in from_gpu["optimizer"]["param_groups"]:
        group.update(fused=True, foreach=None)
    buffers = [s["momentum_buffer"] for s in from_gpu["optimizer"]["state"].values()]
    for state in from_gpu["optimizer"]["state"].values():
        if state["momentum_buffer"].dim() == 4:
            state["momentum_buffer"] = state["momentum_buffer"].contiguous(memory_format=torch.channels_last)
    assert sum(b.dim() == 4 and b.shape[2] * b.shape[3] > 1 for b in buffers) >= 2  # layouts really differ
    finals = []
    for name, ckpt in (("plain", plain), ("from_gpu", from_gpu)):
        (tmp_path / name).mkdir()
        torch.save(ckpt, tmp_path / name / "checkpoint_last.pt")
        args = CLASSIFIER_REF + ["--max-steps", "7", "--resume", "auto", "--out", str(tmp_path / name)]
        assert_ok(in_process(train_classifier.main, args, capsys))
        finals.append(load_ckpt(tmp_path / name / "checkpoint_last.pt"))
    assert finals[0]["step"] == 7
    assert_same_state(finals[1], finals[0])
    assert all(g.get("fused") in (None, False) for g in finals[1]["optimizer"]["param_groups"])


def test_a_cpu_checkpoint_keeps_this_devices_fused_sgd():
    """The other way round: a foreach checkpoint loaded where the optimizer was built fused (as
    on CUDA) stays fused, with the saved momentum."""
    from ddp_utils.train.resume import load_optimizer_for_this_device

    conv = torch.nn.Conv2d(3, 4, 3)
    writer = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9, foreach=True)
    conv(torch.randn(2, 3, 5, 5)).sum().backward()
    writer.step()
    reader = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9, fused=True)
    load_optimizer_for_this_device(reader, copy.deepcopy(writer.state_dict()))
    assert reader.param_groups[0]["fused"] is True and not reader.param_groups[0]["foreach"]
    assert torch.equal(reader.state[conv.weight]["momentum_buffer"], writer.state[conv.weight]["momentum_buffer"])


def test_a_cpu_run_on_a_gpu_machine_leaves_cuda_alone(monkeypatch):
    """--device cpu where CUDA exists: saving and restoring the RNG states must not touch CUDA
    (asking for its RNG state creates a CUDA context on GPU 0, for nothing)."""
    from ddp_utils.train.checkpoint import rng_states
    from ddp_utils.train.resume import restore_rng_states

    def no_cuda(*args, **kwargs):
        raise AssertionError("a --device cpu run touched CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("get_rng_state", "set_rng_state", "init"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    states = rng_states(torch.device("cpu"))
    assert "cuda" not in states[0]
    restore_rng_states([{**states[0], "cuda": torch.zeros(16, dtype=torch.uint8)}], torch.device("cpu"))


@pytest.mark.parametrize("tf32, deterministic", [(True, False), (False, False), (True, True)])
def test_backend_switches_for_cuda_and_their_restore(monkeypatch, tf32, deterministic):
    """What a CUDA run sets (the switches exist without a GPU), and that the session puts the
    previous process-wide state back."""
    from ddp_utils.train.session import configure_backends

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    before = (torch.are_deterministic_algorithms_enabled(), matmul.allow_tf32, cudnn.allow_tf32, cudnn.benchmark,
              cudnn.deterministic)
    restore = configure_backends(torch.device("cuda", 0), tf32=tf32, deterministic=deterministic)
    try:
        fast = tf32 and not deterministic
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (fast, fast)
        assert (cudnn.benchmark, cudnn.deterministic) == (not deterministic, deterministic)
        assert torch.are_deterministic_algorithms_enabled() == deterministic
        assert ("CUBLAS_WORKSPACE_CONFIG" in os.environ) == deterministic  # cuBLAS's condition for repeatability
    finally:
        restore()
    assert (torch.are_deterministic_algorithms_enabled(), matmul.allow_tf32, cudnn.allow_tf32, cudnn.benchmark,
            cudnn.deterministic) == before


def test_no_graph_survives_a_micro_step(tmp_path):
    """What autograd keeps for backward in the real script peaks at one micro-batch's graph
    whatever A is; the summed-loss mistake keeps all A graphs alive at once. Counted exactly
    (tests/memory_probe.py)."""
    ours = {a: peak_saved_bytes(a, "ours", str(tmp_path / str(a))) for a in (1, 8)}
    mistake = {a: peak_saved_bytes(a, "summed_loss", "") for a in (1, 8)}
    assert ours[8] == ours[1] > 0, ours
    assert mistake[8] > 7.9 * mistake[1], f"the negative control held only {mistake[8] / mistake[1]:.2f} graphs"


def test_debug_run_under_anomaly_detection(tmp_path, capsys):
    out = tmp_path / "debug"
    proc = in_process(train_classifier.main, CPU + ["--debug", "--arch", "lenet", "--accum-steps", "2",
                                                    "--batch-size", "16", "--epochs", "2", "--out", str(out)], capsys)
    assert_ok(proc)
    assert "autograd anomaly detection on" in proc.stdout
    ckpt = load_ckpt(out / "checkpoint_last.pt")
    assert ckpt["step"] == 2 * 8  # 256-sample debug subset / (16 x 2) per step, 2 epochs
    assert "(128 images)" in proc.stdout


@pytest.mark.parametrize("native, emulated, expected", [
    (True, True, "bf16 (--amp auto: this GPU computes bf16 natively)"),
    (False, True, "fp32 (--amp auto: this GPU has no native bf16, at most an emulated one; --amp fp16 uses its fp16 tensor cores)"),
    (False, False, "fp32 (--amp auto: this GPU has no native bf16, at most an emulated one; --amp fp16 uses its fp16 tensor cores)"),
], ids=["A100/H100", "V100/T4 (emulated)", "no bf16"])
def test_amp_auto_picks_bf16_only_where_the_gpu_computes_it(monkeypatch, native, emulated, expected):
    """``torch.cuda.is_bf16_supported()`` says yes where CUDA only emulates bf16 (a V100, a T4):
    --amp auto asks without emulation, and the start-up line and --check say which and why. The
    keyword exists on the torch release installed (CI: the oldest and newest pairs)."""
    import inspect

    from ddp_utils.runtime import precision

    assert "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or
                        (emulated and including_emulation))
    cuda = torch.device("cuda", 0)
    assert precision.resolve_amp("auto", cuda) == ("bf16" if native else "none")
    assert precision.precision_name("auto", cuda) == expected
    assert precision.precision_name("auto", torch.device("cpu")) == "fp32"
    assert precision.precision_name("bf16", cuda) == "bf16"


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_runs_and_checkpoints_the_scaler(tmp_path, capsys, amp):
    out = tmp_path / amp
    proc = in_process(train_classifier.main, CPU + ["--debug", "--amp", amp, "--arch", "lenet", "--image-size", "16",
                                                    "--accum-steps", "2", "--batch-size", "16", "--max-steps", "3",
                                                    "--clip-grad", "5", "--out", str(out)], capsys)
    assert_ok(proc)
    ckpt = load_ckpt(out / "checkpoint_last.pt")
    assert ckpt["step"] == 3 and ckpt["config"]["amp"] == amp
    if amp == "fp16":
        assert ckpt["grad_scaler"]["scale"] > 0
    else:
        assert ckpt["grad_scaler"] == {}  # bf16 needs no loss scaling: a disabled scaler


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
