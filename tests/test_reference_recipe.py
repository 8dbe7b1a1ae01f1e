"""train_classifier.py's torchvision recipe, step for step against torchvision's reference
semantics (pytorch/vision, references/classification: train.py and utils.py), written anew here in
plain torch: ``set_weight_decay``'s parameter groups, ``CrossEntropyLoss(label_smoothing=)``, a
LinearLR or ConstantLR warm-up handed to a CosineAnnealingLR by a SequentialLR stepped once per
epoch, and the ExponentialMovingAverage (an AveragedModel) with its decay adjustment, its update
every ``model_ema_steps`` iterations of an epoch and its reset during the warm-up epochs.

The project's side is the real script: ``train_classifier.main`` in this process, one rank,
asked for a checkpoint after every optimizer step (``--ckpt-every 1``), whose contents are kept in
memory instead of written; a forward pre-hook and the training criterion record the batches it
trained on and the loss of each micro-step, and the reference trains a fresh copy of the same
initial network on exactly those batches. After every step: the loss, every weight and
buffer, every EMA tensor and the LR and weight decay of every parameter group. A negative
control (norm layers decayed like the rest; no EMA reset in the warm-up) must fail the same
comparison. The same for a transformer (``--model vit_b_16``, built tiny) as torchvision's ViT
recipe trains it: AdamW, the class token's own group (--transformer-embedding-decay) and
--clip-grad-norm (a reference without either must fail). With --mixup-alpha/--cutmix-alpha the reference mixes the same micro-batches with
torchvision's v2.MixUp/CutMix/RandomChoice under the documented seeding contract (a whole-window
or index-free seeding must fail), and a 2-rank mixed run resumes mid-epoch bit for bit (slow
tier; tests/mixing_probe.py records its targets). Then the pieces at larger sizes: the schedule over 30 epochs, the groups on a
ResNet-18, each optimizer, the EMA's update, the EMA on 2 ranks, an EMA added on resume. (The
EMA restored bit for bit on a mid-epoch resume on 2 ranks: tests/test_training.py.)"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torchvision
from helpers import (
    TINY_DIGITS,
    assert_ok,
    assert_same_state,
    in_process,
    load_ckpt,
    resume_folder,
    run_on_ranks,
    run_ranks,
)
from torch import nn
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR
from torch.optim.swa_utils import AveragedModel
from torchvision.transforms import v2

import train_classifier
from ddp_utils import hashing
from ddp_utils.data.mixing import MIX_STREAM
from ddp_utils.models.backbones import build_model
from ddp_utils.train.ema import WeightsEMA, ema_decay
from ddp_utils.train.optimization import LRSchedule, build_optimizer, parameter_groups

TOLERANCE = 1e-6  # float32 round-off: rtol 0, atol this (most steps agree bit for bit)
BATCH, SAMPLES, EPOCHS, WARMUP_EPOCHS, EMA_STEPS, EMA_DECAY = 16, 96, 3, 1, 2, 0.999
LR, MOMENTUM, WEIGHT_DECAY, NORM_DECAY, BIAS_DECAY, SMOOTHING = 0.1, 0.9, 0.01, 0.0, 0.002, 0.1
RUN = ["--device", "cpu", "--dataset", "synthetic", "--synthetic-samples", str(SAMPLES), "--image-size", "8",
       "--arch", "small_cnn", "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--lr", str(LR),
       "--weight-decay", str(WEIGHT_DECAY), "--norm-weight-decay", str(NORM_DECAY), "--bias-weight-decay",
       str(BIAS_DECAY), "--label-smoothing", str(SMOOTHING), "--lr-schedule", "cosineannealinglr",
       "--lr-warmup-epochs", str(WARMUP_EPOCHS), "--model-ema", "--model-ema-steps", str(EMA_STEPS),
       "--model-ema-decay", str(EMA_DECAY), "--ckpt-every", "1", "--keep-checkpoints", "100", "--log-every", "100"]


# The transformer's run: the script is asked for --model vit_b_16 and build_network gets a ViT of
# torchvision's own class made tiny (one encoder layer of width 16 over 4 patches of 8 px; its
# class token, LayerNorms and biases fill all four groups), at 16 px: the configuration's size probe
# (backbones.input_refusal) builds the real vit_b_16 on the meta device, whose 16 px patches refuse 8 px.
VIT, VIT_SIZE, CLIP = "vit_b_16", 16, 0.8
TINY_VIT = dict(image_size=VIT_SIZE, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32)


def _replaced(args: list[str], flag: str, value: str, spelling: str | None = None) -> list[str]:
    """``args`` with ``flag``'s value replaced (the flag spelled ``spelling`` if given)."""
    i = args.index(flag)
    return [*args[:i], spelling or flag, value, *args[i + 2:]]


VIT_RUN = _replaced(_replaced(RUN, "--image-size", str(VIT_SIZE)), "--arch", VIT, "--model") + [
    "--opt", "adamw", "--transformer-embedding-decay", "0.0", "--clip-grad-norm", str(CLIP)]


def tiny_vit(num_classes: int) -> nn.Module:
    return torchvision.models.VisionTransformer(num_classes=num_classes, **TINY_VIT)


def build_tiny(arch: str, num_classes: int, image_size: int) -> nn.Module:
    """backbones.build_model, but :func:`tiny_vit` for vit_b_16 at VIT_SIZE."""
    return tiny_vit(num_classes) if (arch, image_size) == (VIT, VIT_SIZE) else build_model(arch, num_classes, image_size)


# ----------------------------------------------------------------------------- torchvision's semantics, anew
NORM_CLASSES = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
                nn.LocalResponseNorm)
# train.py's custom keys of --transformer-embedding-decay, in its order
TORCHVISION_EMBEDDING_KEYS = ("class_token", "position_embedding", "relative_position_bias_table")


def set_weight_decay(model: nn.Module, weight_decay: float, norm_weight_decay: float | None = None,
                     custom_keys_weight_decay: list[tuple[str, float]] | None = None) -> list[dict]:
    """torchvision's rule: walk the modules (own parameters, then each child's, with a dotted
    prefix); a custom key matches a parameter's own name (or its full name when the key has a
    dot) and wins; else a norm layer's parameter goes to "norm" when its decay is given; else
    "other". Groups in the order other, norm, custom keys; empty ones dropped."""
    keys = [key for key, _ in custom_keys_weight_decay or []]
    found: dict[str, list] = {"other": [], "norm": [], **{key: [] for key in keys}}
    decay = {"other": weight_decay, "norm": norm_weight_decay, **dict(custom_keys_weight_decay or [])}

    def walk(module: nn.Module, prefix: str) -> None:
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            key = next((k for k in keys if k == (f"{prefix}.{name}" if prefix and "." in k else name)), None)
            if key is not None:
                found[key].append(param)
            elif norm_weight_decay is not None and isinstance(module, NORM_CLASSES):
                found["norm"].append(param)
            else:
                found["other"].append(param)
        for child_name, child in module.named_children():
            walk(child, f"{prefix}.{child_name}" if prefix else child_name)

    walk(model, "")
    return [{"params": params, "weight_decay": decay[key]} for key, params in found.items() if params]


class ExponentialMovingAverage(AveragedModel):
    """torchvision's: ``decay * averaged + (1 - decay) * current`` over parameters and buffers."""

    def __init__(self, model: nn.Module, decay: float):
        def ema_avg(averaged, current, num_averaged):
            return decay * averaged + (1 - decay) * current

        super().__init__(model, torch.device("cpu"), ema_avg, use_buffers=True)


def reference_schedule(optimizer, epochs: int, warmup_epochs: int, method: str = "linear", decay: float = 0.01):
    """train.py's: CosineAnnealingLR(T_max = epochs - warmup), after a LinearLR / ConstantLR warm-up."""
    main = CosineAnnealingLR(optimizer, T_max=epochs - warmup_epochs, eta_min=0.0)
    if not warmup_epochs:
        return main
    warm = (LinearLR(optimizer, start_factor=decay, total_iters=warmup_epochs) if method == "linear" else
            ConstantLR(optimizer, factor=decay, total_iters=warmup_epochs))
    return SequentialLR(optimizer, schedulers=[warm, main], milestones=[warmup_epochs])


def train_reference(model: nn.Module, epochs: list[list[tuple]], optimizer: str = "sgd", accum: int = 1,
                    norm_decay: float | None = NORM_DECAY, reset_in_warmup: bool = True,
                    embedding_decay: float | None = None, clip: float | None = None) -> list[dict]:
    """torchvision's train_one_epoch and epoch loop on ``epochs`` (each a list of (images, targets)
    micro-batches), one iteration per window of ``accum`` micro-batches (the project's accumulation:
    each micro-batch's loss / accum back-propagated at once); a record after every optimizer step.
    ``embedding_decay``: train.py's --transformer-embedding-decay, a custom key per embedding name
    after the bias's; ``clip``: its --clip-grad-norm, ``clip_grad_norm_`` of every trainable
    parameter after the backward and before the step. torchvision hands it ``model.parameters()``;
    here the same parameters go in the optimizer's order, the script's, as the norm is a sum whose
    order is round-off only, and a ViT's attention key bias (the softmax cancels its gradient: pure
    round-off, which AdamW's normalisation turns into steps of the LR's size) makes a one-ulp
    difference in the clip's coefficient a difference of 1e-2 in the weights within a few steps. The
    record keeps the norm clipped and ``model.parameters()``'s (``torchvision_norm``), to be compared."""
    criterion = nn.CrossEntropyLoss(label_smoothing=SMOOTHING)
    custom_keys = [("bias", BIAS_DECAY)]
    if embedding_decay is not None:
        custom_keys += [(key, embedding_decay) for key in TORCHVISION_EMBEDDING_KEYS]
    params = set_weight_decay(model, WEIGHT_DECAY, norm_decay, custom_keys)
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=False)
    else:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SequentialLR's own step(0) of the main schedule at the milestone
        scheduler = reference_schedule(opt, EPOCHS, WARMUP_EPOCHS)
    adjust = 1 * (accum * BATCH) * EMA_STEPS / EPOCHS  # world_size x per-GPU batch of one iteration
    alpha = min(1.0, (1.0 - EMA_DECAY) * adjust)
    ema = ExponentialMovingAverage(model, decay=1.0 - alpha)
    records = []
    for epoch, batches in enumerate(epochs):
        model.train()
        for i in range(len(batches) // accum):
            opt.zero_grad()
            losses = []
            for images, targets in batches[i * accum:(i + 1) * accum]:
                loss = criterion(model(images), targets)
                (loss / accum).backward()
                losses.append(loss.detach().clone())
            norm = torchvision_norm = None
            if clip is not None:
                torchvision_norm = nn.utils.get_total_norm([p.grad for p in model.parameters()])  # its clip's norm
                norm = nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip)
            lrs = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
            opt.step()
            if i % EMA_STEPS == 0:
                ema.update_parameters(model)
                if reset_in_warmup and epoch < WARMUP_EPOCHS:
                    ema.n_averaged.fill_(0)  # "Reset ema buffer to keep copying weights during warmup period"
            records.append({"losses": losses, "groups": lrs, "model": _copy(model.state_dict()),
                            "ema": _copy(ema.state_dict()), "grad_norm": norm, "torchvision_norm": torchvision_norm})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scheduler.step()
    return records


def reference_mixing(mixup_alpha: float, cutmix_alpha: float, num_classes: int):
    """train.py's batch transform: v2.MixUp and/or v2.CutMix, v2.RandomChoice of the two when both."""
    chosen = [v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha else []
    chosen += [v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha else []
    return v2.RandomChoice(chosen) if len(chosen) == 2 else chosen[0]


def mix_seed_contract(epoch: int, index: int, rank: int = 0, seed: int = 0) -> int:
    """The documented seeding contract (docs/recipe.md): the CPU generator seeded from the run's
    seed, a stream tag, the epoch, the micro-batch's index in the epoch and the rank."""
    return hashing.seed(seed, MIX_STREAM, epoch, index, rank)


def mix_reference_batches(epochs: list[list[tuple]], accum: int, transform, key=mix_seed_contract,
                          whole_window: bool = False) -> list[list[tuple]]:
    """Each epoch's micro-batches mixed by ``transform`` as torchvision's collate mixes a per-GPU
    batch: one call per micro-batch, the global RNG seeded with ``key(epoch, index)`` before it.
    ``whole_window`` (a negative control): the window's micro-batches mixed as one batch instead."""
    mixed = []
    for epoch, batches in enumerate(epochs):
        out = []
        for first in range(0, len(batches), accum):
            window = batches[first:first + accum]
            if whole_window:
                torch.manual_seed(key(epoch, first))
                images, targets = transform(torch.cat([x for x, _ in window]), torch.cat([t for _, t in window]))
                out += list(zip(images.chunk(len(window)), targets.chunk(len(window))))
                continue
            for index, (images, targets) in enumerate(window, start=first):
                torch.manual_seed(key(epoch, index))
                out.append(transform(images, targets))
        mixed.append(out)
    return mixed


def _copy(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


# ----------------------------------------------------------------------------- the project's side
def run_project(tmp_path, monkeypatch, capsys, extra: list[str], unmixed: list | None = None, run: list[str] = RUN
                ) -> tuple[list, list, dict[int, dict]]:
    """train_classifier.main on one rank (``run`` + ``extra``): the micro-batches it trained on, in
    order, each micro-step's loss, and what the checkpoint of every step holds (weights, EMA,
    parameter groups). ``unmixed``: gets each micro-batch as it reached the mixer (images, targets,
    epoch, index in the epoch, rank). Asked for vit_b_16, build_network builds :func:`tiny_vit`."""
    inputs, targets_and_losses, checkpoints = [], [], {}
    build = train_classifier.build_network
    criterion_of = train_classifier.training_criterion
    mixer_of = train_classifier.batch_mixer

    def recording_mixer(cfg, num_classes, rank):
        mix = mixer_of(cfg, num_classes, rank)

        def spy(images, targets, epoch, index):
            if unmixed is not None:
                unmixed.append((images.clone(), targets.clone(), epoch, index, rank))
            return mix(images, targets, epoch, index)
        return spy

    def keep_checkpoint(run):  # what save_checkpoint puts in the file, kept here (writing 18 files is slow)
        checkpoints[run.state.step] = {"step": run.state.step, "facts": run.facts, "model": _copy(run.model.state_dict()),
                                       "optimizer": {"param_groups": [dict(g, params=None)
                                                                      for g in run.optimizer.param_groups]},
                                       **({"model_ema": _copy(run.ema.state_dict())} if run.ema is not None else {})}

    def recording_network(cfg, info, num_classes, image_size):
        model = build(cfg, info, num_classes, image_size)
        model.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone())
                                        if module.training else None)
        return model

    def recording_criterion(cfg):
        real = criterion_of(cfg)

        def loss(logits, targets):
            value = real(logits, targets)
            targets_and_losses.append((targets.detach().clone(), value.detach().clone()))
            return value
        return loss

    monkeypatch.setattr(train_classifier, "build_model", build_tiny)  # the name build_network calls
    monkeypatch.setattr(train_classifier, "build_network", recording_network)
    monkeypatch.setattr(train_classifier, "training_criterion", recording_criterion)
    monkeypatch.setattr(train_classifier, "save_checkpoint", keep_checkpoint)
    monkeypatch.setattr(train_classifier, "batch_mixer", recording_mixer)
    assert train_classifier.main(run + extra + ["--out", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    batches = [(x, t) for x, (t, _) in zip(inputs, targets_and_losses)]
    return batches, [loss for _, loss in targets_and_losses], checkpoints


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((x.double() - y.double()).abs().max().item() for x, y in zip(a.values(), b.values())), default=0.0)


def compare(records: list[dict], losses: list, checkpoints: dict[int, dict], accum: int) -> dict[str, float]:
    """The largest difference of each kind over every step ("decays": 1 where a step's groups had
    other weight decays); asserts nothing about them itself."""
    worst = {"loss": 0.0, "model": 0.0, "ema": 0.0, "lr": 0.0, "decays": 0.0}
    assert sorted(checkpoints) == list(range(1, len(records) + 1))
    for step, record in enumerate(records, start=1):
        ckpt = checkpoints[step]
        mine = losses[(step - 1) * accum:step * accum]
        worst["loss"] = max([worst["loss"], *((a - b).abs().item() for a, b in zip(mine, record["losses"]))])
        worst["model"] = max(worst["model"], _largest_difference(ckpt["model"], record["model"]))
        worst["ema"] = max(worst["ema"], _largest_difference(ckpt["model_ema"], record["ema"]))
        groups = [(g["lr"], g["weight_decay"]) for g in ckpt["optimizer"]["param_groups"]]
        if [d for _, d in groups] != [d for _, d in record["groups"]]:  # each group's decay, exactly
            worst["decays"] = 1.0
        worst["lr"] = max([worst["lr"], *(abs(a - b) / b for (a, _), (b, _) in zip(groups, record["groups"]))])
    return worst


@pytest.mark.parametrize("model, optimizer, accum", [("small_cnn", "sgd", 1), ("small_cnn", "adamw", 2),
                                                     (VIT, "adamw", 1)])
def test_the_recipe_trains_as_torchvisions_reference_step_for_step(tmp_path, monkeypatch, capsys, model, optimizer,
                                                                   accum):
    """3 epochs on one rank: label smoothing, no decay on norm layers, its own decay on biases, a
    1-epoch linear warm-up from 0.01 then a per-epoch cosine, the EMA every 2 steps. A small CNN
    (BatchNorm, biases: all three parameter groups non-empty) with SGD one micro-batch per step (the
    reference's iteration), and with AdamW and 2 micro-batches per step (the EMA counts optimizer
    steps and its decay uses the global batch of 32). A transformer (``--model vit_b_16``, built
    tiny: VIT_RUN) as torchvision's ViT recipe trains it: ``--opt adamw``, a fourth group for the
    class token (``--transformer-embedding-decay 0``, torchvision's custom keys) and the gradient
    clipped to norm CLIP before each step (``--clip-grad-norm``; some steps' norms are above it,
    some below), one micro-batch per step; a reference without the class token's group, or without
    the clip, fails the comparison."""
    vit = model == VIT
    extra = (["--optimizer", "adamw"] if optimizer == "adamw" and not vit else []) + ["--accum-steps", str(accum)]
    batches, losses, checkpoints = run_project(tmp_path, monkeypatch, capsys, extra, run=VIT_RUN if vit else RUN)
    per_epoch = SAMPLES // BATCH
    assert len(batches) == EPOCHS * per_epoch and len(checkpoints) == EPOCHS * per_epoch // accum
    epochs = [batches[e * per_epoch:(e + 1) * per_epoch] for e in range(EPOCHS)]
    num_classes = checkpoints[1]["facts"]["num_classes"]
    size, head = (VIT_SIZE, "heads.head.weight") if vit else (8, "fc.weight")
    assert batches[0][0].shape[-2:] == (size, size)
    transformer = dict(embedding_decay=0.0, clip=CLIP) if vit else {}

    def fresh() -> nn.Module:  # the script's initial network: seeded as build_network seeds it
        torch.manual_seed(0)
        return build_tiny(model, num_classes, size)

    records = train_reference(fresh(), epochs, optimizer, accum, **transformer)
    worst = compare(records, losses, checkpoints, accum)
    assert all(value <= TOLERANCE for key, value in worst.items() if key != "lr"), worst
    assert worst["lr"] < 1e-12, worst  # the recursive schedulers' float64 round-off only
    lrs = [checkpoints[s]["optimizer"]["param_groups"][0]["lr"] for s in sorted(checkpoints)]
    steps = per_epoch // accum
    assert lrs[:steps] == [LR * 0.01] * steps and lrs[steps] == LR and lrs[-1] == pytest.approx(LR / 2)
    ema = checkpoints[len(checkpoints)]["model_ema"]
    assert int(ema["n_averaged"]) == 2 * math.ceil(steps / EMA_STEPS)  # counted since the warm-up's last reset
    assert not torch.equal(ema[f"module.{head}"], checkpoints[len(checkpoints)]["model"][head])

    # negative controls: the same comparison fails for a reference that decays the norm layers, and
    # for one that does not reset the EMA during the warm-up
    wrong = compare(train_reference(fresh(), epochs, optimizer, accum, norm_decay=None, **transformer), losses,
                    checkpoints, accum)
    assert wrong["model"] > 100 * TOLERANCE and wrong["decays"], wrong
    wrong = compare(train_reference(fresh(), epochs, optimizer, accum, reset_in_warmup=False, **transformer), losses,
                    checkpoints, accum)
    assert wrong["model"] <= TOLERANCE < wrong["ema"], wrong
    if not vit:
        return
    # the transformer's groups: torchvision's, the class token in its own (its pos_embedding matches no key)
    groups = checkpoints[1]["optimizer"]["param_groups"]
    assert [(g["group"], g["weight_decay"]) for g in groups] == [("other", WEIGHT_DECAY), ("norm", NORM_DECAY),
                                                                 ("bias", BIAS_DECAY), ("class_token", 0.0)]
    norms = [record["grad_norm"].item() for record in records]
    assert 0 < sum(norm > CLIP for norm in norms) < len(norms), norms  # steps clipped and steps left alone
    assert all(r["grad_norm"].item() == pytest.approx(r["torchvision_norm"].item(), rel=1e-6) for r in records)
    # ... and fails for a reference without the embedding group (the class token decayed as the
    # other weights), and for one that does not clip
    wrong = compare(train_reference(fresh(), epochs, optimizer, accum, clip=CLIP), losses, checkpoints, accum)
    assert wrong["model"] > 100 * TOLERANCE and wrong["decays"], wrong
    wrong = compare(train_reference(fresh(), epochs, optimizer, accum, embedding_decay=0.0), losses, checkpoints,
                    accum)
    assert wrong["model"] > 100 * TOLERANCE and not wrong["decays"], wrong


@pytest.mark.parametrize("mixup, cutmix", [(0.2, 1.0), (0.4, 0.0)])
def test_mixup_and_cutmix_are_torchvisions_on_each_micro_batch(tmp_path, monkeypatch, capsys, mixup, cutmix):
    """The recipe above with --mixup-alpha/--cutmix-alpha and 2 micro-batches per step: the reference
    mixes the same micro-batches with torchvision's v2.MixUp/CutMix (RandomChoice of the two when
    both are on), one call per micro-batch, seeded by the documented contract. The mixed images and
    soft targets the script trained on are the reference's bit for bit, then the loss (label smoothing
    on top of the soft targets), every weight and the EMA after every step. Negative controls: mixing a
    whole window as one batch, or seeding without the micro-batch's index, fails the comparison."""
    accum, unmixed = 2, []
    extra = ["--accum-steps", str(accum), "--mixup-alpha", str(mixup), "--cutmix-alpha", str(cutmix)]
    batches, losses, checkpoints = run_project(tmp_path, monkeypatch, capsys, extra, unmixed)
    per_epoch = SAMPLES // BATCH
    assert [(e, i, r) for _, _, e, i, r in unmixed] == [(e, i, 0) for e in range(EPOCHS) for i in range(per_epoch)]
    assert all(t.dtype == torch.int64 for _, t, *_ in unmixed)  # integer targets reach the mixer
    epochs = [[(x, t) for x, t, *_ in unmixed[e * per_epoch:(e + 1) * per_epoch]] for e in range(EPOCHS)]
    num_classes = checkpoints[1]["facts"]["num_classes"]
    transform = reference_mixing(mixup, cutmix, num_classes)
    mixed = mix_reference_batches(epochs, accum, transform)
    flat = [batch for epoch in mixed for batch in epoch]
    for (x, t), (ref_x, ref_t) in zip(batches, flat, strict=True):
        assert torch.equal(x, ref_x) and torch.equal(t, ref_t)
    assert all(t.shape == (BATCH, num_classes) for _, t in batches)
    # soft targets, a lambda of each micro-batch's own (CutMix's box may miss an 8 x 8 image: lambda 1)
    soft = [tuple(t.unique().tolist()) for _, t in batches if ((t > 0) & (t < 1)).any()]
    assert len(set(soft)) == len(soft) > 0.75 * len(batches), soft

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return build_model("small_cnn", num_classes, 8)

    worst = compare(train_reference(fresh(), mixed, "sgd", accum), losses, checkpoints, accum)
    assert all(value <= TOLERANCE for key, value in worst.items() if key != "lr"), worst
    for wrong_batches in (mix_reference_batches(epochs, accum, transform, whole_window=True),
                          mix_reference_batches(epochs, accum, transform, key=lambda e, i: mix_seed_contract(e, 0))):
        wrong = compare(train_reference(fresh(), wrong_batches, "sgd", accum), losses, checkpoints, accum)
        assert wrong["loss"] > 100 * TOLERANCE and wrong["model"] > 100 * TOLERANCE, wrong


MIXED_ON_TWO_RANKS = TINY_DIGITS + ["--lr", "0.05", "--epochs", "1", "--max-steps", "8", "--mixup-alpha", "0.2",
                                    "--cutmix-alpha", "1.0", "--label-smoothing", "0.1", "--model-ema",
                                    "--model-ema-steps", "3"]


def _lambdas(seen: dict) -> dict:
    """Each micro-batch's lambda: the soft target's weight on an image's own class, read where the
    image before it has another class."""
    out = {}
    for key, (labels, soft) in seen.items():
        b = next(b for b in range(len(labels)) if labels[b] != labels[b - 1])
        out[key] = soft[b, labels[b]].item()
    return out


@pytest.mark.slow
@pytest.mark.torch_versions  # a 2-rank resume, exact: RNG streams and state through torch.save and torch.load
def test_mixing_on_two_ranks_resumes_mid_epoch_bit_for_bit(tmp_path):
    """2 ranks x 2 micro-batches per step with MixUp and CutMix, 8 steps; step 5's checkpoint (10
    micro-batches into the epoch) resumed to step 8: every later micro-batch is mixed as in the
    uninterrupted run (the same soft targets), and weights, momentum and EMA end equal bit for bit.
    The two ranks draw lambdas of their own for the same micro-batch of the epoch."""
    full, part = tmp_path / "full", tmp_path / "part"
    assert_ok(run_ranks("mixing_probe.py", [str(tmp_path / "full_mixed"), *MIXED_ON_TWO_RANKS, "--ckpt-every", "1",
                                            "--keep-checkpoints", "100", "--out", str(full)], tmp_path))
    step5 = next(p for p in full.glob("checkpoint_*.pt") if load_ckpt(p)["step"] == 5)
    resume_folder(step5, part)
    proc = run_ranks("mixing_probe.py", [str(tmp_path / "part_mixed"), *MIXED_ON_TWO_RANKS, "--resume", "auto",
                                         "--out", str(part)], tmp_path)
    assert_ok(proc)
    assert "step 5, in epoch 1, 10 batches into the epoch" in proc.stdout
    assert_same_state(load_ckpt(part / "checkpoint_last.pt"), load_ckpt(full / "checkpoint_last.pt"))
    for rank in (0, 1):
        whole = torch.load(tmp_path / f"full_mixed.rank{rank}.pt")
        resumed = torch.load(tmp_path / f"part_mixed.rank{rank}.pt")
        assert sorted(whole) == [(0, i) for i in range(16)] and sorted(resumed) == [(0, i) for i in range(10, 16)]
        assert all(torch.equal(resumed[key][1], whole[key][1]) for key in resumed)
    rank0 = _lambdas(torch.load(tmp_path / "full_mixed.rank0.pt"))
    rank1 = _lambdas(torch.load(tmp_path / "full_mixed.rank1.pt"))
    assert sum(rank0[key] != rank1[key] for key in rank0) >= len(rank0) - 1, (rank0, rank1)
    assert len(set(rank0.values())) >= len(rank0) - 1  # and each micro-batch its own


# ----------------------------------------------------------------------------- the pieces, at larger sizes
@pytest.mark.parametrize("method", ["linear", "constant"])
@pytest.mark.parametrize("warmup_epochs", [0, 1, 5])
def test_the_lr_of_every_step_is_torchvisions_epoch_stepped_schedule(method, warmup_epochs):
    """LRSchedule's cosineannealinglr, as a function of the optimizer step, against SequentialLR /
    LinearLR / ConstantLR / CosineAnnealingLR stepped once per epoch over 30 epochs of 7 steps: the
    same LR through every step of each epoch (to float64 round-off of the recursive schedulers)."""
    epochs, steps = 30, 7
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler = reference_schedule(opt, epochs, warmup_epochs, method, decay=0.25)
        per_epoch = []
        for _ in range(epochs):
            per_epoch.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
    schedule = LRSchedule(0.8, "cosineannealinglr", epochs * steps, steps_per_epoch=steps, warmup_epochs=warmup_epochs,
                          warmup_method=method, warmup_decay=0.25)
    ours = [schedule(step) for step in range(epochs * steps)]
    assert ours == pytest.approx([lr for lr in per_epoch for _ in range(steps)], rel=1e-12, abs=1e-15)
    assert ours[0] == (0.8 * 0.25 if warmup_epochs else 0.8) and ours[-1] > 0  # the last epoch above 0
    assert ours[warmup_epochs * steps] == 0.8  # the cosine starts at the peak after the warm-up


def test_parameter_groups_are_set_weight_decays():
    """Over a ResNet-18 with a frozen stem and a head with LayerNorm and GroupNorm: the same
    parameters in the same order in each group, with the same decays, for every combination."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    model.fc = nn.Sequential(nn.LayerNorm(512), nn.Linear(512, 64), nn.GroupNorm(4, 64), nn.Linear(64, 10))
    model.conv1.requires_grad_(False)
    for norm, bias in [(None, None), (0.0, None), (None, 0.0), (0.0, 1e-5), (3e-5, 0.0)]:
        ours = parameter_groups(model, 1e-4, norm, bias)
        theirs = set_weight_decay(model, 1e-4, norm, [("bias", bias)] if bias is not None else None)
        assert [[id(p) for p in g["params"]] for g in ours] == [[id(p) for p in g["params"]] for g in theirs]
        if norm is None and bias is None:
            assert len(ours) == 1 and "weight_decay" not in ours[0]  # today's single group: the optimizer's decay
        else:
            assert [g["weight_decay"] for g in ours] == [g["weight_decay"] for g in theirs]
    assert id(model.conv1.weight) not in {id(p) for g in parameter_groups(model, 1e-4, 0.0) for p in g["params"]}


@pytest.mark.parametrize("kind", ["sgd", "sgd-nesterov", "rmsprop", "adamw"])
def test_each_optimizer_is_torchvisions(kind):
    """Three steps of each optimizer as build_optimizer makes it (foreach) and as torchvision's
    train.py builds it (--opt sgd, sgd_nesterov, rmsprop, adamw), over two parameter groups."""
    torch.manual_seed(0)
    weights = [torch.randn(5, 4), torch.randn(4)]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    results = []
    for ours in (True, False):
        params = [nn.Parameter(w.clone()) for w in weights]
        groups = [{"params": params[:1], "weight_decay": 1e-2}, {"params": params[1:], "weight_decay": 0.0}]
        if ours:
            opt = build_optimizer(kind.split("-")[0], groups, 0.05, 0.9, 1e-2, torch.device("cpu"),
                                  nesterov=kind == "sgd-nesterov")
        elif kind.startswith("sgd"):
            opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov="nesterov" in kind)
        elif kind == "rmsprop":
            opt = torch.optim.RMSprop(groups, lr=0.05, momentum=0.9, weight_decay=1e-2, eps=0.0316, alpha=0.9)
        else:
            opt = torch.optim.AdamW(groups, lr=0.05, weight_decay=1e-2)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=TOLERANCE)


def test_the_ema_update_is_averagedmodels_bit_for_bit():
    """WeightsEMA's multi-tensor update without device reads against torchvision's AveragedModel
    (``avg_fn``, ``use_buffers=True``) on a network with BatchNorm (its integer counter included),
    through copies, averages and a warm-up reset; and the decay adjustment's arithmetic."""
    torch.manual_seed(0)
    model = build_model("small_cnn", 10, 8)
    decay = ema_decay(0.99998, 8 * 2 * 128, 32, 600)
    assert decay == 1.0 - min(1.0, (1.0 - 0.99998) * (8 * 2 * 128 * 32 / 600))
    ours, theirs = WeightsEMA(model, decay=0.9), ExponentialMovingAverage(model, decay=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(6):
        model(torch.randn(4, 3, 8, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for ema in (ours, theirs):
            ema.update_parameters(model)
            if step == 2:
                ema.n_averaged.fill_(0)
        for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
            assert torch.equal(a, b), (step, name)
    assert not any(p.requires_grad for p in ours.parameters()) and ours.n_averaged.device.type == "cpu"


def _two_emas_on_a_rank(info) -> dict:
    """A DDP small CNN on this rank's own batches, with two EMAs updated after every step: one as
    the script's (rank 0's BatchNorm statistics broadcast), one without the broadcast."""
    torch.manual_seed(0)
    model = build_model("small_cnn", 10, 8)
    network = nn.parallel.DistributedDataParallel(model)
    synced, own = WeightsEMA(model, decay=0.9), WeightsEMA(model, decay=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1 + info.rank)  # each rank its own batches
    for step in range(3):
        network(torch.randn(4, 3, 8, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        synced.after_step(model, step, 0, step, distributed=True)
        own.after_step(model, step, 0, step, distributed=False)
    return {"synced": _copy(synced.state_dict()), "own": _copy(own.state_dict()), "model": _copy(model.state_dict())}


def test_the_ema_is_identical_on_two_ranks_after_every_update(tmp_path):
    """Each rank's BatchNorm statistics after a step are its own batches' (DDP gives every rank
    rank 0's only at the next forward): the EMA takes rank 0's after each update and is the same on
    both ranks, bit for bit; without that broadcast its statistics would differ."""
    rank0, rank1 = run_on_ranks(_two_emas_on_a_rank, tmp_path)
    assert all(torch.equal(a, rank1["synced"][name]) for name, a in rank0["synced"].items())
    assert not torch.equal(rank0["synced"]["module.fc.weight"], rank0["model"]["fc.weight"])  # an average
    differs = [name for name, a in rank0["own"].items() if not torch.equal(a, rank1["own"][name])]
    assert differs and all("running" in name for name in differs), differs
    assert any(not torch.equal(a, rank1["model"][name]) for name, a in rank0["model"].items() if "running" in name)


def test_an_ema_added_on_resume_starts_from_the_resumed_weights(tmp_path, capsys):
    """A checkpoint of a run without --model-ema resumed with it (--allow-changes): the EMA is the
    checkpoint's weights, to be copied again at its first update, not the network's initial ones."""
    tiny = RUN[:RUN.index("--weight-decay")] + ["--max-steps", "2"]
    out = tmp_path / "run"
    assert train_classifier.main(tiny + ["--out", str(out)]) == 0
    before = load_ckpt(out / "checkpoint_last.pt")
    proc = in_process(train_classifier.main, tiny + ["--max-steps", "3", "--model-ema", "--resume", "auto",
                                                     "--allow-changes", "--out", str(out)], capsys)
    assert proc.returncode == 0 and "holds no EMA of the weights: the EMA starts from the resumed weights" in proc.stdout
    after = load_ckpt(out / "checkpoint_last.pt")
    assert after["step"] == 3 and int(after["model_ema"]["n_averaged"]) == 0  # step 3 is not an update's
    assert all(torch.equal(after["model_ema"][f"module.{k}"], v) for k, v in before["model"].items())
