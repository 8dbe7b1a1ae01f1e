"""MoCo v1/v2 self-supervised pretraining with DistributedDataParallel.

The bare command learns on the embedded digits (scikit-learn's, no download) with their own
defaults (16 px, batch 32, K 256, m 0.99, LR 0.06, 15 epochs, kNN every 5 epochs): about a
minute on 2 CPU cores, kNN accuracy about 10 points above its step-0 value; flags override them:
    torchrun --nproc_per_node=4 train_moco.py --out runs/moco_digits

One process (CPU or one GPU; BatchNorm is split into --bn-splits groups to emulate shuffle BN):
    python train_moco.py --out runs/moco_digits

The MoCo authors' CIFAR-10 demo, exactly (recipes/: one GPU, batch 512, split BN groups of 64):
    python train_moco.py --config recipes/moco_cifar10_demo.json --data-dir ./data --download

One node, every GPU (the same recipe on 8 GPUs x 64: BatchNorm groups of 64 again):
    torchrun --standalone --nproc_per_node=8 train_moco.py --config recipes/moco_cifar10_demo.json \\
        --batch-size 64 --bn-splits 1 --data-dir ./data --download

Several nodes, ImageNet, MoCo v2 (run on every node; HOST is node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        train_moco.py --preset v2 --dataset imagefolder --data-dir /data/imagenet --arch resnet50 \\
        --batch-size 16 --epochs 200 --knn-every 10 --knn-bank-samples 128000 --out runs/mocov2_in1k

SLURM (see launch/): sbatch /path/to/repo/launch/slurm_moco.sbatch --preset v2 ...
Resume: add --resume auto (same --out); the queue, its pointer and encoder_k come back exactly.
Repeat any run: --config RUN/config.json --out NEW (recipes/*.json are such files too).
A fresh run refuses an --out that holds a checkpoint; --overwrite starts over there.
Exit codes: 0 done or preempted, 1 crash, 2 bad input, 3 NaN/Inf loss, 75 the object store did not
answer (a restart waits for it and resumes), 130 Ctrl-C. From a bucket, 2 also means a fault no restart
fixes (access refused, no such bucket, a shard changed or gone, a full cache disk): do what the line
says, then add --resume auto (docs/data.md#shards-in-an-object-store-s3).
Export the query backbone for torchvision / train_classifier.py --pretrained:
    python train_moco.py ... --resume auto --export-backbone runs/moco_cifar10_demo/backbone.pt

--batch-size is per rank and per micro-step; the global batch is world_size x --accum-steps x
--batch-size. --lr is used as given (MoCo: 0.03 for a global batch of 256). On CUDA the defaults
take the fast path (bf16 autocast, channels_last, fused SGD, TF32); add --compile for more.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ddp_utils.config import UsageError, opt
from ddp_utils.data.pipeline import build_data
from ddp_utils.data.preview import augmentation_grid
from ddp_utils.data.recipes import MOCO_AUGS, moco_recipe
from ddp_utils.eval.knn import knn_accuracy
from ddp_utils.models.backbones import (
    HEADED_BACKBONES,
    SMALL_NETS,
    build_model,
    head_of,
    is_timm,
    model_names,
    without_head,
)
from ddp_utils.models.moco import Encoder, MoCo, contrastive_step
from ddp_utils.models.shuffle_bn import split_batchnorm
from ddp_utils.runtime.collectives import all_ranks_agree, check_replicas_identical, sync_buffers_from_rank0
from ddp_utils.runtime.device import place_model, to_device
from ddp_utils.runtime.dist import DistInfo, barrier, wrap_network
from ddp_utils.runtime.launch import LaunchEnv
from ddp_utils.runtime.precision import autocast
from ddp_utils.train.accumulation import fp16_overflow, no_sync, set_lr, stepped_parameters
from ddp_utils.train.check import check_only
from ddp_utils.train.monitor import StepMeter
from ddp_utils.train.optimization import LR_SCHEDULES, build_optimization, cosine_to_one
from ddp_utils.train.preflight import preflight
from ddp_utils.train.pretrained import export_backbone
from ddp_utils.train.resume import state_to_start_from, stop_if_complete
from ddp_utils.train.run import (
    TrainRun,
    ends_the_run,
    is_complete,
    save_checkpoint,
    skip_or_stop_nonfinite,
    start_training,
    stop_for_signal,
)
from ddp_utils.train.run_folder import open_run_folder
from ddp_utils.train.session import RunSession
from ddp_utils.train.train_config import (
    MODEL,
    OUT_HELP,
    RUN_FOLDER,
    ScriptData,
    TrainConfig,
    check_sync_bn,
    data_plan,
    parse_args,
)
from ddp_utils.train.unreadable_files import stop_if_files_unreadable

log = logging.getLogger("train")
SCRIPT = "train_moco.py"

# What differs between the papers. --preset picks one as the defaults of these flags; a
# --config file and the command line override them (ddp_utils.config.parse_config).
PRESETS = {
    "v1": dict(lr_schedule="step", lr_milestones="60%,80%", moco_t=0.07, mlp=False, aug="v1"),
    "v2": dict(lr_schedule="cosine", lr_milestones="", moco_t=0.2, mlp=True, aug="v2"),
}

# The embedded data set's own defaults, over the preset's and the fields' ImageNet values, so that
# the bare command shows MoCo learning in a minute: a queue of 65,536 would hold 45 stale keys of
# each of digits' 1,438 training images (256 still takes 8 ranks x 32), m = 0.999 barely moves the
# key encoder in a few hundred steps, and one process splits its batch of 32 into 2 BatchNorm
# groups, not 8 groups of 4. A --config file and flags override them.
DATASET_DEFAULTS = {
    "digits": dict(image_size=16, batch_size=32, epochs=15, lr=0.06, moco_k=256, moco_m=0.99, bn_splits=2,
                   knn_every=5),
}


MOCO, KNN = "MoCo", "kNN monitor"  # --help's sections of this script's own flags
DEFAULT = PRESETS["v2"]  # the fields' defaults of the flags a preset sets


@dataclass
class MocoConfig(TrainConfig):
    PRESETS: ClassVar[dict[str, dict]] = PRESETS
    DATASET_DEFAULTS: ClassVar[dict[str, dict]] = DATASET_DEFAULTS
    SECTIONS: ClassVar[tuple[str, ...]] = (*TrainConfig.SECTIONS, MOCO, KNN)
    VIEWS: ClassVar[int] = 2  # the query's and the key's

    preset: str = opt("v2", "the defaults of the flags whose help names a preset, as the MoCo v1 or v2 paper "
                      "set them; a --config file and flags override them", choices=tuple(PRESETS))
    out: str = opt("runs/moco", OUT_HELP, group=RUN_FOLDER, on_resume="invocation")
    lr: float = opt(0.03, "peak learning rate for the global batch (MoCo: 0.03 for 256)",
                    group=MODEL, above=0)
    lr_schedule: str = opt(DEFAULT["lr_schedule"], "the LR schedule after warm-up", choices=LR_SCHEDULES,
                           group=MODEL)
    lr_milestones: str = opt(DEFAULT["lr_milestones"], "epochs where the step schedule multiplies the LR by 0.1; "
                             "N%% = N percent of --epochs", group=MODEL)
    weight_decay: float = opt(1e-4, "SGD weight decay (L2)", group=MODEL, at_least=0)
    moco_dim: int = opt(128, "output size of the projection head (key/query feature dimension)",
                        group=MOCO, on_resume="fixed", above=0)
    moco_k: int = opt(65536, "queue length: negatives per query; must be >= the global batch",
                      group=MOCO, on_resume="fixed")
    moco_m: float = opt(0.999, "momentum of the key encoder update k = m*k + (1-m)*q", group=MOCO, at_least=0, below=1)
    moco_m_cos: bool = opt(False, "raise the momentum from --moco-m to 1 on a half cosine over training",
                           group=MOCO)
    moco_t: float = opt(DEFAULT["moco_t"], "softmax temperature", group=MOCO, above=0)
    symmetric: bool = opt(False, "symmetric loss: the SUM loss(q1,k2) + loss(q2,k1), as the MoCo authors' "
                          "CIFAR-10 demo does; both crops go through both encoders and both key sets are "
                          "enqueued (2 x the global batch per step: --moco-k must hold them)", group=MOCO)
    mlp: bool = opt(DEFAULT["mlp"], "2-layer MLP projection head instead of one linear layer",
                    group=MOCO, on_resume="fixed")
    aug: str = opt(DEFAULT["aug"], "augmentation: v1 weak, v2 strong with blur, v2-noblur",
                   choices=MOCO_AUGS, group=MOCO)
    crop_min: float = opt(0.2, "smallest crop of the random resized crop, as a fraction of the image area "
                          "(MoCo on ImageNet 0.2; the authors' CIFAR-10 demo 0.08, torchvision's default)",
                          group=MOCO, above=0, at_most=1)
    shuffle_bn: bool = opt(True, "shuffle BN: key batch shuffled across ranks (one process: split BN)",
                           group=MOCO)
    bn_splits: int = opt(8, "one process with --shuffle-bn: BatchNorm groups emulating that many GPUs",
                         group=MOCO, above=0)
    sync_bn: bool = opt(False, "SyncBatchNorm in both encoders instead of shuffle BN (it defeats "
                        "shuffle BN's purpose; for comparison only)", group=MOCO)
    knn_k: int = opt(200, "kNN monitor: neighbours that vote", group=KNN, on_resume="free", above=0)
    knn_t: float = opt(0.1, "kNN monitor: temperature of the exp(similarity / T) vote weights",
                       group=KNN, on_resume="free", above=0)
    knn_features: str = opt("backbone", "kNN monitor features: backbone (what a linear probe sees) or head "
                            "(the projection head's output, as the MoCo authors' CIFAR-10 demo monitors)",
                            choices=("backbone", "head"), group=KNN, on_resume="free")
    knn_every: int = opt(1, "run the kNN monitor every this many epochs (and at step 0); 0 = never",
                         group=KNN, on_resume="free", at_least=0)
    knn_bank_samples: int = opt(0, "kNN monitor: memory bank = this many train samples (a fixed, seeded "
                                "subset); 0 = the whole train split", group=KNN, on_resume="free", at_least=0)
    export_backbone: str = opt("", "after training, write the query backbone (no head) as a plain "
                               "state dict to this path, loadable by torchvision's model",
                               group=MOCO, on_resume="free")

    def validate(self, launch: LaunchEnv, cuda_devices: int) -> None:
        if self.arch not in SMALL_NETS and self.arch not in model_names() and not is_timm(self.arch):
            raise UsageError(f"--arch {self.arch}: not a model of this project or of torchvision; give "
                             f"{HEADED_BACKBONES}")
        if head_of(self.arch) is None:
            raise UsageError(f"--arch {self.arch}: its logits come from no linear layer, and MoCo replaces a "
                             f"backbone's linear classifier with its projection head; give {HEADED_BACKBONES}")
        super().validate(launch, cuda_devices)
        if not self.augment:
            raise UsageError("--no-augment: MoCo learns from two differently augmented views of each image; "
                             "identical views make its task trivial. Choose the views with --aug v1, v2 or "
                             "v2-noblur instead")
        global_batch = self.global_batch(launch.world_size)
        if self.symmetric and self.moco_k < 2 * global_batch:  # both crops' keys enter the queue
            raise UsageError(f"--moco-k {self.moco_k} is smaller than the keys one optimizer step enqueues "
                             f"with --symmetric (2 crops x world size {launch.world_size} x accum steps "
                             f"{self.accum_steps} x batch {self.batch_size} = {2 * global_batch}); raise "
                             f"--moco-k, lower the batch or drop --symmetric")
        if self.moco_k < global_batch:  # else one optimizer step would overwrite its own keys
            raise UsageError(f"--moco-k {self.moco_k} is smaller than the global batch (world size "
                             f"{launch.world_size} x accum steps {self.accum_steps} x batch "
                             f"{self.batch_size} = {global_batch}); raise --moco-k or lower the batch")
        if self.sync_bn:
            check_sync_bn(launch, self.device, cuda_devices)
        if self.uses_split_bn(launch.world_size) and self.batch_size % self.bn_splits:
            raise UsageError(f"--batch-size {self.batch_size} must be a multiple of --bn-splits "
                             f"{self.bn_splits} (split BN on one process); or pass --bn-splits 1")

    def uses_split_bn(self, world_size: int) -> bool:
        return self.shuffle_bn and not self.sync_bn and world_size == 1 and self.bn_splits > 1


@dataclass(kw_only=True)
class MocoRun(TrainRun):
    moco: MoCo  # both encoders and the queue; ``network`` is encoder_q, DDP-wrapped when distributed


# ----------------------------------------------------------------------------- building
def build_moco(cfg: MocoConfig, info: DistInfo, num_classes: int, image_size: int) -> MoCo:
    """Both encoders on a --arch backbone built for ``image_size`` px (the run's plan) and the
    queue, the same on every rank, on this rank's device."""
    torch.manual_seed(cfg.seed)  # same encoders and queue on every rank, whatever the world size
    backbone = build_model(cfg.arch, num_classes, image_size)
    head, width = without_head(backbone, num_classes)
    if info.is_main:
        log.info("backbone %s: its classifier %s replaced by the projection head (%d features in)", cfg.arch, head,
                 width)
    encoder_q = Encoder(backbone, width, cfg.moco_dim, mlp=cfg.mlp)
    if cfg.sync_bn:
        encoder_q = nn.SyncBatchNorm.convert_sync_batchnorm(encoder_q)
        if info.is_main:  # a config remark, not a per-rank problem: say it once
            log.warning("--sync-bn: BatchNorm statistics are shared across ranks, which defeats "
                        "shuffle BN (the positive pair can share statistics again); shuffle BN is off")
    elif cfg.uses_split_bn(info.world_size):
        encoder_q = split_batchnorm(encoder_q, cfg.bn_splits)
        log.info("shuffle BN on one process: BatchNorm split into %d groups of %d samples",
                 cfg.bn_splits, cfg.batch_size // cfg.bn_splits)
    shuffle = cfg.shuffle_bn and not cfg.sync_bn
    if not shuffle and not cfg.sync_bn and info.is_main:
        log.warning("--no-shuffle-bn: query and key share BatchNorm statistics; expect a weaker model")
    elif shuffle and info.is_distributed:
        log.info("shuffle BN: key batches are shuffled across %d ranks", info.world_size)
    return place_model(MoCo(encoder_q, dim=cfg.moco_dim, K=cfg.moco_k, T=cfg.moco_t, shuffle_bn=shuffle,
                           shuffle_seed=cfg.seed), info.device)


def queue_remarks(cfg: MocoConfig, train_images: int) -> list[str]:
    """A queue longer than the training set holds keys of the same images, several epochs old."""
    if cfg.moco_k <= train_images:
        return []
    return [f"--moco-k {cfg.moco_k} is {cfg.moco_k / train_images:.1f}x the {train_images:,} training images: the "
            f"queue holds several stale keys of each image, its own positives among the negatives; use "
            f"--moco-k {queue_size_that_fits(train_images)} or less"]


def queue_size_that_fits(train_images: int) -> int:
    return 1 << (train_images.bit_length() - 1)  # the largest power of two <= the training images


def script_data(cfg: MocoConfig) -> ScriptData:
    """What this script adds to the shared data settings: the kNN monitor's bank,
    ``--knn-bank-samples`` of the training split (0: all), none without the monitor."""
    return ScriptData(plan_fields=dict(bank_samples=cfg.knn_bank_samples if cfg.knn_every else None))


def setup(cfg: MocoConfig, session: RunSession) -> MocoRun:
    info = session.info
    data = script_data(cfg)
    resume, resolved, listings = preflight(cfg, session, data)  # every rank checked; "auto" resolved; files listed once
    with all_ranks_agree():  # every check that can fail, before the first collective
        # Two views per training sample; the kNN monitor's bank: the un-augmented train split (or
        # --knn-bank-samples of it).
        recipe = moco_recipe(cfg.dataset, resolved.image_size, cfg.aug, cfg.crop_min, cfg.normalization)
        plan = data_plan(cfg, resolved, recipe, data, listings)
        loaders = session.close_loaders_at_exit(build_data(plan, rank=info.rank, world_size=info.world_size,
                                                           device=info.device, ranks_on_node=info.local_world_size,
                                                           node=info.node, fresh=resume is None))
        preview = augmentation_grid(loaders) if info.is_main and resume is None else None  # TensorBoard's, once
        if info.is_main:
            for remark in queue_remarks(cfg, len(loaders.train_set)):
                log.warning("%s", remark)
        moco = build_moco(cfg, info, loaders.num_classes, resolved.image_size)
        torch.manual_seed(cfg.seed + 1000 * info.rank)  # per-rank stream for anything random later
        optimizer, lr_schedule, scaler, total_steps = build_optimization(
            cfg, moco.encoder_q.parameters(), loaders.batches_per_epoch, info.device)  # never encoder_k
        state = state_to_start_from(resume, cfg, SCRIPT, {}, model=moco, optimizer=optimizer, scaler=scaler,
                                    sampler=loaders.train_sampler, info=info)
    if resume is not None and is_complete(cfg, state) and cfg.export_backbone and info.is_main:
        export_finished_backbone(moco, cfg.export_backbone)  # a finished run's backbone, as asked
    stop_if_complete(cfg, state, resume)  # a finished run resumed: its last metrics, exit 0
    moco.sync_state_from_rank0()
    # Only the query encoder goes into DDP: it must not broadcast the queue or encoder_k.
    query_encoder = wrap_network(moco.encoder_q, info, cfg.compile)
    if cfg.compile:
        moco.compile_key_encoder()
    tb = open_run_folder(cfg, session, resume, state.step, resolved, preview, listings)  # nothing written before
    run = MocoRun(
        cfg=cfg, info=info, session=session, loaders=loaders, model=moco, network=query_encoder,
        optimizer=optimizer, lr_schedule=lr_schedule, scaler=scaler, total_steps=total_steps, state=state,
        tb=tb, script=SCRIPT, resolved=resolved, moco=moco)
    # The shuffle count advances in each forward: a window given up must put it back (as it does
    # BatchNorm statistics and RNG streams), which only what is registered gets.
    run.batches.window_undo.register(moco)
    return run


# ----------------------------------------------------------------------------- training
def momentum_at(cfg: MocoConfig, step: int, total_steps: int) -> float:
    """Key-encoder momentum for the update after optimizer step ``step`` (a function of the step
    alone, so a resumed run continues the schedule instead of restarting it)."""
    return cosine_to_one(cfg.moco_m, step, total_steps) if cfg.moco_m_cos else cfg.moco_m


def train_one_epoch(run: MocoRun, meter: StepMeter) -> None:
    """Train on the rest of this epoch, one optimizer step per window of --accum-steps
    micro-batches; return early at --max-steps or a stop signal."""
    cfg, info, moco = run.cfg, run.info, run.moco
    contrast = contrastive_step(cfg.symmetric)  # loss(q, k), or loss(q1, k2) + loss(q2, k1)
    moco.train()
    window_keys: list[torch.Tensor] = []  # every rank's keys of this window: enqueued after its step
    for micro, ((im_q, im_k), _) in run.batches.this_epoch():
        im_q, im_k = to_device(im_q, info.device), to_device(im_k, info.device)
        # DDP all-reduces encoder_q's gradients inside backward(); under no_sync() it only adds them
        # up in .grad. Skipping it on all but the window's last micro-step sends them once per step.
        with no_sync(run.network, enabled=not micro.is_last):
            with autocast(cfg.amp, info.device):
                loss, contrastive_acc, keys = contrast(moco, im_q, im_k, run.network)  # keys: no graph
            run.scaler.scale(loss / micro.window_size).backward()  # this micro-batch's share, at once
        window_keys.append(keys)
        meter.add_micro(micro.window_size, len(im_q) * info.world_size, loss=loss,
                        contrastive_acc1=100.0 * contrastive_acc)
        if not micro.is_last:
            continue
        run.batches.prepare_next()  # its augmentation runs on the device while the host waits below
        # The optimizer step, the same on every rank. Unscale (fp16: clip and test the true
        # gradients) and clip, then the ranks' one agreement (a NaN/Inf loss, an fp16 overflow, a
        # stop signal, an undecodable file): the step's only read of the device.
        run.scaler.unscale_(run.optimizer)
        grad_norm = nn.utils.clip_grad_norm_(stepped_parameters(run.optimizer), cfg.clip_grad) if cfg.clip_grad > 0 else None
        overflow = fp16_overflow(run.scaler, run.optimizer, grad_norm)  # on the device, read by the agreement
        verdict = run.session.agree_on_step(~torch.isfinite(meter.window_loss.detach()), overflow,
                                            give_up=bool(run.loaders.unreadable))
        if verdict.given_up_ranks:  # a rank met an image file it cannot decode: the window is undone, the run stops
            run.optimizer.zero_grad(set_to_none=not info.is_distributed)
            run.batches.undo_window()
            stop_if_files_unreadable(run, f"step {run.state.step + 1} (not taken)")  # raises
        lr = run.lr_schedule(run.state.step)
        set_lr(run.optimizer, lr)
        momentum = momentum_at(cfg, run.state.step + 1, run.total_steps)  # at the step this update completes
        if verdict.may_step:  # else skipped on every rank alike: encoder_k and the queue stay as they are
            run.optimizer.step()  # the unscaled gradients: GradScaler.step would read the overflow again
            moco.momentum_update(momentum)  # k = m*k + (1-m)*q, after encoder_q moved
            # The window's keys enter together: every micro-step of it saw the same negatives,
            # as one big batch would.
            moco.enqueue(torch.cat(window_keys))
        window_keys = []
        run.scaler.update()  # fp16: lowers the scale after an overflow, raises it after enough good steps
        # Zeroed in place under DDP (its buckets hold them; new tensors would be copied in every
        # step); freed in one process.
        run.optimizer.zero_grad(set_to_none=not info.is_distributed)
        run.state.step += 1
        # After the step: the epoch's end, the log, a skipped step counted, a stop, a checkpoint.
        run.end_epoch_if_done()
        meter.end_step(run.state.step, run.state.epoch_number, force=ends_the_run(run, verdict), lr=lr,
                       moco_m=momentum)
        if verdict.nonfinite_ranks:
            skip_or_stop_nonfinite(run, verdict.nonfinite_ranks)  # raises past --skip-nonfinite
        if verdict.stop:  # SIGUSR1/SIGTERM or Ctrl-C reached some rank
            stop_for_signal(run, verdict)
            return
        if cfg.ckpt_every and run.state.step % cfg.ckpt_every == 0:
            save_checkpoint(run)
        run.session.faults.after_step(info.rank, run.state.step)  # DDP_FAULT=kill/raise (tests)
        if cfg.max_steps and run.state.step >= cfg.max_steps:
            return


def knn_monitor(run: MocoRun) -> float:
    sync_buffers_from_rank0(run.moco.encoder_q)  # score rank 0's model (what checkpoints hold)
    # backbone: the features a linear probe sees; head: the whole query encoder's output (the demo's)
    features = run.moco.encoder_q if run.cfg.knn_features == "head" else run.moco.encoder_q.backbone
    started = time.perf_counter()
    acc = knn_accuracy(features, run.loaders.bank, run.loaders.val, run.loaders.num_classes, run.info.device,
                       k=run.cfg.knn_k, T=run.cfg.knn_t, amp=run.cfg.amp)
    stop_if_files_unreadable(run, f"the kNN monitor at step {run.state.step}")
    run.tb.scalars(run.state.step, knn__acc1=acc)
    log.info("epoch %d step %d: kNN acc1 %.2f%% (k=%d, T=%g) in %.1f s", run.state.epoch_number, run.state.step,
             acc, run.cfg.knn_k, run.cfg.knn_t, time.perf_counter() - started)
    return acc


def fit(run: MocoRun) -> None:
    cfg, state = run.cfg, run.state
    meter = start_training(run)
    log.info("MoCo %s: K=%d, m=%g%s, T=%g, %s head, %s augmentation", cfg.preset, cfg.moco_k, cfg.moco_m,
             " (cosine to 1)" if cfg.moco_m_cos else "", cfg.moco_t, "MLP" if cfg.mlp else "linear", cfg.aug)
    knn = None
    if cfg.knn_every and state.step == 0:
        knn = knn_monitor(run)  # the step-0 baseline that training must beat
    while not run.finished():
        train_one_epoch(run, meter)
        meter.progress.end_line()
        if run.preempted:  # checkpoint already written; leave for the requeue
            return
        save_checkpoint(run)  # before the kNN pass: a preemption during it loses nothing
        epoch_ended = state.batches_done == 0
        if cfg.knn_every and ((epoch_ended and state.epoch % cfg.knn_every == 0) or run.finished()):
            knn = knn_monitor(run)
    moco = run.moco
    if run.info.is_distributed:
        digest = check_replicas_identical({**{f"q.{n}": p for n, p in moco.encoder_q.named_parameters()},
                                           **{f"k.{n}": p for n, p in moco.encoder_k.named_parameters()},
                                           "queue": moco.queue, "queue_ptr": moco.queue_ptr})
        log.info("encoders, queue and pointer identical on all %d ranks (sha256 %s)",
                 run.info.world_size, digest[:16])
    if cfg.export_backbone and run.info.is_main:
        export_finished_backbone(moco, cfg.export_backbone)
    barrier()
    if knn is not None:
        log.info("final kNN acc1 %.2f%% at step %d", knn, state.step)
    else:
        log.info("finished at step %d", state.step)


def export_finished_backbone(moco: MoCo, path: str) -> None:
    log.info("exported the query backbone to %s", export_backbone(moco.encoder_q.backbone, path))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(MocoConfig, argv, __doc__)  # bad flags: one line, exit code 2
    if cfg.check or cfg.check_data:  # every check of setup, in this one process; launch/ runs it first
        model = (f"MoCo {cfg.preset} {cfg.arch}, K {cfg.moco_k}, m {cfg.moco_m:g}, T {cfg.moco_t:g}, "
                 f"{'MLP' if cfg.mlp else 'linear'} head, {cfg.aug} augmentation")
        return check_only(cfg, SCRIPT, model, lambda train, image_size: ({}, [
            f"backbone: {cfg.arch}, its classifier {head_of(cfg.arch)} replaced by the projection head",
            *(f"warning: {remark}" for remark in queue_remarks(cfg, len(train)))]), lambda: script_data(cfg))
    with RunSession(cfg) as session:  # process group, logging, signals, exit codes, clean-up
        fit(setup(cfg, session))  # no name holds the run: its DDP model dies before the group (cleanup_distributed)
    return session.exit_code


if __name__ == "__main__":
    sys.exit(main())
