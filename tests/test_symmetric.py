"""--symmetric: the MoCo authors' CIFAR-10 demo loss, loss(q1, k2) + loss(q2, k1), with both key
sets enqueued (crop 1's keys first) and a shuffle per key pass.

One process: the loss, its gradient and the keys equal a hand computation on the same encoders
and batches, and the asymmetric forward is unchanged. Two gloo ranks (the real setup() and
training loop): two forwards of the DDP query encoder before one backward give the all-reduced
gradient of the summed loss in one all-reduce round; the queue advances by 2 x the global batch
per micro-step, identical on both ranks. The real CLI: an interrupted symmetric run resumed with
--resume auto ends bit-identical to an uninterrupted one; --moco-k must hold both key sets.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import (
    SYMMETRIC_REF,
    assert_ok,
    assert_same_state,
    load_ckpt,
    read_scalars,
    resume_folder,
    run_on_ranks,
    run_ranks,
)
from host_sync_probe import count_per_micro_step
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import train_moco
from ddp_utils.config import parse_config
from ddp_utils.models.moco import Encoder, MoCo, contrastive_loss, symmetric_contrastive_loss
from ddp_utils.models.shuffle_bn import split_batchnorm
from ddp_utils.runtime.dist import DistInfo
from ddp_utils.train.run import start_training
from ddp_utils.train.session import RunSession

N, C, K, T = 8, 16, 40, 0.2  # one-process checks: batch, key size, queue length, temperature


# ----------------------------------------------------------------------------- one process
def _moco(split: bool) -> MoCo:
    torch.manual_seed(0)
    encoder = Encoder(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.AdaptiveAvgPool2d(1), nn.Flatten()), 8, C, mlp=False)
    if split:  # what train_moco does on one process with shuffle BN
        encoder = split_batchnorm(encoder, 2)
    return MoCo(encoder, dim=C, K=K, T=T, shuffle_bn=split)


def _hand_keys(moco: MoCo, im: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        if perm is None:
            return F.normalize(moco.encoder_k(im), dim=1)
        return F.normalize(moco.encoder_k(im[perm]), dim=1)[torch.argsort(perm)]


def _hand_loss(q: torch.Tensor, k: torch.Tensor, queue: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue], dim=1) / T
    hits = (logits.argmax(1) == 0).float().mean()
    return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long)), hits


@pytest.mark.parametrize("split", [True, False], ids=["split-bn-shuffled", "no-shuffle"])
def test_symmetric_loss_is_the_sum_of_both_directions_by_hand(split):
    moco = _moco(split)
    hand = copy.deepcopy(moco)
    torch.manual_seed(1)
    im1, im2 = torch.randn(N, 3, 6, 6), torch.randn(N, 3, 6, 6)
    queue = moco.queue.clone()

    torch.manual_seed(5)
    logits_12, logits_21, keys = moco.symmetric_forward(im1, im2)
    loss, acc = symmetric_contrastive_loss(logits_12, logits_21)
    loss.backward()
    # By hand: the demo's order, loss_12 (whose key pass encodes crop 2) then loss_21, each key
    # pass with its own shuffle (one process: split BN, the local permutation from the global RNG).
    torch.manual_seed(5)
    p2, p1 = (torch.randperm(N), torch.randperm(N)) if split else (None, None)
    k2, k1 = _hand_keys(hand, im2, p2), _hand_keys(hand, im1, p1)
    q1, q2 = (F.normalize(hand.encoder_q(im), dim=1) for im in (im1, im2))
    (loss_12, acc_12), (loss_21, acc_21) = _hand_loss(q1, k2, queue), _hand_loss(q2, k1, queue)
    (loss_12 + loss_21).backward()

    if split:
        assert not torch.equal(p1, p2)  # a separate shuffle per direction
    torch.testing.assert_close(loss, loss_12 + loss_21, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(acc, (acc_12 + acc_21) / 2, rtol=0, atol=0)
    assert torch.equal(keys, torch.cat([k1, k2]))  # crop 1's keys first, as the demo's cat([k1, k2])
    for (name, p), h in zip(moco.encoder_q.named_parameters(), hand.encoder_q.parameters()):
        torch.testing.assert_close(p.grad, h.grad, rtol=1e-5, atol=1e-6, msg=name)  # both crops' graphs
    assert all(p.grad is None for p in moco.encoder_k.parameters())
    assert torch.equal(moco.queue, queue) and moco.queue_position == 0  # the caller enqueues, after the step


@pytest.mark.parametrize("split", [True, False], ids=["split-bn-shuffled", "no-shuffle"])
def test_asymmetric_forward_by_hand(split):
    moco = _moco(split)
    hand = copy.deepcopy(moco)
    torch.manual_seed(1)
    im1, im2 = torch.randn(N, 3, 6, 6), torch.randn(N, 3, 6, 6)
    torch.manual_seed(5)
    logits, k = moco(im1, im2)
    torch.manual_seed(5)
    k2 = _hand_keys(hand, im2, torch.randperm(N) if split else None)
    q1 = F.normalize(hand.encoder_q(im1), dim=1)
    loss_12, acc_12 = _hand_loss(q1, k2, hand.queue)
    loss, acc = contrastive_loss(logits)
    torch.testing.assert_close(loss, loss_12, rtol=1e-6, atol=1e-6)
    assert acc == acc_12 and torch.equal(k, k2)


# ----------------------------------------------------------------------------- 2 gloo ranks
RANK_FLAGS = ["--device", "cpu", "--dataset", "digits", "--arch", "small_cnn", "--image-size", "16",
              "--batch-size", "8", "--accum-steps", "2", "--moco-k", "80", "--knn-every", "0",
              "--log-every", "1000", "--epochs", "1", "--symmetric", "--moco-m", "0.9",
              # every preset-dependent flag given, so the config is complete as parsed
              "--lr", "0.03", "--lr-schedule", "cosine", "--lr-milestones", "", "--moco-t", "0.2",
              "--mlp", "--aug", "v2"]
STEPS = 3


def _ranks_worker(info: DistInfo, tmp_dir: str) -> dict:
    cfg = parse_config(train_moco.MocoConfig, RANK_FLAGS + ["--out", tmp_dir])
    with RunSession(cfg) as session:
        run = train_moco.setup(cfg, session)
        return _ranks_checks(run, info)


def _ranks_checks(run, info: DistInfo) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    moco = run.moco
    rounds = {"bytes": 0}

    def counting_hook(state, bucket):
        rounds["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    run.network.register_comm_hook(None, counting_hook)
    ddp_forwards = rewrite_buffers_before_each_forward(run.network)  # torch 2.11's DDP, on any torch
    key_passes, crops, enqueued = [], [], []
    real_keys, real_forward, real_enqueue = moco.keys, moco.symmetric_forward, moco.enqueue

    def keys(im):
        k = real_keys(im)
        key_passes.append((im.clone(), k.clone()))
        return k

    def symmetric_forward(im_1, im_2, *args, **kwargs):
        crops.append((im_1.clone(), im_2.clone()))
        return real_forward(im_1, im_2, *args, **kwargs)

    def enqueue(keys):
        real_enqueue(keys)
        enqueued.append((keys.clone(), moco.queue_position, int(moco.queue_ptr)))

    moco.keys, moco.symmetric_forward, moco.enqueue = keys, symmetric_forward, enqueue
    run.cfg.max_steps = STEPS
    train_moco.train_one_epoch(run, start_training(run))
    del moco.keys, moco.symmetric_forward, moco.enqueue
    out = dict(queue=moco.queue.clone(), key_passes=key_passes, crops=crops, enqueued=enqueued,
               ddp_forwards=list(ddp_forwards),
               bytes_per_step=rounds["bytes"] / STEPS,
               grad_bytes=sum(p.numel() * p.element_size() for p in moco.encoder_q.parameters()),
               q=[p.detach().clone() for p in moco.encoder_q.parameters()],
               k=[p.clone() for p in moco.encoder_k.parameters()])

    # Both crops in one forward of the DDP module, one backward: the gradient is the ranks' mean of
    # the summed loss's gradient, which a plain copy of the module (no DDP) computes for this rank alone.
    torch.manual_seed(10 + info.rank)  # different images on each rank
    im1, im2 = torch.randn(8, 3, 16, 16), torch.randn(8, 3, 16, 16)
    moco.encoder_q.zero_grad(set_to_none=True)
    plain = copy.deepcopy(moco)  # the same shuffle count: the same permutations
    for model, encoder in ((moco, run.network), (plain, None)):
        *logits, _ = model.symmetric_forward(im1, im2, encoder)
        symmetric_contrastive_loss(*logits)[0].backward()
    out["ddp_grads"] = [p.grad.clone() for p in moco.encoder_q.parameters()]
    out["local_grads"] = [p.grad.clone() for p in plain.encoder_q.parameters()]
    return out


def test_queue_advances_by_both_key_sets_on_two_ranks_with_accumulation(tmp_path):
    ranks = run_on_ranks(_ranks_worker, tmp_path, str(tmp_path / "run"))
    r0 = ranks[0]
    per_micro = 2 * 2 * 8  # 2 crops x 2 ranks x batch 8
    micro_steps = 2 * STEPS
    assert len(r0["crops"]) == micro_steps and len(r0["key_passes"]) == 2 * micro_steps
    # One DDP forward per micro-step, of both crops, though every forward rewrote the buffers
    assert r0["ddp_forwards"] == [2] * micro_steps
    expected_window = []
    for micro, (im_1, im_2) in enumerate(r0["crops"]):
        (first_in, first_keys), (second_in, second_keys) = r0["key_passes"][2 * micro:2 * micro + 2]
        assert torch.equal(first_in, im_2) and torch.equal(second_in, im_1)  # the demo's order of passes
        assert first_keys.shape == second_keys.shape == (per_micro // 2, 128)
        expected_window.append(torch.cat([second_keys, first_keys]))  # crop 1's keys (every rank's) first
    # one enqueue per optimizer step, of the window's keys, already gathered
    assert [e[0].shape[0] for e in r0["enqueued"]] == [2 * per_micro] * STEPS
    pointers = []
    for step, (keys, ptr, ptr_buffer) in enumerate(r0["enqueued"]):
        assert torch.equal(keys, torch.cat(expected_window[2 * step:2 * step + 2]))
        pointers.append((ptr, ptr_buffer))
    assert pointers == [(2 * per_micro * s % 80,) * 2 for s in range(1, STEPS + 1)] == [(64, 64), (48, 48), (32, 32)]
    last = r0["enqueued"][-1][0]  # written from slot 48 on, wrapping around K=80
    assert torch.equal(r0["queue"][:, (48 + torch.arange(64)) % 80], last.T)
    for r in ranks[1:]:  # identical on both ranks: queue, keys, encoders
        assert torch.equal(r["queue"], r0["queue"])
        assert all(torch.equal(a[0], b[0]) for a, b in zip(r["enqueued"], r0["enqueued"]))
        assert all(torch.equal(a, b) for a, b in zip(r["q"] + r["k"], r0["q"] + r0["k"]))
    # Both crops, one backward: one all-reduce round per optimizer step, and the right gradient.
    assert r0["bytes_per_step"] == r0["grad_bytes"]
    for i, (g0, g1) in enumerate(zip(ranks[0]["ddp_grads"], ranks[1]["ddp_grads"])):
        assert torch.equal(g0, g1)
        mean = (ranks[0]["local_grads"][i] + ranks[1]["local_grads"][i]) / 2
        torch.testing.assert_close(g0, mean, rtol=1e-5, atol=1e-7)
    assert not torch.equal(ranks[0]["local_grads"][0], ranks[1]["local_grads"][0])  # the ranks differ


def rewrite_buffers_before_each_forward(ddp: DDP) -> list[int]:
    """Make every forward of ``ddp`` first copy rank 0's buffers into this rank's in place, as
    torch 2.11's DDP does (``broadcast_buffers=True``), which bumps their version counters; newer
    DDP leaves them alone. Returns the list that gets each forward's number of inputs."""
    forwards: list[int] = []

    def rewrite(module: DDP, inputs: tuple) -> None:
        with torch.no_grad():
            for buffer in module.module.buffers():
                rank0 = buffer.clone()
                dist.broadcast(rank0, src=0)
                buffer.copy_(rank0)
        forwards.append(len(inputs))

    ddp.register_forward_pre_hook(rewrite)
    return forwards


def _backward_after(crops: list[torch.Tensor], one_forward: bool, rewrite: bool) -> tuple[str, int]:
    """Forward ``crops`` through a fresh DDP module with BatchNorm in one call or one call each
    (``rewrite``: under :func:`rewrite_buffers_before_each_forward`), then one backward of the
    summed outputs. Returns the error message ("" when backward ran) and how often the forwards
    bumped the BatchNorm buffers' version."""
    ddp = DDP(_moco(split=False).encoder_q)
    if rewrite:
        rewrite_buffers_before_each_forward(ddp)
    running_mean = next(m for m in ddp.modules() if isinstance(m, nn.BatchNorm2d)).running_mean
    before = running_mean._version
    outputs = ddp(*crops) if one_forward else tuple(ddp(crop) for crop in crops)
    bumps = running_mean._version - before
    try:
        sum(out.sum() for out in outputs).backward()
    except RuntimeError as error:
        return str(error), bumps
    return "", bumps


def _two_forwards_worker(info: DistInfo) -> dict:
    torch.manual_seed(0)
    crops = [torch.randn(4, 3, 6, 6) for _ in range(2)]
    return {(rewrite, one_forward): _backward_after(crops, one_forward, rewrite)
            for rewrite in (False, True) for one_forward in (False, True)}


def test_two_ddp_forwards_before_one_backward_fail_where_ddp_rewrites_buffers(tmp_path):
    """The failure that one forward per micro-step avoids, on 2 gloo ranks: two forwards of a DDP
    module with BatchNorm before one backward fail exactly when DDP's forward rewrites the
    buffers in place (torch 2.11 does at every forward; 2.12 and newer do not), and always under
    the rewrite that torch 2.11 does; both crops in one forward never fail."""
    inplace = "modified by an inplace operation"
    for r in run_on_ranks(_two_forwards_worker, tmp_path):
        (two_error, two_bumps), (one_error, one_bumps) = r[False, False], r[False, True]
        if torch.__version__ < (2, 12):  # a TorchVersion: compares with tuples
            assert two_bumps == 2 and one_bumps == 1  # the cause, on the oldest supported torch
        assert (inplace in two_error) == (two_bumps > 0), two_error
        # the rewrite bumps once per forward, on top of whatever DDP does
        assert r[True, False][1] == two_bumps + 2 and r[True, True][1] == one_bumps + 1
        assert inplace in r[True, False][0]
        assert one_error == r[True, True][0] == ""  # one forward of both crops


# ----------------------------------------------------------------------------- real CLI
def test_symmetric_resume_is_bit_identical_on_two_ranks(symmetric_reference, tmp_path):
    stop, steps = 4, 10
    part = resume_folder(symmetric_reference.checkpoint(stop), tmp_path / "part")
    assert_ok(run_ranks("train_moco.py", SYMMETRIC_REF + ["--resume", "auto", "--out", str(part)], tmp_path))
    ref, res = symmetric_reference.final, load_ckpt(part / "checkpoint_last.pt")
    assert ref["step"] == steps
    assert_same_state(res, ref)  # queue, ptr, shuffles, encoders
    assert int(res["model"]["queue_ptr"]) == (steps * 2 * 2 * 2 * 16) % 200  # 2 crops x accum x ranks x batch
    assert int(res["model"]["shuffle_count"]) == steps * 2 * 2  # a key pass per crop and micro-step
    ref_tb, res_tb = read_scalars(symmetric_reference.out / "tb"), read_scalars(part / "tb")
    for tag in ("train/loss", "train/contrastive_acc1"):
        resumed = dict(res_tb[tag])
        assert [v for s, v in ref_tb[tag] if s > stop] == [resumed[s] for s, _ in ref_tb[tag] if s > stop], tag


def test_symmetric_queue_must_hold_both_key_sets(tmp_path, capsys):
    # global batch 32: K=48 holds one key set but not two
    args = ["--symmetric", "--moco-k", "48", "--batch-size", "32", "--device", "cpu", "--knn-every", "0"]
    try:
        code = train_moco.main(args + ["--out", str(tmp_path / "r")])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "with --symmetric (2 crops x world size 1 x accum steps 1 x batch 32 = 64)" in err[0]
    assert not (tmp_path / "r").exists()
    # K = exactly 2 x the global batch is enough: bf16 autocast around both directions, accumulation,
    # under anomaly detection
    out = tmp_path / "ok"
    assert train_moco.main(["--debug", "--symmetric", "--amp", "bf16", "--moco-k", "64", "--batch-size", "16",
                            "--accum-steps", "2", "--image-size", "16", "--max-steps", "2", "--device", "cpu",
                            "--knn-every", "0", "--out", str(out)]) == 0
    state = load_ckpt(out / "checkpoint_last.pt")["model"]
    assert int(state["queue_ptr"]) == (2 * 2 * 2 * 16) % 64 and state["queue"].dtype == torch.float32


def test_symmetric_reads_the_device_once_per_optimizer_step(monkeypatch, tmp_path):
    """Two key passes and two query forwards per micro-step add no read (tests/test_host_syncs.py)."""
    args = ["--device", "cpu", "--dataset", "digits", "--arch", "small_cnn", "--batch-size", "16",
            "--accum-steps", "2", "--max-steps", "3", "--log-every", "1000", "--epochs", "1", "--symmetric",
            "--moco-k", "512", "--knn-every", "0", "--out", str(tmp_path)]
    result = count_per_micro_step(train_moco.main, args, monkeypatch.setattr)
    assert result["code"] == 0
    assert result["per_micro_step"] == [0, 1, 0, 1, 0], result["events"]  # micro-steps 2..6 of 3 windows of 2
