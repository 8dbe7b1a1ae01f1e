"""The settings both training scripts share (each script's config dataclass extends this one),
the command line that fills them in, and what the settings left to the machine resolve to
(:class:`ResolvedSettings`)."""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence, TypeVar

import torch

from ..config import (
    AppliesTo,
    UsageError,
    check_applies,
    check_bounds,
    config_dict,
    fields_on_resume,
    flag_name,
    opt,
    parse_config,
    per_sample_flags,
    recorded_run,
)
from ..data.object_store import is_object_store
from ..data.order import ORDERS
from ..data.pipeline import DataPlan, StoreCache
from ..data.recipes import AUG_ON, AugmentRecipe, augment_on_device
from ..data.sets import DATASETS, IMAGE_FILES, NORMALIZATIONS, image_size_for
from ..data.shard_cache import START_DOWNLOADS, WAIT_SLACK_S
from ..models.backbones import HEADED_BACKBONES, SMALL_NETS, input_refusal, min_image_size
from ..runtime.device import check_device, device_type, visible_cuda_devices
from ..runtime.launch import LaunchEnv, detect_launch, restart_count
from ..runtime.logs import say_error
from ..runtime.precision import AMP_MODES
from ..runtime.stopping import EXIT_USAGE
from .optimization import EPOCH_WARMUP_SCHEDULES, LR_SCHEDULES, WARMUP_METHODS, parse_milestones

C = TypeVar("C", bound="TrainConfig")
RESUME_IF_RESTARTED = "if-restarted"


def data_flag(where: str, holds: Callable[[Any], bool]) -> AppliesTo:
    """A data flag read only where ``holds(cfg)`` (``where``, in words); given with other data,
    it is refused: "--download does nothing with --dataset digits; drop it (it applies to
    cifar10)"."""
    return AppliesTo(where, holds, lambda flag, cfg: f"{flag} does nothing with --dataset {cfg.dataset}; drop it (it "
                                                     f"applies to {where})")


def data_sets(*names: str) -> AppliesTo:
    """A data flag that the data sets ``names`` alone read."""
    return data_flag(", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0],
                     lambda cfg: cfg.dataset in names)


def needs_flag(name: str) -> AppliesTo:
    """A flag that refines field ``name``'s: it does nothing unless that one is on (not 0, off or
    empty)."""
    other = flag_name(name)
    return AppliesTo(other, lambda cfg: bool(getattr(cfg, name)),
                     lambda flag, cfg: f"{flag} does nothing without {other}; add it, or drop {flag}")


def only_with(name: str) -> AppliesTo:
    """:func:`needs_flag`'s rule for a flag that means something only beside field ``name``'s
    (``--allow-changes`` beside ``--resume``), refused in the words "FLAG only applies with OTHER"."""
    needed = needs_flag(name)
    return replace(needed, refusal=lambda flag, cfg: f"{flag} only applies with {needed.where}")


# --aug-on device: whole batches on the device; a per-sample step (opt(per_sample=True)) runs in the workers only
PER_BATCH = AppliesTo("no per-sample step", lambda cfg: not per_sample_flags(cfg),
                      lambda flag, cfg: f"{per_sample_flags(cfg)[0]} runs per sample in the DataLoader workers, not on "
                                        f"the device: give {flag} loader (or auto)")


def schedules(*kinds: str) -> AppliesTo:
    """A setting of the LR schedules ``kinds`` alone."""
    where = "--lr-schedule " + " or ".join(kinds)
    return AppliesTo(where, lambda cfg: cfg.lr_schedule in kinds,
                     lambda flag, cfg: f"{flag} applies to {where}, not {cfg.lr_schedule}; drop it")


def check_sync_bn(launch: LaunchEnv, device: str, cuda_devices: int) -> None:
    """--sync-bn (both scripts') on several ranks needs CUDA: SyncBatchNorm has no CPU kernel."""
    if launch.world_size > 1 and device_type(device, cuda_devices) != "cuda":
        raise UsageError(f"--sync-bn needs CUDA: SyncBatchNorm has no CPU kernel, and these {launch.world_size} "
                         f"ranks train on CPUs; drop --sync-bn (each rank then normalises its own batch)")


IN_AN_OBJECT_STORE = data_flag("shards in an object store (s3://)", lambda cfg: is_object_store(cfg.data_dir))

# --help's sections, each named once; a field names its own (opt(group=...))
DATA, MODEL, SPEED, RUN_FOLDER, DISTRIBUTED = ("data", "model and optimisation", "precision and speed",
                                              "run folder and checkpoints", "distributed")

# s: --dist-timeout beyond --store-timeout: how long a wait for a shard may last past it
# (shard_cache.WAIT_SLACK_S), and as much again for the step that stops to reach the agreement
STORE_MARGIN_S = 2 * WAIT_SLACK_S
OUT_HELP = ("run folder: config.json, checkpoint_last.pt, tb/ (TensorBoard); a fresh run refuses a folder "
            "that already holds a checkpoint")


@dataclass
class TrainConfig:
    SECTIONS: ClassVar[tuple[str, ...]] = (DATA, MODEL, SPEED, RUN_FOLDER, DISTRIBUTED)  # --help's order
    VIEWS: ClassVar[int] = 1  # augmented views of each training sample the script trains on

    # data
    dataset: str = opt("digits", "data set: digits (ships with scikit-learn, no download), cifar10, "
                       "imagefolder (DIR/train, DIR/val class folders), shards (an image folder as write_shards.py "
                       "wrote it) or synthetic (random tensors)",
                       choices=DATASETS, group=DATA)
    data_dir: str = opt("./data", "where cifar10 is (or is downloaded to) / the ImageFolder root / the shards' "
                        "folder, or their s3://BUCKET/PREFIX (endpoint and credentials from the AWS_* variables)",
                        group=DATA, on_resume="free", applies_to=data_sets("cifar10", "imagefolder", "shards"))
    order: str = opt("auto", "training order: shards = each rank reads whole shards of its own, a window of 4 "
                     "shards shuffled at a time (shards on a file system train as from a bucket, bit for bit); "
                     "samples = one permutation of all samples shared out among the ranks (shards on a file system "
                     "train as their image folder, bit for bit); auto = shards for --dataset shards, else samples",
                     choices=("auto", *ORDERS), group=DATA, value_applies={
                         "shards": AppliesTo("--dataset shards", lambda cfg: cfg.dataset == "shards",
                                             lambda flag, cfg: f"{flag} shards reads whole shards; --dataset "
                                             f"{cfg.dataset} has none (drop --order, or train on shards: --dataset "
                                             f"shards)"),
                         "samples": AppliesTo("data on a file system", lambda cfg: not is_object_store(cfg.data_dir),
                                              lambda flag, cfg: f"{flag} samples would read every shard of "
                                              f"{cfg.data_dir} in every batch; from an object store the order is the "
                                              f"shards' (drop --order)")})
    shard_cache_dir: str = opt("", "the node-local folder that holds the node's cache of the shards "
                               "(shared by its ranks; emptied at a run's start, an attempt that resumes keeping "
                               "the shards it lists; deleted when the run ends unless --keep-shard-cache, kept "
                               "for the next attempt when it stops to be started again); '' = the system's "
                               "temporary folder (TMPDIR)",
                               group=DATA, on_resume="free", applies_to=IN_AN_OBJECT_STORE)
    shard_cache_gb: float = opt(0.0, "GB of local disk the node's cache of shards may fill, shared by its ranks "
                                "(it never holds more; the shards held least recently go first); 0 = what the ranks "
                                "need: each the shards its loaders' workers read at once (from --workers, --batch-size "
                                "and the images per shard), max(--shard-read-ahead, --shard-downloads) more and one, x "
                                "the largest shard; more keeps shards for later epochs", group=DATA, on_resume="free",
                                at_least=0, applies_to=IN_AN_OBJECT_STORE)
    shard_read_ahead: int = opt(8, "shards each rank downloads beyond those its workers read now, at least (as many "
                                "as its downloads in flight when more; the next epoch's first ones before this epoch "
                                "ends), within its share of the node's cache", group=DATA, on_resume="free",
                                at_least=0, applies_to=IN_AN_OBJECT_STORE)
    shard_downloads: int = opt(16, f"the most shard downloads at once per rank, a connection each (one GET per "
                               f"shard): a rank starts with {START_DOWNLOADS} and keeps as many in flight as its "
                               f"loaders' demand and each download's pace need, starting low again after the store "
                               f"failed to answer", group=DATA, on_resume="free", above=0, at_most=32,
                               applies_to=IN_AN_OBJECT_STORE)
    store_timeout: float = opt(300.0, "seconds a request to the store may take, its faults (unreachable, "
                               "throttling) and a shard's whole download included, before every rank stops with exit "
                               "75 after a checkpoint, to be restarted; shorter outages are waited out (a wait for a "
                               f"shard lasts at most {WAIT_SLACK_S:g} s more). Less than --dist-timeout - "
                               f"{STORE_MARGIN_S:g}",
                               group=DATA, on_resume="free", above=0, applies_to=IN_AN_OBJECT_STORE)
    store_if_match: bool = opt(True, "pin each shard's GET to the version the run listed with If-Match on its ETag "
                               "(the answer's ETag is compared too); --no-store-if-match for a store that rejects "
                               "If-Match: the answer's ETag alone is compared", group=DATA, on_resume="free",
                               applies_to=IN_AN_OBJECT_STORE)
    keep_shard_cache: bool = opt(False, "keep the node's cache folder of shards when the run ends",
                                 group=DATA, on_resume="free", applies_to=IN_AN_OBJECT_STORE)
    download: bool = opt(False, "download cifar10 into --data-dir if it is not there (once per node, by its local rank 0)",
                         group=DATA, on_resume="free", applies_to=data_sets("cifar10"))
    image_size: int = opt(0, "input side in pixels; 0 = the data set's own (32, or 224 for imagefolder)",
                          group=DATA, at_least=0)
    synthetic_samples: int = opt(2048, "training samples of the synthetic data set (val: a quarter)",
                                 group=DATA, above=0, applies_to=data_sets("synthetic"))
    augment: bool = opt(True, "random crop (+ flip) on training images; off = deterministic pipeline "
                        "(train_moco.py refuses it: its two views must differ)", group=DATA)
    normalization: str = opt("auto", "input mean/std: auto = the data set's own; cifar10-demo = the MoCo "
                             "authors' CIFAR-10 demo's (std 0.2023, 0.1994, 0.2010 instead of 0.2470, 0.2435, "
                             "0.2616)", choices=NORMALIZATIONS, group=DATA, value_applies={
                                 "cifar10-demo": AppliesTo("--dataset cifar10", lambda cfg: cfg.dataset == "cifar10",
                                                           lambda flag, cfg: f"{flag} cifar10-demo is CIFAR-10's; "
                                                           f"--dataset {cfg.dataset} takes {flag} auto")})
    aug_on: str = opt("auto", "where training images are augmented: device = whole batches on the training device "
                      "(in-memory data entirely; ImageFolder: workers decode, the device crops and does the rest, "
                      "evaluation's view too); loader = per sample in DataLoader workers (torchvision, the "
                      "reference); auto = device, except ImageFolder on a CPU", choices=AUG_ON,
                      group=DATA, on_resume="free", value_applies={"device": PER_BATCH})
    decode_on: str = opt("auto", "where image files (imagefolder) are decoded with --aug-on device: loader = in "
                         "the DataLoader workers (libjpeg-turbo); device = the workers only read the files and the "
                         "training process decodes each batch on its device (nvJPEG on CUDA; a file it may not "
                         "take, such as a CMYK or progressive JPEG or a PNG, is decoded by its worker); auto = loader",
                         choices=("auto", "loader", "device"), group=DATA, on_resume="free",
                         applies_to=data_sets(*IMAGE_FILES))
    workers: int = opt(-1, "data-loader worker processes per rank; -1 = auto (0 for in-memory data)",
                       group=DATA, on_resume="free", at_least=-1)
    # model and optimisation
    arch: str = opt("small_cnn", f"network: {HEADED_BACKBONES}, whose classifier MoCo replaces with its "
                    f"projection head (--check names it)",
                    group=MODEL, on_resume="fixed", spellings=("-a",))
    batch_size: int = opt(64, "images per rank per micro-step; the global batch is "
                          "world_size x accum_steps x batch_size", group=MODEL, above=0)
    accum_steps: int = opt(1, "micro-steps per optimizer step (gradient accumulation)",
                           group=MODEL, above=0)
    lr_ranks: int = opt(0, "the ranks a recipe's --lr was published for, each with one micro-step of --batch-size "
                        "(torchvision's commands: 8 GPUs); a run of another global batch says so at --check and at "
                        "start, with the --accum-steps that restores it; 0 = unsaid", group=MODEL, on_resume="free",
                        at_least=0)
    epochs: int = opt(10, "passes over the training set; the LR schedule spans all of them",
                      group=MODEL, on_resume="free", above=0)
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = no limit); the schedule "
                         "still spans --epochs", group=MODEL, on_resume="free", at_least=0)
    lr: float = opt(0.1, "peak learning rate for the global batch (no automatic scaling)",
                    group=MODEL, above=0)
    momentum: float = opt(0.9, "SGD momentum (train_classifier.py: RMSprop's too)", group=MODEL, at_least=0,
                          below=1)
    weight_decay: float = opt(5e-4, "weight decay: SGD's L2 added to the gradient (train_classifier.py: RMSprop's "
                              "likewise, AdamW's decoupled), on every parameter unless train_classifier.py's "
                              "--norm-weight-decay or --bias-weight-decay give some their own",
                              group=MODEL, at_least=0, spellings=("--wd",))
    lr_schedule: str = opt("cosine", "after warm-up: cosine decay to 0 over --epochs, step (x0.1 at each "
                           "--lr-milestones epoch), constant, cosine-epoch (the MoCo CIFAR-10 demo's: "
                           "lr x 0.5(1 + cos(pi e / epochs)) through epoch e = 1..epochs; a warm-up scales "
                           "it); torchvision's --lr-scheduler, each stepped after every epoch: cosineannealinglr "
                           "(CosineAnnealingLR: --lr-min + (lr - --lr-min) x 0.5(1 + cos(pi t / T)) through epoch "
                           "t = 0..T-1 after --lr-warmup-epochs, T = --epochs - --lr-warmup-epochs; the last epoch "
                           "above it), steplr (StepLR: x --lr-gamma every --lr-step-size epochs) or exponentiallr "
                           "(ExponentialLR: x --lr-gamma every epoch)",
                           choices=LR_SCHEDULES, group=MODEL, spellings=("--lr-scheduler",))
    lr_milestones: str = opt("", "comma-separated epochs where the step schedule multiplies the LR by 0.1; "
                             "N%% = N percent of --epochs", group=MODEL)
    lr_step_size: int = opt(30, "--lr-schedule steplr: epochs between the LR's decays by --lr-gamma (torchvision's "
                            "StepLR step_size)", group=MODEL, above=0, applies_to=schedules("steplr"))
    lr_gamma: float = opt(0.1, "--lr-schedule steplr: the LR's factor every --lr-step-size epochs; exponentiallr: "
                          "its factor every epoch (torchvision's StepLR / ExponentialLR gamma)", group=MODEL, above=0,
                          applies_to=schedules("steplr", "exponentiallr"))
    lr_min: float = opt(0.0, "--lr-schedule cosineannealinglr: the LR it decays to (torchvision's --lr-min, "
                        "CosineAnnealingLR's eta_min)", group=MODEL, at_least=0,
                        applies_to=schedules("cosineannealinglr"))
    warmup_steps: int = opt(0, "linear LR warm-up, in optimizer steps: step s (from 0) runs at "
                            "lr x (s + 1) / N", group=MODEL, at_least=0)
    lr_warmup_epochs: int = opt(0, "torchvision's LR warm-up, in epochs N (--lr-schedule cosineannealinglr, "
                                "steplr, exponentiallr or constant; instead of --warmup-steps): each epoch e < N (from 0) runs at one LR, "
                                "lr x (d + (1 - d) e / N) with d = --lr-warmup-decay (--lr-warmup-method constant: "
                                "lr x d), then the schedule starts", group=MODEL, at_least=0)
    lr_warmup_method: str = opt("linear", "linear (torchvision's LinearLR) or constant "
                                "(its ConstantLR)", choices=WARMUP_METHODS, group=MODEL,
                                applies_to=needs_flag("lr_warmup_epochs"))
    lr_warmup_decay: float = opt(0.01, "the LR factor the warm-up starts at (torchvision's "
                                 "--lr-warmup-decay)", group=MODEL, above=0, at_most=1,
                                 applies_to=needs_flag("lr_warmup_epochs"))
    clip_grad: float = opt(0.0, "clip the global gradient L2 norm to this value; 0 = off",
                           group=MODEL, at_least=0, spellings=("--clip-grad-norm",))
    amp: str = opt("auto", "mixed precision: auto = bf16 on CUDA and fp32 on CPU; bf16, fp16 (with a "
                   "GradScaler) or none (fp32; TF32 matmuls on CUDA unless --no-tf32); torchvision (what a bare "
                   "--amp means, torchvision's): fp16 with a GradScaler on CUDA, fp32 on CPU (its autocast is "
                   "CUDA's)", choices=AMP_MODES, group=SPEED, on_resume="free", bare="torchvision")
    tf32: bool = opt(True, "CUDA: fp32 matmuls and convolutions on TF32 tensor cores (inputs rounded to "
                     "10-bit mantissas); --no-tf32 computes them in full fp32",
                     group=SPEED, on_resume="free")
    deterministic: bool = opt(False, "CUDA: repeatable runs: cuDNN's deterministic algorithms without "
                              "autotuning, no TF32, torch.use_deterministic_algorithms (slower; an operation "
                              "without a deterministic CUDA kernel stops the run naming it). CPU runs repeat "
                              "without it", group=SPEED, on_resume="free")
    compile: bool = opt(False, "torch.compile the network(s) (MoCo: query and key encoder separately); "
                        "slower start, faster steps", group=SPEED, on_resume="free")
    seed: int = opt(0, "seed for model init (same on every rank), data order and augmentation",
                    group=MODEL)
    # runtime
    device: str = opt("auto", "auto = cuda:LOCAL_RANK with NCCL if CUDA is available, else CPU with gloo",
                      choices=("auto", "cpu", "cuda"), group=DISTRIBUTED, on_resume="free")
    dist_timeout: float = opt(600.0, "seconds a collective may wait for a peer before the job fails",
                              group=DISTRIBUTED, on_resume="free", above=0)
    out: str = opt("runs/run", OUT_HELP, group=RUN_FOLDER, on_resume="invocation")
    resume: str = opt("", "'auto' = continue from the newest readable checkpoint in OUT (start fresh if "
                      "there is none); a checkpoint file, or a run folder (its newest checkpoint); "
                      "'if-restarted' = start fresh, but 'auto' in a restarted attempt (torchrun "
                      "--max-restarts, SLURM requeue: what launch/ adds); empty = start fresh",
                      group=RUN_FOLDER, on_resume="invocation", from_file=False)
    overwrite: bool = opt(False, "start over in an OUT that holds a run: its checkpoints, TensorBoard "
                          "events and config are deleted first",
                          group=RUN_FOLDER, on_resume="invocation", from_file=False)
    allow_changes: bool = opt(False, "continue although the checkpoint's run had other settings that make it "
                              "another experiment (data set, LR, batch, ...); the changes are recorded in "
                              "OUT/config.json's history",
                              group=RUN_FOLDER, on_resume="invocation", from_file=False, applies_to=only_with("resume"))
    check: bool = opt(False, "check only: flags, paths, data and the checkpoint to resume; print the run "
                      "that would start and exit 0 (or 2, naming the problem); no process group, nothing "
                      "written (launch/ scripts run it before starting the workers)",
                      group=RUN_FOLDER, on_resume="invocation", from_file=False)
    check_data: bool = opt(False, "--check, and decode every image file of both splits on "
                           "every CPU this process may use: each file that cannot be decoded is listed with its "
                           "reason, exit 2 if there is one; shards: each one's sha256 checked against the index first",
                           group=RUN_FOLDER, on_resume="invocation", from_file=False,
                           applies_to=data_sets(*IMAGE_FILES))
    ckpt_every: int = opt(0, "also checkpoint every this many optimizer steps (0 = at epoch ends only)",
                          group=RUN_FOLDER, on_resume="free", at_least=0)
    keep_checkpoints: int = opt(2, "checkpoints kept in OUT: checkpoint_last.pt and N-1 older ones "
                                "(checkpoint_prev1.pt, ...); the oldest goes only once a new one is on disk",
                                group=RUN_FOLDER, on_resume="free", above=0)
    skip_nonfinite: int = opt(0, "optimizer steps with a NaN/Inf loss that may be skipped (nothing is "
                              "updated) before the run stops with exit code 3",
                              group=RUN_FOLDER, on_resume="free", at_least=0)
    log_every: int = opt(20, "optimizer steps between progress lines and train/* TensorBoard points",
                         group=RUN_FOLDER, on_resume="free", above=0)
    debug: bool = opt(False, "one process, tiny data subset, autograd anomaly detection, extra checks",
                      group=RUN_FOLDER)

    def validate(self, launch: LaunchEnv, cuda_devices: int) -> None:
        """Raise UsageError (one line, with the fix) for flags that cannot train: checks of the
        flags, the launch and the CUDA devices visible alone (all given: nothing here reads the
        environment or the file system), the same answer on every rank, so no rank waits for
        another. Paths and the fault plan are checked in the pre-flight (``train.preflight``)."""
        check_bounds(self)  # each number within its field's bounds (opt(above=..., ...))
        if self.overwrite and self.resume and self.resume != RESUME_IF_RESTARTED:
            raise UsageError("--overwrite starts over and --resume continues: give only one of them")
        self.check_image_size(image_size_for(self.dataset, self.image_size))
        try:
            milestones = parse_milestones(self.lr_milestones, self.epochs)
        except ValueError:
            raise UsageError(f"--lr-milestones {self.lr_milestones!r}: give comma-separated epochs or "
                             f"percentages of --epochs, e.g. 120,160 or 60%,80%") from None
        if self.lr_schedule == "step" and not milestones:
            raise UsageError("--lr-schedule step needs --lr-milestones, e.g. --lr-milestones 120,160")
        if self.lr_schedule != "step" and milestones:
            raise UsageError(f"--lr-milestones {self.lr_milestones} applies to --lr-schedule step only, not "
                             f"{self.lr_schedule}; drop it (a preset's: --lr-milestones '')")
        check_applies(self)  # each flag, and each value, where it does something (opt(applies_to=..., value_applies=...))
        if self.lr_min >= self.lr:
            raise UsageError(f"--lr-min {self.lr_min:g} is the LR the cosine decays to: give it below --lr {self.lr:g}")
        self.check_warmup_flags()
        if is_object_store(self.data_dir) and self.store_timeout > self.dist_timeout - STORE_MARGIN_S:
            raise UsageError(f"--store-timeout {self.store_timeout:g} leaves a rank waiting for the store longer than its "
                             f"peers wait in a collective (--dist-timeout {self.dist_timeout:g}, less {STORE_MARGIN_S:g} "
                             f"s); lower it, or raise --dist-timeout to {self.store_timeout + STORE_MARGIN_S:g}")
        if self.debug and launch.world_size > 1:
            raise UsageError("--debug runs one process; start it with plain `python`, not torchrun/srun")
        check_device(self.device, launch, cuda_devices)
        device = torch.device(device_type(self.device, cuda_devices))
        if self.decode_on == "device" and not augment_on_device(self.aug_on, self.dataset, device,
                                                                bool(per_sample_flags(self))):
            raise UsageError(f"--decode-on device needs --aug-on device (the loader path decodes and augments each "
                             f"image in the workers; --aug-on {self.aug_on} means the loader on {device.type}); add "
                             f"--aug-on device or drop --decode-on")

    def check_image_size(self, size: int) -> None:
        """The evaluation views' side, ``size`` px, at least --arch's smallest and taken in its
        training forward."""
        smallest = min_image_size(self.arch)
        if smallest and size < smallest:
            raise UsageError(f"--image-size {size} is too small for --arch {self.arch}: give at least "
                             f"{smallest} px")
        self.check_input_sizes(size, {size: "--image-size"})

    def check_input_sizes(self, image_size: int, sizes: dict[int, str]) -> None:
        """Each of ``sizes`` (px: the flag that sets it) taken in a training forward of --arch built
        for ``image_size`` px (``input_refusal``, on the meta device); the small networks have their
        smallest size instead (``min_image_size``)."""
        if self.arch in SMALL_NETS:
            return
        refusal = input_refusal(self.arch, image_size, sizes)
        if refusal:
            raise UsageError(f"--arch {self.arch} cannot take {refusal[0]} px images ({refusal[1]}); give a "
                             f"{sizes[refusal[0]]} it takes (torchvision trains most models at 224, Inception v3 at "
                             f"299)")

    def check_warmup_flags(self) -> None:
        """One warm-up, in steps or in epochs, on a schedule that takes it (its method and start
        factor apply to it alone: ``opt(applies_to=...)``)."""
        if not self.lr_warmup_epochs:
            return
        if self.lr_schedule not in EPOCH_WARMUP_SCHEDULES:
            raise UsageError(f"--lr-warmup-epochs applies to --lr-schedule {', '.join(EPOCH_WARMUP_SCHEDULES)} "
                             f"(torchvision's warm-up per epoch), not {self.lr_schedule}; with it warm up in steps: "
                             f"--warmup-steps N")
        if self.warmup_steps:
            raise UsageError("give one warm-up: --warmup-steps (in optimizer steps) or --lr-warmup-epochs "
                             "(torchvision's, in epochs), not both")
        if self.lr_warmup_epochs >= self.epochs:
            raise UsageError(f"--lr-warmup-epochs {self.lr_warmup_epochs} must be less than --epochs {self.epochs}: "
                             f"the schedule runs after the warm-up")

    def global_batch_remark(self, world_size: int, now: int) -> str:
        """One line when this run's global batch, ``now`` on ``world_size`` ranks (the plan's
        ``ResolvedSettings.global_batch``), differs from the one --lr was published for
        (--lr-ranks), with the launch that restores it; '' otherwise."""
        published = self.lr_ranks * self.batch_size
        if not self.lr_ranks or published == now:
            return ""
        fix = (f"give --accum-steps {self.lr_ranks // world_size}" if self.lr_ranks % world_size == 0 else
               f"launch {self.lr_ranks} ranks, or scale --lr to {self.lr * now / published:g}")
        return (f"--lr {self.lr:g} was published for a global batch of {published:,} ({self.lr_ranks} ranks x "
                f"{self.batch_size}); this run's is {now:,} ({world_size} rank(s) x {self.accum_steps} micro-step(s) "
                f"x {self.batch_size}), {published / now:.3g}x the LR per image: to train as published, {fix}")

    def schedule_summary(self) -> str:
        """The LR schedule in words (--check's, the start-up log's)."""
        kind = self.lr_schedule
        if kind == "steplr":
            return f"steplr (x{self.lr_gamma:g} every {self.lr_step_size} epochs)"
        if kind == "exponentiallr":
            return f"exponentiallr (x{self.lr_gamma:g} every epoch)"
        if kind == "cosineannealinglr" and self.lr_min:
            return f"cosineannealinglr (down to {self.lr_min:g})"
        if kind == "step":
            return f"step (x0.1 at epochs {', '.join(map(str, parse_milestones(self.lr_milestones, self.epochs)))})"
        return kind

    def milestone_steps(self, steps_per_epoch: int) -> list[int]:
        return [epoch * steps_per_epoch for epoch in parse_milestones(self.lr_milestones, self.epochs)]

    def global_batch(self, world_size: int) -> int:
        """Images per optimizer step on ``world_size`` ranks: world size x --accum-steps x --batch-size."""
        return world_size * self.accum_steps * self.batch_size

    def store_cache(self) -> StoreCache | None:
        """How each node keeps shards read from an object store (None for data on a file system)."""
        if not is_object_store(self.data_dir):
            return None
        return StoreCache(self.shard_cache_folder(), self.shard_cache_gb, self.shard_read_ahead, self.shard_downloads,
                          self.store_timeout, self.keep_shard_cache, self.store_if_match)

    def shard_cache_folder(self) -> str:
        """This job's folder of shard caches (a node's is below it): one per run folder, so that a
        restarted or requeued attempt empties what the one before it left."""
        run = hashlib.sha256(os.path.abspath(self.out).encode()).hexdigest()[:12]
        return os.path.join(self.shard_cache_dir or tempfile.gettempdir(), f"ddp-shards-{run}")


@dataclass(frozen=True)
class ResolvedSettings:
    """What the data settings left to this machine ("auto", 0, -1) came to for one run, and the
    global batch its launch makes of the flags, made once by ``train.preflight.resolved_settings``
    (``--check`` makes the same): the data plan, the start-up log, the input-bound advice, the EMA,
    config.json and checkpoints read it. The flags as asked stay in the config, which is what a
    ``--config`` re-run reads."""

    image_size: int   # px, the evaluation views' side (and the training views' by default); --image-size 0: the data set's native size
    workers: int      # DataLoader worker processes per rank; --workers -1: sized to the CPUs this rank may use
    aug_on: str       # where training augmentation runs: "device" (whole batches) or "loader" (per sample in the workers)
    decode_on: str    # where image files are decoded: "device" or "loader" (only image folders decode)
    order: str        # the training order: "samples" or "shards" (--order auto: "shards" for shards)
    amp: str          # what the forward runs in on this device: "none" (fp32), "bf16" or "fp16" (from --amp)
    global_batch: int  # images per optimizer step: world size x --accum-steps x --batch-size
    # {config field: value} of the settings at the data set's own defaults (the script's
    # DATASET_DEFAULTS), however they came; empty when none is
    dataset_defaults: dict[str, Any] = field(default_factory=dict)
    data_fingerprint: str | None = None  # image files: what identifies both splits (a resume on other files is refused)
    # image files: what changed in them since the resumed checkpoint's run read them, and why it
    # was accepted (train.data_record), each in words; empty when nothing did
    data_changes: tuple[str, ...] = ()
    # shards from an object store: bytes each node's cache may fill (--shard-cache-gb, or 0: sized
    # to what its ranks read at once); None for other data
    shard_cache_bytes: int | None = None

    def as_record(self) -> dict[str, Any]:
        """As plain data for config.json and checkpoints (``torch.load(..., weights_only=True)``
        reads it back), the fields that do not apply left out."""
        record = asdict(self)
        if not self.dataset_defaults:
            del record["dataset_defaults"]
        if self.data_fingerprint is None:
            del record["data_fingerprint"]
        if self.shard_cache_bytes is None:
            del record["shard_cache_bytes"]
        if self.data_changes:
            record["data_changes"] = list(self.data_changes)
        else:
            del record["data_changes"]
        return record


@dataclass(frozen=True)
class ScriptData:
    """What a script adds to the data settings both scripts share, handed to the pre-flight as an
    argument (to ``--check``, the function that makes it), in place of methods of its config that
    train/ would call."""

    # DataPlan fields of the script's own (the classifier's ra_reps, train_size, val_resize;
    # MoCo's bank_samples)
    plan_fields: dict[str, Any] = field(default_factory=dict)
    # px of the evaluation views' side where the script's weights fix it in place of --image-size
    # (the classifier's --pretrained and published weights); 0: none does
    image_size: int = 0
    # the views' sizes and per-sample steps in words for an image size, for the start-up log and
    # --check ('' when the image size says it all)
    views: Callable[[int], str] = lambda image_size: ""


def data_plan(cfg: TrainConfig, resolved: ResolvedSettings, recipe: AugmentRecipe, script: ScriptData = ScriptData(),
              listings: tuple | None = None) -> DataPlan:
    """The run's data, as ``data.pipeline.build_data`` takes it: the flags with what the "auto"
    ones resolved to (``resolved``), the script's training view (``recipe``, ``VIEWS`` per
    sample) and its own fields (``script``), and an image folder's listings made once for the job
    (``listings``, from ``train.preflight``)."""
    return DataPlan(dataset=cfg.dataset, data_dir=cfg.data_dir, image_size=resolved.image_size,
                    synthetic_samples=cfg.synthetic_samples, debug=cfg.debug, seed=cfg.seed,
                    batch_size=cfg.batch_size, workers=resolved.workers, normalization=cfg.normalization,
                    recipe=recipe, views=cfg.VIEWS, aug_on_device=resolved.aug_on == "device",
                    decode_on_device=resolved.decode_on == "device", order=resolved.order,
                    store=cfg.store_cache(), cache_bytes=resolved.shard_cache_bytes or 0, listings=listings,
                    **script.plan_fields)


def config_changes(saved: dict[str, Any], cfg: TrainConfig) -> dict[str, list[Any]]:
    """{field: [saved value, ``cfg``'s]} for every setting that differs from a saved config (a
    checkpoint's), this invocation's own choices (``on_resume="invocation"``: --out, --resume,
    ...) left out."""
    own = fields_on_resume(type(cfg), "invocation")
    return {name: [saved[name], value] for name, value in config_dict(cfg).items()
            if name in saved and saved[name] != value and name not in own}


def parse_args(cls: type[C], argv: Sequence[str] | None, doc: str) -> C:
    """The command line as a checked config, the flags as asked. Bad input: one line on stderr
    (rank 0 only, and only in a job's first attempt: a torchrun restart or a requeue would repeat
    the same flags) and exit code 2."""
    launch, cuda_devices = detect_launch(), visible_cuda_devices()
    says = launch.rank == 0 and restart_count() == 0
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_config(cls, argv, doc, quiet=not says)  # argparse exits 2 itself
        cfg.validate(launch, cuda_devices)
        recorded = recorded_run(argv)
    except UsageError as err:
        if says:
            say_error(f"{Path(sys.argv[0]).name}: error: {err}")
        raise SystemExit(EXIT_USAGE) from None
    if recorded and says:
        warn_if_launch_differs(cfg, launch, *recorded)
    return cfg


def warn_if_launch_differs(cfg: TrainConfig, launch: LaunchEnv, path: str, recorded: dict) -> None:
    """``--config RUN/config.json`` repeats that run's flags, not its launch: one line on stderr
    when the world size or the global batch differ from the recorded ones."""
    then = recorded["world_size"] * recorded["config"]["accum_steps"] * recorded["config"]["batch_size"]
    now = cfg.global_batch(launch.world_size)
    if recorded["world_size"] != launch.world_size or then != now:
        print(f"{Path(sys.argv[0]).name}: warning: {path} ran on {recorded['world_size']} rank(s), global batch "
              f"{then}; this launch: {launch.world_size} rank(s), global batch {now} (launch as many ranks, or "
              f"scale --batch-size or --lr)", file=sys.stderr, flush=True)
