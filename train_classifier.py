"""Supervised image classification with DistributedDataParallel and gradient accumulation.

One process (CPU or one GPU; also the way to use a debugger):
    python train_classifier.py --dataset digits --arch small_cnn --epochs 5 --out runs/digits
    python train_classifier.py --debug            # tiny subset, anomaly detection, extra checks

One node, every GPU (or N CPU processes with gloo):
    torchrun --standalone --nproc_per_node=4 train_classifier.py --dataset cifar10 --download \\
        --arch resnet18 --batch-size 128 --lr 0.1 --epochs 200 --warmup-steps 500 --out runs/c10

Several nodes (run on every node; HOST is node 0's address):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        train_classifier.py --dataset imagefolder --data-dir /data/imagenet --arch resnet50 \\
        --batch-size 64 --lr 0.2 --epochs 90 --warmup-steps 2500 --amp bf16 --out runs/in1k

SLURM (see launch/): sbatch /path/to/repo/launch/slurm_classifier.sbatch --dataset cifar10 ...
Resume after a crash or preemption: add --resume auto (same --out). A fresh run refuses an --out
that holds a checkpoint; --overwrite starts over there. Survive dead workers: MAX_RESTARTS=3
launch/torchrun_local.sh train_classifier.py ... (torchrun --max-restarts, resuming by itself).
Exit codes: 0 done or preempted, 1 crash, 2 bad input, 3 NaN/Inf loss, 75 the object store did not
answer (a restart waits for it and resumes), 130 Ctrl-C. From a bucket, 2 also means a fault no restart
fixes (access refused, no such bucket, a shard changed or gone, a full cache disk): do what the line
says, then add --resume auto (docs/data.md#shards-in-an-object-store-s3).

Linear probe of a MoCo checkpoint (frozen backbone in eval mode, a new linear classifier):
    python train_classifier.py --pretrained runs/moco/checkpoint_last.pt --linear-probe \\
        --arch small_cnn --lr 30 --weight-decay 0 --lr-schedule step --lr-milestones 60,80 --epochs 100
Without --linear-probe the whole pretrained network is fine-tuned.

--batch-size is per rank and per micro-step: the global batch of one optimizer step is
world_size x --accum-steps x --batch-size, logged at start. --lr is not rescaled for you.

torchvision's published commands (references/classification/README.md) run as typed, train.py replaced
by this script and --data-path added, which brings train.py's defaults (recipes/torchvision-commands.md):
    torchrun --nproc_per_node=8 train_classifier.py --data-path /data/imagenet --model mobilenet_v2 \
        --epochs 300 --lr 0.045 --wd 0.00004 --lr-step-size 1 --lr-gamma 0.98
--model takes any torchvision classification model (timm's as timm/NAME); --weights starts from published
weights (from the hub caches, never downloaded) or a checkpoint, and --test-only evaluates them (docs/recipe.md).
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_utils.config import (
    AppliesTo,
    UsageError,
    flag_defaults,
    flag_name,
    opt,
    per_sample_flags,
    restated,
)
from ddp_utils.data.host_memory import size_text
from ddp_utils.data.mixing import BatchMixer
from ddp_utils.data.object_store import is_object_store
from ddp_utils.data.order import order_for
from ddp_utils.data.pipeline import Loaders, build_data
from ddp_utils.data.preview import augmentation_grid
from ddp_utils.data.recipes import (
    AUTO_AUGMENTS,
    INTERPOLATIONS,
    classifier_recipe,
    evaluation_resize,
)
from ddp_utils.data.sets import (
    FROM_FILES,
    IMAGE_FILES,
    NORMALIZATION,
    check_data_dir,
    image_size_for,
    num_classes_of,
)
from ddp_utils.data.unreadable import describe_unreadable, fix_hint
from ddp_utils.models.backbones import (
    CIFAR_STEM_MAX_SIZE,
    FC_BACKBONES,
    SMALL_NETS,
    TIMM_PREFIX,
    LinearProbe,
    activation_bytes,
    build_model,
    ends_in_fc,
    has_cifar_stem,
    is_timm,
    min_image_size,
    model_names,
    parameter_count,
    timm_model_names,
)
from ddp_utils.models.weights import published_weights, put_weights
from ddp_utils.runtime.collectives import (
    all_ranks_agree,
    all_reduce_sum,
    check_replicas_identical,
    sync_buffers_from_rank0,
)
from ddp_utils.runtime.device import place_model, to_device
from ddp_utils.runtime.dist import DistInfo, unwrap, wrap_network
from ddp_utils.runtime.launch import LaunchEnv
from ddp_utils.runtime.logs import release_held_logs
from ddp_utils.runtime.precision import autocast
from ddp_utils.train.accumulation import fp16_overflow, no_sync, set_lr, stepped_parameters
from ddp_utils.train.check import check_only
from ddp_utils.train.checkpoint import Resume, mismatch_detail
from ddp_utils.train.ema import WeightsEMA, ema_decay
from ddp_utils.train.monitor import StepMeter
from ddp_utils.train.optimization import OPTIMIZERS, build_optimization, parameter_groups, state_copies
from ddp_utils.train.preflight import list_image_files_once, preflight, resolved_settings
from ddp_utils.train.pretrained import (
    load_pretrained_backbone,
    pretrained_file,
    pretrained_image_size,
    read_weights,
    tensors_equal,
)
from ddp_utils.train.resume import state_to_start_from, stop_if_complete
from ddp_utils.train.run import (
    TrainRun,
    ends_the_run,
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
    ResolvedSettings,
    ScriptData,
    TrainConfig,
    check_sync_bn,
    data_plan,
    needs_flag,
    only_with,
    parse_args,
)
from ddp_utils.train.unreadable_files import stop_if_files_unreadable

log = logging.getLogger("train")
SCRIPT = "train_classifier.py"
PRETRAINED = "pretrained weights, evaluation"  # --help's sections of this script's own flags
RECIPE = "torchvision's recipe: loss, optimizer, weight average"
AUGMENTATION = "torchvision's recipe: augmentation and image sizes"
UNSET = -1.0  # --norm-weight-decay, --bias-weight-decay: torchvision's None (no group of their own)


def auto_augment_only(policy: str) -> AppliesTo:
    """A setting of one --auto-augment policy's operations: refused with another policy."""
    return AppliesTo(f"--auto-augment {policy}", lambda cfg: cfg.auto_augment == policy,
                     lambda flag, cfg: f"{flag} applies to --auto-augment {policy} only; add it, or drop {flag}")


def image_files_only(hint: str = "") -> AppliesTo:
    """A setting of the image files' views (imagefolder, shards); ``hint``: what to do instead."""
    return AppliesTo("image files (imagefolder, shards)", lambda cfg: cfg.dataset in IMAGE_FILES,
                     lambda flag, cfg: f"{flag} applies to image files (imagefolder, shards), not --dataset "
                                       f"{cfg.dataset}: drop it{hint}")


# the FixRes sizes: the crops of image files; the other data sets' views are --image-size itself
IMAGE_FILE_SIZES = image_files_only(" (--image-size sets the side)")
# --nesterov: Nesterov momentum is SGD's (sgd, and sgd_nesterov, which sets it); the other optimizers have none
SGD_ONLY = AppliesTo("SGD", lambda cfg: cfg.optimizer in ("sgd", "sgd_nesterov"),
                     lambda flag, cfg: f"{flag} is SGD's; --optimizer {cfg.optimizer} has no such option (drop it)")
# --momentum: SGD's and RMSprop's; AdamW's betas play its part
WITH_MOMENTUM = AppliesTo("SGD and RMSprop", lambda cfg: cfg.optimizer != "adamw",
                          lambda flag, cfg: f"{flag} does nothing with --optimizer adamw (its betas are PyTorch's 0.9, "
                                            f"0.999; it applies to SGD and RMSprop); drop {flag} {cfg.momentum:g}")


# --auto-augment: torchvision's policies work on 8-bit images; the other data sets are float tensors
EIGHT_BIT = AppliesTo(f"8-bit images ({', '.join(FROM_FILES)})", lambda cfg: cfg.dataset in FROM_FILES,
                      lambda flag, cfg: f"{flag} needs 8-bit images ({', '.join(FROM_FILES)}); --dataset "
                                        f"{cfg.dataset}'s are float tensors: drop {flag}")


def _ra_reps_refusal(flag: str, cfg: ClassifierConfig) -> str:
    fix = "drop --ra-reps (an object store's shards are read in the shards order only)" \
        if is_object_store(cfg.data_dir) else "add --order samples, or drop --ra-reps"
    return f"{flag} {cfg.ra_reps} repeats samples of the samples order, but the shards order reads whole shards " \
           f"per rank; {fix}"


# --ra-reps: the samples order deals a sample's copies to the ranks in turn; the shards order deals whole shards
SAMPLES_ORDER = AppliesTo("the samples order", lambda cfg: order_for(cfg.dataset, cfg.order) == "samples",
                          _ra_reps_refusal)


def magnitude_applies() -> AppliesTo:
    """--ra-magnitude (torchvision's README spells it --policy-magnitude) is RandAugment's; with
    TrivialAugmentWide, which has no magnitude, it is accepted and said to do nothing, because
    the README's MaxViT command gives it so."""
    where = "--auto-augment ra (and ta_wide, where it does nothing)"
    return AppliesTo(where, lambda cfg: cfg.auto_augment in ("ra", "ta_wide"),
                     lambda flag, cfg: f"{flag} applies to {where}: add --auto-augment ra, or drop {flag}")


# torchvision's references/classification/train.py defaults (pytorch/vision 428a54c), brought by its
# --data-path: its published commands give only what differs from them. The machine's own choices
# stay ours: --workers auto (its 16), --device auto, the seed and the run folder.
TORCHVISION_DEFAULTS = dict(dataset="imagefolder", arch="resnet18", batch_size=32, epochs=90, lr=0.1, momentum=0.9,
                            weight_decay=1e-4, lr_schedule="steplr", lr_step_size=30, lr_gamma=0.1, lr_min=0.0,
                            lr_warmup_method="constant", lr_warmup_decay=0.01, amp="none", image_size=224,
                            train_crop_size=224, val_resize_size=256, interpolation="bilinear", lr_ranks=8)


def _after(sections: tuple[str, ...], section: str, new: str) -> tuple[str, ...]:
    at = sections.index(section) + 1
    return (*sections[:at], new, *sections[at:])


@dataclass
class ClassifierConfig(TrainConfig):
    SECTIONS: ClassVar[tuple[str, ...]] = (*_after(_after(TrainConfig.SECTIONS, MODEL, RECIPE), RECIPE, AUGMENTATION),
                                           PRETRAINED)
    FLAG_DEFAULTS: ClassVar[dict[str, dict]] = {"--data-path": TORCHVISION_DEFAULTS}

    # shared flags restated: torchvision's spellings, where they mean what its train.py's do; --momentum, not AdamW's
    data_dir: str = restated(TrainConfig, "data_dir", "--data-path")
    batch_size: int = restated(TrainConfig, "batch_size", "-b")
    workers: int = restated(TrainConfig, "workers", "-j")
    image_size: int = restated(TrainConfig, "image_size", "--val-crop-size")
    momentum: float = restated(TrainConfig, "momentum", applies_to=WITH_MOMENTUM)

    out: str = opt("runs/classifier", OUT_HELP, group=RUN_FOLDER, on_resume="invocation")
    arch: str = opt("small_cnn", f"network: {', '.join(SMALL_NETS)}, or any classification model torchvision lists "
                    f"(torchvision.models.list_models(), e.g. resnet50, vit_b_16, convnext_tiny), or timm's as "
                    f"timm/NAME (timm.list_models(), e.g. timm/resnet50; needs requirements-timm.txt), "
                    f"built with the data set's classes and no weights", group=MODEL, on_resume="fixed",
                    spellings=("--model",))
    pretrained: str = opt("", "initialise the backbone from a train_moco.py checkpoint, its run folder "
                          "(the newest checkpoint) or an exported backbone (--export-backbone); fc starts "
                          "fresh; --image-size 0 then means the size it was pretrained at",
                          group=PRETRAINED, names_file=True)
    weights: str = opt("", "start from whole weights: torchvision's published ones by name (e.g. "
                       "ResNet50_Weights.IMAGENET1K_V2, read from torch's hub cache, $TORCH_HOME/hub/checkpoints), "
                       "timm's (timm/ARCH.TAG, from the Hugging Face cache, $HF_HOME/hub; never downloaded by a run) "
                       "or a checkpoint of this script (a file, or a run folder: its newest); without --test-only "
                       "they are fine-tuned, tensors of another shape (a classifier for other classes) starting fresh",
                       group=PRETRAINED, names_file=lambda weights: published_weights(weights) is None)
    test_only: bool = opt(False, "evaluate --weights on the validation split and exit (torchvision's --test-only): "
                          "acc@1 and acc@5, nothing written; torchvision's weights with their own evaluation view "
                          "(resize, crop, interpolation)", group=PRETRAINED, on_resume="invocation", from_file=False)
    linear_probe: bool = opt(False, "freeze the backbone (kept in eval mode) and train only a new linear "
                             "classifier; without --pretrained the backbone is randomly initialised (a "
                             "baseline)", group=PRETRAINED, on_resume="fixed")
    probe_bn: bool = opt(False, "normalise the frozen features with a parameter-free BatchNorm before the "
                         "classifier (MAE's probe; LRs near 0.1 then work); off = MoCo's protocol (LR about 30)",
                         group=PRETRAINED, on_resume="fixed", applies_to=only_with("linear_probe"))
    label_smoothing: float = opt(0.0, "label smoothing S of the training loss (nn.CrossEntropyLoss(label_smoothing=S)): "
                                 "each target is 1 - S on its class plus S spread evenly over all classes; train/loss "
                                 "includes it, the validation loss (val/loss) stays plain cross-entropy, comparable "
                                 "between runs (torchvision's evaluation loss includes it)",
                                 group=RECIPE, at_least=0, below=1)
    optimizer: str = opt("sgd", "sgd (--momentum, --nesterov), sgd_nesterov (torchvision's name of sgd with "
                         "--nesterov), adamw (PyTorch's defaults: betas 0.9, 0.999, eps 1e-8; --weight-decay "
                         "decoupled) or rmsprop (torchvision's: alpha 0.9, eps 0.0316, --momentum)",
                         choices=OPTIMIZERS, group=RECIPE, on_resume="fixed", spellings=("--opt",))
    nesterov: bool = opt(False, "Nesterov momentum (torchvision's --opt sgd_nesterov)", group=RECIPE,
                         applies_to=SGD_ONLY)
    norm_weight_decay: float = opt(UNSET, "weight decay of the normalisation layers' parameters (BatchNorm, "
                                   "GroupNorm, LayerNorm, InstanceNorm, LocalResponseNorm; their biases too unless "
                                   "--bias-weight-decay is set), a parameter group of their own; -1 = unset: "
                                   "--weight-decay's, one group (torchvision's default; its recipes use 0)",
                                   group=RECIPE, at_least=UNSET)
    bias_weight_decay: float = opt(UNSET, "weight decay of every parameter named bias (normalisation layers' "
                                   "included), a parameter group of their own; -1 = unset: as the layer's other "
                                   "parameters", group=RECIPE, at_least=UNSET)
    transformer_embedding_decay: float = opt(UNSET, "weight decay of the parameters named class_token, "
                                             "position_embedding or relative_position_bias_table (torchvision's "
                                             "keys: ViT's class token, Swin's and MaxViT's relative position "
                                             "biases; ViT's pos_embedding is none of them), a group of their own per "
                                             "name; -1 = unset", group=RECIPE, at_least=UNSET)
    sync_bn: bool = opt(False, "BatchNorm statistics over the global batch: BatchNorm layers become "
                        "SyncBatchNorm when several ranks train on CUDA (torchvision's --sync-bn); one process has "
                        "nothing to synchronise; several CPU ranks are refused (SyncBatchNorm has no CPU kernel)",
                        group=RECIPE)
    model_ema: bool = opt(False, "keep an exponential moving average (EMA) of the weights and buffers, torchvision's "
                          "--model-ema: updated after every --model-ema-steps-th optimizer step of each epoch, on "
                          "every rank alike; during the LR warm-up each update copies the weights; checkpointed "
                          "beside the model and evaluated after each epoch (its own log line, val_ema/* in "
                          "TensorBoard)", group=RECIPE)
    model_ema_steps: int = opt(32, "optimizer steps between the EMA's updates (torchvision counts "
                               "iterations, each an optimizer step), counted from each epoch's first",
                               group=RECIPE, above=0, applies_to=needs_flag("model_ema"))
    model_ema_decay: float = opt(0.99998, "the EMA's decay D, adjusted as torchvision does: each update keeps "
                                 "1 - min(1, (1 - D) x global batch x --model-ema-steps / --epochs) of the average, "
                                 "the global batch being world size x --accum-steps x --batch-size (torchvision's "
                                 "world size x its per-GPU batch)", group=RECIPE, above=0, below=1,
                                 applies_to=needs_flag("model_ema"))
    mixup_alpha: float = opt(0.0, "MixUp (torchvision's transforms.v2.MixUp, its --mixup-alpha): each image of a training "
                             "micro-batch becomes lambda x itself + (1 - lambda) x the image before it (the first "
                             "takes the last), the one-hot targets likewise; lambda ~ Beta(alpha, alpha), one per "
                             "micro-batch and rank; 0 = off", group=AUGMENTATION, at_least=0)
    cutmix_alpha: float = opt(0.0, "CutMix (torchvision's transforms.v2.CutMix, its --cutmix-alpha): a box of about "
                              "1 - lambda of the area, lambda ~ Beta(alpha, alpha), pasted into each image of a "
                              "training micro-batch from the image before it, the one-hot targets mixed by the area "
                              "actually pasted; with --mixup-alpha too, each micro-batch gets one of the two, "
                              "probability 0.5 each; 0 = off", group=AUGMENTATION, at_least=0)
    auto_augment: str = opt("", "automatic augmentation of each training image after its crop and flip, torchvision's "
                            "--auto-augment: imagenet, cifar10 or svhn = AutoAugment with that policy, ra = "
                            "RandAugment (--ra-magnitude), ta_wide = TrivialAugmentWide, augmix = AugMix "
                            "(--augmix-severity); bilinear interpolation; per sample in the DataLoader workers "
                            "(--aug-on loader); '' = none",
                            choices=("", *AUTO_AUGMENTS), group=AUGMENTATION, per_sample=True, applies_to=EIGHT_BIT)
    ra_magnitude: int = opt(9, "the magnitude of RandAugment's operations, in its 31 bins "
                            "(0 = none, 30 = strongest)", group=AUGMENTATION, at_least=0, at_most=30,
                            applies_to=magnitude_applies(), spellings=("--policy-magnitude",))
    augmix_severity: int = opt(3, "the severity of AugMix's operations (1 = weakest, 10 = "
                               "strongest)", group=AUGMENTATION, at_least=1, at_most=10,
                               applies_to=auto_augment_only("augmix"))
    random_erase: float = opt(0.0, "probability P of torchvision's RandomErasing on each normalised training image "
                              "(a rectangle of 2-33%% of the area, aspect 0.3-3.3, set to 0), the view's last "
                              "step; per sample in the DataLoader workers (--aug-on loader); 0 = off",
                              group=AUGMENTATION, at_least=0, at_most=1, per_sample=True)
    ra_reps: int = opt(1, "repeated augmentation, torchvision's --ra-sampler --ra-reps N: each epoch every sample of "
                       "the shuffled training split is repeated N times in a row and the sequence dealt out to the "
                       "ranks in turn, so an image's N copies go to different ranks (when N <= world size), each "
                       "augmented differently; a rank's epoch keeps its usual length (split size // world size "
                       "samples), so it sees about 1/N of the distinct images; 1 = off (docs/recipe.md)",
                       group=AUGMENTATION, at_least=1, switch=("--ra-sampler", 3), applies_to=SAMPLES_ORDER)
    train_crop_size: int = opt(0, "px of the training crops' side (FixRes: torchvision's v2 recipe trains at 176 "
                               "and evaluates at --image-size 224); 0 = --image-size", group=AUGMENTATION, at_least=0,
                               applies_to=IMAGE_FILE_SIZES)
    val_resize_size: int = opt(0, "px: the evaluation view resizes the short side of each image file to this, "
                               "then takes the centre --image-size crop (torchvision's v2 recipe: 232 for 224); "
                               "0 = round(--image-size x 256/224)", group=AUGMENTATION, at_least=0,
                               applies_to=IMAGE_FILE_SIZES)
    interpolation: str = opt("bilinear", "the interpolation of the image files' resizes: the training crops', the "
                             "evaluation resize's and the automatic augmentation's (torchvision's --interpolation); "
                             "other than bilinear, the training view runs per sample in the DataLoader workers",
                             choices=INTERPOLATIONS, group=AUGMENTATION, applies_to=image_files_only(), per_sample=True)

    def validate(self, launch: LaunchEnv, cuda_devices: int) -> None:
        if is_timm(self.arch):  # timm imported for such a name only; not installed: the requirement's line
            name, names = self.arch[len(TIMM_PREFIX):], timm_model_names(self.arch)
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"did you mean {TIMM_PREFIX}{close[0]}? " if close else ""
                raise UsageError(f"--arch {self.arch}: not a model of timm; {hint}(every name: "
                                 f"python -c 'import timm; print(timm.list_models())')")
        elif self.arch not in SMALL_NETS and self.arch not in model_names():
            close = difflib.get_close_matches(self.arch, model_names(), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UsageError(f"--arch {self.arch}: not a model of this project or of torchvision; {hint}(every "
                             f"name: python -c 'import torchvision; print(torchvision.models.list_models())')")
        super().validate(launch, cuda_devices)
        if self.sync_bn:
            check_sync_bn(launch, self.device, cuda_devices)
        self.check_weights_flags()
        if (self.linear_probe or self.pretrained) and not ends_in_fc(self.arch):
            flag = "--linear-probe" if self.linear_probe else "--pretrained"
            raise UsageError(f"{flag} puts a new fc on the backbone, and --arch {self.arch}'s classifier is not "
                             f"one named fc: give {FC_BACKBONES}")
        self.check_recipe_flags()
        self.check_augmentation_flags()
        self.check_view_sizes(Views.as_asked(self))

    def check_recipe_flags(self) -> None:
        """Nesterov without momentum and a weight decay below 0 other than -1 (unset) are refused
        (--momentum beside AdamW, --nesterov with another optimizer and the EMA's settings without
        --model-ema: ``opt(applies_to=...)``)."""
        for name in ("norm_weight_decay", "bias_weight_decay", "transformer_embedding_decay"):
            value = getattr(self, name)
            if value < 0 and value != UNSET:
                raise UsageError(f"{flag_name(name)} {value:g}: give a weight decay >= 0, or -1 to leave it unset")
        if (self.nesterov or self.optimizer == "sgd_nesterov") and self.momentum == 0:
            raise UsageError("Nesterov momentum needs momentum: give --momentum above 0")
        if (self.mixup_alpha or self.cutmix_alpha) and self.batch_size < 2:
            raise UsageError("--mixup-alpha/--cutmix-alpha mix the images of a micro-batch with each other: give "
                             "--batch-size 2 or more, or drop them")

    def augmentation_policy(self) -> dict:
        """torchvision's per-sample steps as ``AugmentRecipe`` fields (``classifier_recipe``'s policy)."""
        return dict(auto_augment=self.auto_augment, ra_magnitude=self.ra_magnitude,
                    augmix_severity=self.augmix_severity, random_erase=self.random_erase)

    def check_augmentation_flags(self) -> None:
        """torchvision's per-sample steps with augmentation on (the data sets and policies each
        applies to, and --aug-on device beside them: ``opt(applies_to=..., value_applies=...)``)."""
        per_sample = per_sample_flags(self)
        if per_sample and not self.augment:
            raise UsageError(f"{per_sample[0]} augments the training images and --no-augment turns augmentation off; "
                             f"drop one of them")

    def check_view_sizes(self, views: Views) -> None:
        """``views``' FixRes sizes (the flags', or the weights': :func:`views_of`) fit --arch and the
        evaluation crop: a training crop the network takes, on the same stem; a resize no smaller
        than the crop."""
        size, train = image_size_for(self.dataset, views.image_size), views.train_crop_size
        if train:
            self.check_input_sizes(size, {train: "--train-crop-size"})
        if views.val_resize_size and views.val_resize_size < size:
            raise UsageError(f"--val-resize-size {views.val_resize_size} is smaller than the evaluation crop "
                             f"--image-size {size}: give at least {size}")
        if train and train < (min_image_size(self.arch) or 0):
            raise UsageError(f"--train-crop-size {train} is too small for --arch {self.arch}: give at least "
                             f"{min_image_size(self.arch)} px")
        if train and has_cifar_stem(self.arch) and (train <= CIFAR_STEM_MAX_SIZE) != (size <= CIFAR_STEM_MAX_SIZE):
            raise UsageError(f"--arch {self.arch} has a CIFAR stem up to {CIFAR_STEM_MAX_SIZE} px and ImageNet's above, "
                             f"chosen by --image-size {size}: --train-crop-size {train} would train it at the other "
                             f"stem's size; keep both on one side of {CIFAR_STEM_MAX_SIZE} px")

    def weight_decay_of(self, name: str) -> float | None:
        """--norm-weight-decay or --bias-weight-decay (``name``) as torchvision's: None when unset."""
        value = getattr(self, name)
        return None if value == UNSET else value

    def check_weights_flags(self) -> None:
        """--test-only evaluates --weights; --weights starts a whole network, not a backbone; a
        name that looks like torchvision's but is none of them is told the close one."""
        if self.test_only and not self.weights:
            raise UsageError("--test-only evaluates --weights: give torchvision's weights by name (e.g. "
                             "ResNet50_Weights.IMAGENET1K_V2) or a checkpoint of this script")
        if self.weights and (self.pretrained or self.linear_probe):
            flag = "--pretrained" if self.pretrained else "--linear-probe"
            raise UsageError(f"--weights starts the whole network and {flag} its backbone: give one of them")
        weights = published_weights(self.weights) if self.weights else None
        if weights is not None and self.arch not in weights.models:
            raise UsageError(f"--weights {self.weights} are {' and '.join(weights.models)}'s, and this run has --model "
                             f"{self.arch}: give --model {weights.models[0]}, or weights of {self.arch}")
        if weights is not None and self.test_only and weights.normalization != NORMALIZATION.get(self.dataset):
            raise UsageError(f"--weights {self.weights} were trained on images normalised with mean "
                             f"{weights.normalization[0]} and std {weights.normalization[1]}; this script evaluates "
                             f"--dataset {self.dataset} with its own (ImageNet's for image files): evaluate weights "
                             f"trained with those")
        if self.weights.startswith(TIMM_PREFIX) and weights is None:
            raise UsageError(f"--weights {self.weights}: not timm's published weights (timm/ARCH.TAG, one of "
                             f"timm.list_models(pretrained=True))")
        if "_Weights." in self.weights and weights is None and not Path(self.weights).exists():
            import torchvision

            names = [f"{enum.__name__}.{member.name}" for model in torchvision.models.list_models(module=torchvision.models)
                     for enum in (torchvision.models.get_model_weights(model),) for member in enum]
            close = difflib.get_close_matches(self.weights, names, n=1)
            raise UsageError(f"--weights {self.weights}: not torchvision's weights" +
                             (f"; did you mean {close[0]}?" if close else ""))


@dataclass(frozen=True)
class Views:
    """The sides and the resize of one run's training and evaluation views (:func:`views_of`)."""

    image_size: int       # px, the evaluation crop's side (the training crop's by default); 0: the data set's native side
    train_crop_size: int  # px, the training crop's side (FixRes); 0: image_size
    val_resize_size: int  # px, the evaluation view's resize of the short side; 0: torchvision's 256/224 rule
    interpolation: str    # both views' resizes

    @classmethod
    def as_asked(cls, cfg: ClassifierConfig) -> Views:
        return cls(cfg.image_size, cfg.train_crop_size, cfg.val_resize_size, cfg.interpolation)


def views_of(cfg: ClassifierConfig) -> Views:
    """The views a run takes: the flags', but with --image-size 0 and --pretrained the side the
    backbone was trained at (read from its checkpoint; a missing file is the pre-flight's to
    report), and with --test-only on published weights their own evaluation view (crop, resize,
    interpolation), as torchvision's and timm's scripts take it. Sizes the weights fix are checked
    as the flags' are (UsageError, naming the weights)."""
    asked = Views.as_asked(cfg)
    trained = pretrained_image_size(pretrained_file(cfg.pretrained)) \
        if cfg.pretrained and not cfg.image_size and Path(cfg.pretrained).exists() else None  # None: an exported backbone's
    weights = published_weights(cfg.weights) if cfg.test_only else None
    if trained:
        views = dataclasses.replace(asked, image_size=trained)
        source = f"--pretrained {cfg.pretrained} was trained at {trained} px, the side --image-size 0 takes"
    elif weights is not None:
        crop, resize, interpolation = weights.view
        views = Views(crop, crop if cfg.dataset in IMAGE_FILES else 0, resize, interpolation)
        source = f"--weights {cfg.weights} evaluates at {crop} px"
    else:
        return asked
    try:
        cfg.check_image_size(image_size_for(cfg.dataset, views.image_size))
        cfg.check_view_sizes(views)
    except UsageError as err:
        raise UsageError(f"{source}: {err}") from None
    return views


def describe_views(cfg: ClassifierConfig, views: Views, image_size: int) -> str:
    """The views' sizes and per-sample steps in words, for the start-up log and --check ('' when
    ``image_size``, the evaluation crop's side, says it all)."""
    if not (per_sample_flags(cfg) or views.train_crop_size or views.val_resize_size):
        return ""  # the views as --image-size alone says them
    steps = [f"--auto-augment {cfg.auto_augment}" if cfg.auto_augment else "",
             f"random erasing p {cfg.random_erase:g}" if cfg.random_erase else ""]
    extra = ", ".join(step for step in steps if step)
    if cfg.dataset not in IMAGE_FILES:
        return f"training view with {extra}" if extra else ""
    train = views.train_crop_size or image_size
    resize = evaluation_resize(image_size, views.val_resize_size)
    crop = f"random resized crop {train} px, flip" if cfg.augment else f"resize {evaluation_resize(train)} px, " \
        f"centre crop {train} px"
    return (f"training view: {crop}{', ' + extra if extra else ''}; evaluation view: resize {resize} px, centre "
            f"crop {image_size} px")


def script_data(cfg: ClassifierConfig, views: Views) -> ScriptData:
    """What this script adds to the shared data settings: repeated augmentation, the views' sizes
    (the side the weights fix among them), the views in words."""
    return ScriptData(plan_fields=dict(ra_reps=cfg.ra_reps, train_size=views.train_crop_size,
                                       val_resize=views.val_resize_size),
                      image_size=views.image_size, views=lambda image_size: describe_views(cfg, views, image_size))


@dataclass(kw_only=True)
class ClassifierRun(TrainRun):
    frozen_backbone: dict | None = None  # --linear-probe: the backbone's tensors at the start


# ----------------------------------------------------------------------------- building
def build_network(cfg: ClassifierConfig, info: DistInfo, num_classes: int, image_size: int) -> nn.Module:
    """The network for ``num_classes`` at ``image_size`` px (the run's plan), from --pretrained or
    --weights, as a linear probe with --linear-probe, on this rank's device."""
    torch.manual_seed(cfg.seed)  # identical initial weights whatever the world size
    model = build_model(cfg.arch, num_classes, image_size)
    trained_size = None
    if cfg.pretrained:
        path = pretrained_file(cfg.pretrained)
        trained_size = load_pretrained_backbone(model, path, cfg.arch)
        if info.is_main:
            log.info("backbone initialised from %s", path)
    if info.is_main:
        for remark in run_remarks(cfg, image_size, trained_size):
            log.warning("%s", remark)
    if cfg.weights:
        state, published = read_weights(cfg.weights, cfg.arch)
        fresh = put_weights(model, state, cfg.weights, exact=cfg.test_only, published=published)
        if info.is_main:
            log.info("weights from %s%s", cfg.weights, f"; {', '.join(fresh)} start fresh (another shape there)"
                     if fresh else "")
    if cfg.linear_probe:
        model = LinearProbe(model, num_classes, feature_norm=cfg.probe_bn)
    if cfg.sync_bn and info.is_distributed:  # the configuration refuses it on CPU ranks
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return place_model(model, info.device)


def build_ema(cfg: ClassifierConfig, model: nn.Module, info: DistInfo, global_batch: int) -> WeightsEMA:
    """--model-ema: the EMA of ``model``'s weights, its decay adjusted as torchvision does for
    ``global_batch`` (``ddp_utils/train/ema.py``)."""
    decay = ema_decay(cfg.model_ema_decay, global_batch, cfg.model_ema_steps, cfg.epochs)
    if info.is_main:
        log.info("EMA of the weights: decay %.6g per update after every %d optimizer step(s) (--model-ema-decay %g for "
                 "a global batch of %d over %d epochs)", decay, cfg.model_ema_steps, cfg.model_ema_decay, global_batch,
                 cfg.epochs)
    return WeightsEMA(model, decay, cfg.model_ema_steps, cfg.lr_warmup_epochs, cfg.warmup_steps)


def restore_ema(ema: WeightsEMA, resume: Resume | None, info: DistInfo) -> None:
    """The checkpoint's EMA, bit for bit; a checkpoint without one (a run that had no --model-ema,
    resumed with --allow-changes) starts it from the resumed weights (a copy until its first update)."""
    if resume is None:
        return
    saved = resume.checkpoint.get("model_ema")
    if saved is None:
        if info.is_main:
            log.warning("%s holds no EMA of the weights: the EMA starts from the resumed weights", resume.path)
        ema.module.load_state_dict(resume.checkpoint["model"])  # n_averaged stays 0: the next update copies
        return
    try:
        ema.load_state_dict(saved)
    except (RuntimeError, KeyError) as err:
        raise UsageError(f"--resume {resume.path}: its EMA does not fit this model ({mismatch_detail(err)})") from None


def training_criterion(cfg: ClassifierConfig) -> nn.Module:
    """The training loss: cross-entropy, with --label-smoothing (evaluation's stays plain), of integer
    targets or of the soft ones MixUp/CutMix make (smoothing then applies on top, as torchvision's)."""
    return nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)


def batch_mixer(cfg: ClassifierConfig, num_classes: int, rank: int) -> BatchMixer:
    """--mixup-alpha/--cutmix-alpha: torchvision's MixUp/CutMix of each training micro-batch on the
    device, seeded from (--seed, epoch, micro-batch of the epoch, rank) so that a resume replays it
    (``ddp_utils/data/mixing.py``); with both 0 it passes the batch through."""
    return BatchMixer(cfg.mixup_alpha, cfg.cutmix_alpha, num_classes, cfg.seed, rank)


def recipe_summary(cfg: ClassifierConfig) -> str:
    """What --check says of torchvision's recipe flags that are on (the views are on the data line)."""
    parts = [f"{cfg.optimizer}" + (" (Nesterov)" if cfg.nesterov else "")]
    decays = [f"{what} {cfg.weight_decay_of(name):g}" for what, name in
              (("norm layers", "norm_weight_decay"), ("biases", "bias_weight_decay"),
               ("transformer embeddings", "transformer_embedding_decay"))
              if cfg.weight_decay_of(name) is not None]
    parts.append(f"weight decay {cfg.weight_decay:g}" + (f" ({', '.join(decays)})" if decays else ""))
    if cfg.lr_warmup_epochs:
        parts.append(f"{cfg.lr_warmup_method} warm-up over {cfg.lr_warmup_epochs} epoch(s) from x{cfg.lr_warmup_decay:g}")
    if cfg.label_smoothing:
        parts.append(f"label smoothing {cfg.label_smoothing:g}")
    mixes = [f"{name} {alpha:g}" for name, alpha in (("MixUp", cfg.mixup_alpha), ("CutMix", cfg.cutmix_alpha)) if alpha]
    if mixes:
        parts.append(" or ".join(mixes) + " per micro-batch")
    if cfg.ra_reps > 1:
        parts.append(f"each sample {cfg.ra_reps} times an epoch")
    if cfg.model_ema:
        parts.append(f"EMA of the weights every {cfg.model_ema_steps} step(s) (--model-ema-decay {cfg.model_ema_decay:g})")
    if cfg.sync_bn:
        parts.append("SyncBatchNorm across the ranks on CUDA")
    return "; " + ", ".join(parts)


def run_remarks(cfg: ClassifierConfig, image_size: int, trained: int | None) -> list[str]:
    """What a user should know before the run starts (said once at start, and by --check): a
    flag accepted that does nothing, the backbone a probe starts from; ``trained``: the image side
    --pretrained was trained at, if known, against this run's ``image_size``."""
    remarks = []
    if cfg.auto_augment == "ta_wide" and cfg.ra_magnitude != 9:
        remarks.append(f"--ra-magnitude/--policy-magnitude {cfg.ra_magnitude} does nothing with --auto-augment "
                       f"ta_wide (TrivialAugmentWide has no magnitude setting; torchvision's README gives it in its "
                       f"MaxViT command)")
    if cfg.linear_probe and not cfg.pretrained:
        remarks.append("--linear-probe without --pretrained: probing a randomly initialised backbone (a baseline "
                       "to compare a pretrained one with)")
    if trained and trained != image_size:
        remarks.append(f"--pretrained {cfg.pretrained} was trained at {trained} px, this run sees "
                       f"{image_size} px: its features may not transfer (drop --image-size to use "
                       f"{trained})")
    return remarks


def memory_at_the_batch(cfg: ClassifierConfig, num_classes: int, parameters: int, image_size: int) -> str:
    """--check's estimate of one rank's training memory on its device: fp32 weights, their
    gradients, the optimizer's state and the EMA, and the activations one micro-batch keeps for
    the backward (``activation_bytes``; the allocator's slack and the kernels' workspaces left out)."""
    copies = 2 + state_copies(cfg.optimizer, cfg.momentum) + bool(cfg.model_ema)
    held = 4 * parameters * copies
    train = cfg.train_crop_size or image_size
    kept = activation_bytes(cfg.arch, num_classes, train, cfg.batch_size) if not cfg.linear_probe else None
    said = (f"activations kept for the backward of {cfg.batch_size} images at {train} px {size_text(kept)} (fp32; "
            f"about half under bf16/fp16 autocast)" if kept is not None else
            "activations not estimated (the meta device cannot run this model)")
    return (f"memory at the batch: about {size_text(held + (kept or 0))} a rank: weights, gradients, "
            f"{cfg.optimizer}'s state{' and the EMA' if cfg.model_ema else ''} {size_text(held)} (fp32), {said}")


def check_classifier(cfg: ClassifierConfig, train: Dataset, image_size: int,
                     lines: list[str]) -> tuple[dict, list[str]]:
    """--check's share of setup: the class count a resume must match, --pretrained fitting --arch,
    the network's size at ``image_size`` (after ``lines``)."""
    num_classes = num_classes_of(train)
    trained_size = load_pretrained_backbone(build_model(cfg.arch, num_classes, image_size),
                                            pretrained_file(cfg.pretrained), cfg.arch) if cfg.pretrained else None
    if cfg.weights:  # read and fitted as the run will
        state, published = read_weights(cfg.weights, cfg.arch)
        put_weights(build_model(cfg.arch, num_classes, image_size), state, cfg.weights,
                    exact=cfg.test_only, published=published)
        view = published_weights(cfg.weights).view if cfg.test_only and published else None  # crop, resize, interpolation
        lines = [*lines, f"{'test only: evaluates' if cfg.test_only else 'fine-tunes'} --weights {cfg.weights}" +
                 (f" at its evaluation view (resize {view[1]} px, centre crop {view[0]} px, {view[2]})" if view else "")]
    parameters = parameter_count(cfg.arch, num_classes, image_size)
    return {"num_classes": num_classes}, [*lines, f"network: {cfg.arch} for {num_classes} classes, {parameters:,} parameters",
                                          memory_at_the_batch(cfg, num_classes, parameters, image_size),
                                          *(f"warning: {remark}" for remark in run_remarks(cfg, image_size, trained_size))]


def build_loaders(cfg: ClassifierConfig, views: Views, session: RunSession, resolved: ResolvedSettings,
                  listings: tuple | None, fresh: bool) -> Loaders:
    """This rank's batches for the run (torchvision's training view, the evaluation view), closed
    with the session; ``fresh``: a run that starts from step 0 (its first shards fetched at once)."""
    info = session.info
    recipe = classifier_recipe(cfg.dataset, resolved.image_size, cfg.augment, cfg.normalization,
                               interpolation=views.interpolation, **cfg.augmentation_policy())
    return session.close_loaders_at_exit(build_data(data_plan(cfg, resolved, recipe, script_data(cfg, views), listings),
                                                    rank=info.rank, world_size=info.world_size, device=info.device,
                                                    ranks_on_node=info.local_world_size, node=info.node, fresh=fresh))


def setup(cfg: ClassifierConfig, session: RunSession) -> ClassifierRun:
    info = session.info
    with all_ranks_agree():
        views = views_of(cfg)  # the sizes --pretrained fixes
    resume, resolved, listings = preflight(cfg, session, script_data(cfg, views))  # every rank checked; "auto" resolved; files listed once
    with all_ranks_agree():  # every check that can fail, before the first collective (DDP's broadcast)
        loaders = build_loaders(cfg, views, session, resolved, listings, fresh=resume is None)
        preview = augmentation_grid(loaders) if info.is_main and resume is None else None  # TensorBoard's, once
        model = build_network(cfg, info, loaders.num_classes, resolved.image_size)
        ema = build_ema(cfg, model, info, resolved.global_batch) if cfg.model_ema else None
        if info.is_main and (cfg.mixup_alpha or cfg.cutmix_alpha):
            log.info("%s of each training micro-batch on each rank: soft targets, train/loss against them",
                     " or ".join(f"{name} alpha {alpha:g}" for name, alpha in
                                 (("MixUp", cfg.mixup_alpha), ("CutMix", cfg.cutmix_alpha)) if alpha))
        torch.manual_seed(cfg.seed + 1000 * info.rank)  # per-rank stream for anything random later
        groups = parameter_groups(model, cfg.weight_decay, cfg.weight_decay_of("norm_weight_decay"),
                                  cfg.weight_decay_of("bias_weight_decay"),
                                  cfg.weight_decay_of("transformer_embedding_decay"))  # frozen parameters left out
        optimizer, lr_schedule, scaler, total_steps = build_optimization(cfg, groups, loaders.batches_per_epoch,
                                                                         info.device, cfg.optimizer, cfg.nesterov)
        facts = {"num_classes": loaders.num_classes}  # a checkpoint must match them
        state = state_to_start_from(resume, cfg, SCRIPT, facts, model=model, optimizer=optimizer, scaler=scaler,
                                    sampler=loaders.train_sampler, info=info)
        if ema is not None:
            restore_ema(ema, resume, info)
    stop_if_complete(cfg, state, resume)  # a finished run resumed: its last metrics, exit 0
    network = wrap_network(model, info, cfg.compile)  # DDP: rank 0's weights on every rank
    tb = open_run_folder(cfg, session, resume, state.step, resolved, preview, listings)  # nothing written before
    return ClassifierRun(
        cfg=cfg, info=info, session=session, loaders=loaders, model=model, network=network, optimizer=optimizer,
        lr_schedule=lr_schedule, scaler=scaler, total_steps=total_steps, state=state, tb=tb, script=SCRIPT, resolved=resolved,
        facts=facts, frozen_backbone=model.backbone_snapshot() if cfg.linear_probe else None, ema=ema)


# ----------------------------------------------------------------------------- training
def train_one_epoch(run: ClassifierRun, meter: StepMeter) -> None:
    """Train on the rest of this epoch, one optimizer step per window of --accum-steps
    micro-batches; return early at --max-steps or a stop signal."""
    cfg, info = run.cfg, run.info
    criterion = training_criterion(cfg)
    mix = batch_mixer(cfg, run.loaders.num_classes, info.rank)
    run.network.train()
    for micro, (images, targets) in run.batches.this_epoch():
        images, targets = to_device(images, info.device), targets.to(info.device, non_blocking=True)
        # MixUp/CutMix in this rank's micro-batch (soft targets), keyed by its index in the epoch
        images, targets = mix(images, targets, run.state.epoch, run.state.batches_done - 1)
        # DDP all-reduces gradients inside backward(); under no_sync() it only adds them up in
        # .grad. Skipping it on all but the window's last micro-step sends them once per step.
        with no_sync(run.network, enabled=not micro.is_last):
            with autocast(cfg.amp, info.device):
                loss = criterion(run.network(images), targets)
            # This micro-batch's share of the window's mean loss, back-propagated at once: its
            # graph is freed here, before any optimizer step changes the weights.
            run.scaler.scale(loss / micro.window_size).backward()
        meter.add_micro(micro.window_size, len(images) * info.world_size, loss=loss)
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
        if verdict.may_step:  # else skipped on every rank alike
            run.optimizer.step()  # the unscaled gradients: GradScaler.step would read the overflow again
        run.scaler.update()  # fp16: lowers the scale after an overflow, raises it after enough good steps
        # Zeroed in place under DDP (its buckets hold them; new tensors would be copied in every
        # step); freed in one process.
        run.optimizer.zero_grad(set_to_none=not info.is_distributed)
        run.state.step += 1
        if run.ema is not None and not verdict.nonfinite_ranks:  # --model-ema, by optimizer steps of the epoch
            run.ema.after_step(run.model, run.state.step - 1, run.state.epoch,
                               (run.state.batches_done - 1) // cfg.accum_steps, info.is_distributed)
        if cfg.debug:
            check_gradients_cleared(run.model)
        # After the step: the epoch's end, the log, a skipped step counted, a stop, a checkpoint.
        run.end_epoch_if_done()
        meter.end_step(run.state.step, run.state.epoch_number, force=ends_the_run(run, verdict), lr=lr)
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


def check_gradients_cleared(model: nn.Module) -> None:
    """--debug: no gradient may outlive its optimizer step (freed in one process, zeroed in
    place under DDP, whose buckets hold them)."""
    for name, param in unwrap(model).named_parameters():
        if param.grad is not None and param.grad.count_nonzero():
            raise AssertionError(f"gradient of {name} survived the optimizer step's zero_grad")


@torch.no_grad()
def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader, info: DistInfo, amp: str) -> dict[str, float]:
    """Top-1 and top-5 accuracy and mean loss over the whole validation split, each sample
    counted once (top-5: the label among the 5 highest logits, or all of them for fewer classes).

    Runs the bare module: a DDP forward may broadcast buffers, a collective that would hang when
    ranks hold different numbers of validation batches.
    """
    model = unwrap(model)
    sync_buffers_from_rank0(model)
    was_training = model.training
    model.eval()
    # loss, top-1 and top-5 correct, count: summed on the device, read once at the end
    sums = torch.zeros(4, dtype=torch.float64, device=info.device)
    for images, targets in loader:
        images, targets = to_device(images, info.device), targets.to(info.device, non_blocking=True)
        with autocast(amp, info.device):
            logits = model(images)
        sums[0] += nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices == targets[:, None]  # B x 5
        sums[1] += top5[:, 0].sum()
        sums[2] += top5.any(dim=1).sum()
        sums[3] += len(targets)
    model.train(was_training)
    total = dict(zip(("loss", "correct1", "correct5", "count"), all_reduce_sum(sums).tolist()))
    return {"loss": total["loss"] / total["count"], "acc1": 100.0 * total["correct1"] / total["count"],
            "acc5": 100.0 * total["correct5"] / total["count"], "count": total["count"]}


def fit(run: ClassifierRun) -> dict[str, float]:
    cfg, state = run.cfg, run.state
    meter = start_training(run)
    metrics: dict[str, float] = {}
    while not run.finished():
        train_one_epoch(run, meter)
        meter.progress.end_line()
        if run.preempted:  # checkpoint already written; leave for the requeue
            return metrics
        save_checkpoint(run)  # before evaluating: a preemption during evaluation loses nothing
        metrics = evaluate(run.model, run.loaders.val, run.info, cfg.amp)
        stop_if_files_unreadable(run, f"epoch {state.epoch_number}'s validation")
        run.tb.scalars(state.step, val__loss=metrics["loss"], val__acc1=metrics["acc1"], val__acc5=metrics["acc5"])
        log.info("epoch %d step %d: val loss %.4f, val acc1 %.2f%%, acc5 %.2f%% (%d images)", state.epoch_number,
                 state.step, metrics["loss"], metrics["acc1"], metrics["acc5"], metrics["count"])
        if run.ema is not None:  # --model-ema: the average, scored on the same images
            ema = evaluate(run.ema.module, run.loaders.val, run.info, cfg.amp)
            run.tb.scalars(state.step, val_ema__loss=ema["loss"], val_ema__acc1=ema["acc1"], val_ema__acc5=ema["acc5"])
            log.info("epoch %d step %d: ema val loss %.4f, ema acc1 %.2f%%, acc5 %.2f%% (%d images)",
                     state.epoch_number, state.step, ema["loss"], ema["acc1"], ema["acc5"], ema["count"])
    if run.frozen_backbone is not None:
        if not tensors_equal(run.frozen_backbone, run.model.backbone_snapshot()):
            raise RuntimeError("the frozen backbone changed during the linear probe")
        log.info("linear probe: frozen backbone unchanged (%d tensors compared bit for bit)",
                 len(run.frozen_backbone))
    if run.info.is_distributed:
        digest = check_replicas_identical(dict(unwrap(run.model).named_parameters()))
        log.info("weights identical on all %d ranks (sha256 %s)", run.info.world_size, digest[:16])
        if run.ema is not None:  # its parameters and buffers, BatchNorm statistics included
            digest = check_replicas_identical(run.ema.state_dict())
            log.info("EMA of the weights identical on all %d ranks (sha256 %s)", run.info.world_size, digest[:16])
    if metrics:
        log.info("final val acc1 %.2f%%, acc5 %.2f%% at step %d", metrics["acc1"], metrics["acc5"], state.step)
    return metrics


def evaluate_weights(cfg: ClassifierConfig, session: RunSession) -> dict[str, float]:
    """--test-only: --weights on every rank's share of the validation split, acc@1 and acc@5
    printed as torchvision's script prints them; nothing is written."""
    info = session.info
    with all_ranks_agree():
        problem = check_data_dir(cfg.dataset, cfg.data_dir, cfg.download)
        if problem:
            raise UsageError(problem)
        views = views_of(cfg)  # published weights: their own evaluation view
    listings, _ = list_image_files_once(cfg, info)
    resolved = resolved_settings(cfg, info.launcher, info.local_world_size, info.device, world_size=info.world_size,
                                 script=script_data(cfg, views))
    with all_ranks_agree():
        loaders = build_loaders(cfg, views, session, resolved, listings, fresh=False)
        model = build_network(cfg, info, loaders.num_classes, resolved.image_size)
    release_held_logs(show=True)
    metrics = evaluate(model, loaders.val, info, cfg.amp)
    files, faults = loaders.unreadable.on_every_rank()
    if files or faults:  # every rank has the same lists: each stops with exit 2, rank 0 says why
        raise UsageError(f"the evaluation met {describe_unreadable(files)}; {fix_hint(files)}" if files else
                         f"the evaluation: {faults[0]}")
    log.info("Test: Acc@1 %.3f Acc@5 %.3f (%d images; --weights %s, evaluation view: resize %d px, centre crop %d px, "
             "%s)", metrics["acc1"], metrics["acc5"], metrics["count"], cfg.weights,
             evaluation_resize(resolved.image_size, views.val_resize_size), resolved.image_size, views.interpolation)
    return metrics


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(ClassifierConfig, argv, __doc__)  # bad flags: one line, exit code 2
    if cfg.check or cfg.check_data:  # every check of setup, in this one process; launch/ runs it first
        model = f"{cfg.arch}" + (", linear probe" if cfg.linear_probe else "") + \
            (f", from {cfg.pretrained}" if cfg.pretrained else "") + recipe_summary(cfg)
        defaults = ["defaults: torchvision's train.py's for every flag not given (--data-path brings them; "
                    "docs/recipe.md)"] if flag_defaults(ClassifierConfig, sys.argv[1:] if argv is None else argv) else []
        return check_only(cfg, SCRIPT, model,
                          lambda train, image_size: check_classifier(cfg, train, image_size, defaults),
                          lambda: script_data(cfg, views_of(cfg)))
    with RunSession(cfg) as session:  # process group, logging, signals, exit codes, clean-up
        if cfg.test_only:
            evaluate_weights(cfg, session)
            return session.exit_code
        fit(setup(cfg, session))  # no name holds the run: its DDP model dies before the group (cleanup_distributed)
    return session.exit_code


if __name__ == "__main__":
    sys.exit(main())
