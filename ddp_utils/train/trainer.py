"""The skeleton both training scripts share: validate -> init -> check -> build -> train -> stop,
the optimizer/schedule/scaler trio, resume, the run checkpoint, and one exit code per way a run
can end (see ddp_utils.runtime.stopping)."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from ..config import UsageError, config_dict, parse_config, save_config
from ..data.loading import Loaders, default_workers, steps_per_epoch
from ..data.preview import augmentation_grid
from ..data.sets import (
    DEBUG_TRAIN_SAMPLES,
    DEBUG_VAL_SAMPLES,
    debug_subset,
    download_cifar10,
    load_split,
    num_classes_of,
)
from ..runtime.collectives import all_gather_object, all_ranks_agree, all_reduce_sum
from ..runtime.dist import (
    DistInfo,
    barrier,
    cleanup_distributed,
    detect_launch,
    gpu_identity,
    init_distributed,
    restart_count,
    shared_gpu_problem,
)
from ..runtime.faults import FaultPlan
from ..runtime.logs import release_held_logs, setup_logging
from ..runtime.stopping import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_NONFINITE,
    EXIT_OK,
    EXIT_USAGE,
    RunStopped,
    StepGuard,
    StopSignals,
)
from .accumulation import GradientAccumulator, StepResult
from .checkpoint import save_checkpoint
from .fast_path import configure_backends, maybe_compile, sgd
from .monitor import Progress, StepMeter, TensorBoard
from .precision import grad_scaler, resolve_amp
from .run_folder import TB_DIR, choose_resume, prepare_run_folder
from .run_state import Resume, RunState, check_resume_fits, restore_training_state, training_state
from .schedule import LRSchedule
from .train_config import TrainConfig

log = logging.getLogger("train")


@dataclass
class TrainRun:
    """What one run is made of. ``model`` is what checkpoints store (unwrapped when saved)."""

    cfg: TrainConfig
    info: DistInfo
    loaders: Loaders
    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: LRSchedule                          # the LR of each optimizer step, from state.step
    scaler: torch.amp.GradScaler | None
    accumulator: GradientAccumulator
    state: RunState
    total_steps: int
    tb: TensorBoard
    script: str                                      # "train_classifier.py" / "train_moco.py"
    facts: dict = field(default_factory=dict)        # must match on resume (e.g. the class count)
    signals: StopSignals | None = None
    faults: FaultPlan = field(default_factory=FaultPlan)
    saved_step: int | None = None                    # step of the newest checkpoint on disk
    saved_path: Path | None = None                   # and its file
    preempted: bool = False
    epoch_clock: tuple[float, int] = (0.0, 0)        # when this epoch started here, at which batch

    def __post_init__(self):
        # RunState.step is the counter the LR follows: the accumulator, which sets the LR before
        # each optimizer step, starts from it (a resumed run: the saved step) and follows it.
        self.accumulator.step = self.state.step

    def finished(self) -> bool:
        """All epochs done, --max-steps reached, or stopped by a preemption signal."""
        cfg = self.cfg
        return (self.preempted or self.state.epoch >= cfg.epochs
                or bool(cfg.max_steps and self.state.step >= cfg.max_steps))

    def start_epoch(self) -> None:
        """Reshuffle for the epoch in progress, skipping the batches a checkpoint already consumed."""
        if self.state.batches_done >= self.loaders.batches_per_epoch:  # resumed with a smaller world size
            self.state.epoch, self.state.batches_done = self.state.epoch + 1, 0
        self.loaders.set_epoch(self.state.epoch, skip_batches=self.state.batches_done)
        self.epoch_clock = (time.perf_counter(), self.state.batches_done)

    def count_step(self) -> None:
        """After each optimizer step (applied or skipped): one more step; a new epoch once this
        one's batches are all consumed, so every message and checkpoint of the step agrees on
        which epoch it ended."""
        self.state.step += 1
        self.accumulator.step = self.state.step
        if self.state.batches_done >= self.loaders.batches_per_epoch:
            self.log_epoch_time()
            self.state.epoch, self.state.batches_done = self.state.epoch + 1, 0

    def log_epoch_time(self) -> None:
        """Seconds the epoch's training took on this process (data and steps; no evaluation)."""
        started, first_batch = self.epoch_clock
        seconds = time.perf_counter() - started
        images = (self.state.batches_done - first_batch) * self.cfg.batch_size * self.info.world_size
        log.info("epoch %d trained in %.1f s (%s%.0f img/s)", self.state.epoch_number, seconds,
                 "resumed part way, " if first_batch else "", images / max(seconds, 1e-9))

    def is_last_step(self, stepped: StepResult) -> bool:
        """Whether the step just taken ends the run (its metrics are then logged whatever
        --log-every says)."""
        verdict = stepped.verdict
        stops_on_nonfinite = verdict.nonfinite_ranks > 0 and self.state.nonfinite_skipped >= self.cfg.skip_nonfinite
        return verdict.stop or stops_on_nonfinite or self.finished()

    def last_checkpoint(self) -> str:
        if self.saved_path is None:
            return "no checkpoint was written yet"
        return f"the last good checkpoint is {self.saved_path} (step {self.saved_step})"


# ----------------------------------------------------------------------------- building
def load_raw_splits(cfg: TrainConfig, info: DistInfo) -> tuple[Dataset, Dataset]:
    """Train and val splits without transforms (CIFAR-10 was downloaded, if asked, by run_script)."""
    size = cfg.resolved_image_size()
    train = load_split(cfg.dataset, cfg.data_dir, True, size, cfg.synthetic_samples)
    val = load_split(cfg.dataset, cfg.data_dir, False, size, cfg.synthetic_samples)
    if num_classes_of(train) != num_classes_of(val):
        raise UsageError(f"--data-dir {cfg.data_dir}: train/ has {num_classes_of(train)} classes but val/ "
                         f"has {num_classes_of(val)}; both need the same class folders")
    if cfg.debug:
        return debug_subset(train, DEBUG_TRAIN_SAMPLES), debug_subset(val, DEBUG_VAL_SAMPLES)
    return train, val


def loader_options(cfg: TrainConfig, info: DistInfo) -> dict:
    """Keyword arguments for make_loaders / eval_loader: batch, workers, sharding, pinning."""
    workers = cfg.workers if cfg.workers >= 0 else default_workers(cfg.dataset, info.local_world_size)
    return dict(batch_size=cfg.batch_size, workers=workers, rank=info.rank, world_size=info.world_size,
                pin_memory=info.device.type == "cuda")


def build_optimization(cfg: TrainConfig, params, batches_per_epoch: int, device: torch.device):
    """SGD, the LR schedule (a function of the optimizer step, over all --epochs) and the fp16 scaler."""
    optimizer = sgd(params, cfg.lr, cfg.momentum, cfg.weight_decay, device)
    epoch_steps = steps_per_epoch(batches_per_epoch, cfg.accum_steps)
    total_steps = cfg.epochs * epoch_steps
    lr_schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total_steps, cfg.warmup_steps,
                             tuple(cfg.milestone_steps(epoch_steps)), epoch_steps)
    return optimizer, lr_schedule, grad_scaler(cfg.amp, device), total_steps


def wrap_for_training(module: nn.Module, cfg: TrainConfig, info: DistInfo, optimizer,
                      lr_schedule: LRSchedule, scaler) -> tuple[nn.Module, GradientAccumulator]:
    """DDP around ``module`` when distributed (the only part DDP ever sees), compiled with
    --compile, and its accumulator, which sets ``lr_schedule(step)`` before each optimizer step
    (TrainRun sets its step count). Every rank must call it (DDP broadcasts rank 0's weights).

    ``gradient_as_bucket_view``: gradients live inside DDP's all-reduce buckets instead of beside
    them, which saves one copy of the gradients in memory and a copy per bucket per step."""
    network = module
    if info.is_distributed:
        network = DDP(module, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                      gradient_as_bucket_view=True)
    network = maybe_compile(network, cfg.compile)
    accumulator = GradientAccumulator(network, optimizer, cfg.accum_steps, lr_at=lr_schedule,
                                      grad_scaler=scaler, clip_grad=cfg.clip_grad)
    return network, accumulator


def training_meter(run: TrainRun) -> tuple[Progress, StepMeter]:
    """Progress line/bar and per-step metrics for ``fit``."""
    cfg = run.cfg
    progress = Progress(min(run.total_steps, cfg.max_steps or run.total_steps), cfg.epochs, run.info.is_main,
                        start_step=run.state.step)
    return progress, StepMeter(run.tb, progress, run.info.device, run.info.world_size, cfg.log_every)


def restore_if_resuming(cfg: TrainConfig, info: DistInfo, resume: Resume | None, *, script: str,
                        fixed: Sequence[str], facts: dict, model: nn.Module, optimizer, scaler,
                        lr_scheduler: object = None) -> RunState:
    """Where the run starts: from scratch, or from ``resume`` once it is known to fit (``fixed``:
    the config fields that shape the model; ``facts``: derived ones such as the class count).
    ``lr_scheduler`` is not used (the LR follows from the restored step); callers may still pass
    the schedule under that name."""
    if resume is None:
        return RunState()
    check_resume_fits(resume, script, config_dict(cfg), tuple(fixed), facts, info.world_size, info.is_main)
    return restore_training_state(resume, model=model, optimizer=optimizer, grad_scaler=scaler,
                                  world_size=info.world_size, batch_size=cfg.batch_size,
                                  announce=info.is_main)


# ----------------------------------------------------------------------------- checkpoints
def weights_finite(model: nn.Module, device: torch.device) -> bool:
    """True on every rank when every floating tensor of the model is finite on every rank: the
    tensors are checked on the device, the ranks' counts summed, and the answer read once."""
    checks = [torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point()]
    bad = (~torch.stack(checks)).sum().to(device=device, dtype=torch.int32).reshape(1)
    return int(all_reduce_sum(bad).item()) == 0


def save_run(run: TrainRun) -> None:
    """Checkpoint the run, unless this very step is on disk already (all ranks call; rank 0
    writes). Non-finite weights are never written over a good checkpoint."""
    state = run.state
    if run.saved_step == state.step:
        return
    if not weights_finite(run.model, run.info.device):
        raise RunStopped(f"step {state.step}: the weights are NaN or Inf, so no checkpoint was written; "
                         f"{run.last_checkpoint()}. Lower --lr or add --clip-grad", EXIT_NONFINITE)
    checkpoint = training_state(state, config_dict(run.cfg), run.info.world_size, script=run.script,
                                facts=run.facts, model=run.model, optimizer=run.optimizer,
                                grad_scaler=run.scaler)
    path = save_checkpoint(checkpoint, run.cfg.out, run.cfg.keep_checkpoints)
    run.saved_step, run.saved_path = state.step, path
    log.info("saved checkpoint %s (%s)", path, state.describe())


# ----------------------------------------------------------------------------- each step
def after_optimizer_step(run: TrainRun, stepped: StepResult) -> bool:
    """What the ranks agreed on at this step, the periodic checkpoint and --max-steps (every
    rank calls it; it may run collectives). True when the epoch loop must end here."""
    cfg, state, verdict = run.cfg, run.state, stepped.verdict
    if verdict.nonfinite_ranks:
        skip_or_stop_nonfinite(run, verdict.nonfinite_ranks)
    if verdict.stop:
        save_run(run)
        if verdict.interrupted:
            raise RunStopped(f"interrupted at step {state.step}: checkpoint written in {cfg.out}; continue "
                             f"with the same command plus --resume auto", EXIT_INTERRUPTED)
        if run.info.is_main:
            run.signals.write_marker(state.step)
        run.preempted = True
        return True
    if cfg.ckpt_every and state.step % cfg.ckpt_every == 0:
        save_run(run)
    run.faults.after_step(run.info.rank, state.step)
    return bool(cfg.max_steps and state.step >= cfg.max_steps)


def skip_or_stop_nonfinite(run: TrainRun, ranks: int) -> None:
    """The step's loss was NaN/Inf on ``ranks`` ranks; its update was already dropped on every rank.
    Count it against --skip-nonfinite, or stop every rank with exit code 3."""
    cfg, state, world = run.cfg, run.state, run.info.world_size
    if state.nonfinite_skipped < cfg.skip_nonfinite:
        state.nonfinite_skipped += 1
        run.tb.scalars(state.step, train__nonfinite_skipped=state.nonfinite_skipped)
        if run.info.is_main:
            log.warning("step %d: NaN/Inf loss on %d of %d rank(s); step skipped (%d of --skip-nonfinite %d)",
                        state.step, ranks, world, state.nonfinite_skipped, cfg.skip_nonfinite)
        return
    raise RunStopped(f"step {state.step}: the loss was NaN or Inf on {ranks} of {world} rank(s); that step was "
                     f"not applied and the run stops; {run.last_checkpoint()}. Lower --lr, add --clip-grad, "
                     f"or allow skipping such steps with --skip-nonfinite N", EXIT_NONFINITE)


def log_batch_geometry(run: TrainRun) -> None:
    cfg, info = run.cfg, run.info
    log.info("global batch %d = %d rank(s) x %d accum steps x %d per micro-batch; %d optimizer "
             "steps per epoch, %d in all", info.world_size * cfg.accum_steps * cfg.batch_size,
             info.world_size, cfg.accum_steps, cfg.batch_size,
             steps_per_epoch(run.loaders.batches_per_epoch, cfg.accum_steps), run.total_steps)


# ----------------------------------------------------------------------------- the whole run
C = TypeVar("C", bound=TrainConfig)
R = TypeVar("R", bound=TrainRun)
Setup = Callable[[C, DistInfo, "Resume | None"], R]


def start_run(cfg: C, info: DistInfo, signals: StopSignals, setup: Setup) -> R:
    """Every check, agreed by all ranks, then the run built and its folder prepared. Nothing is
    written into --out before all checks have passed."""
    with all_ranks_agree():
        cfg.check_paths()
        faults = FaultPlan.from_env()
        resume = choose_resume(cfg.resume, cfg.out, cfg.overwrite, info.is_main)
    download_once_per_node(cfg, info)
    if info.device.type == "cuda" and info.is_distributed:
        problem = shared_gpu_problem(all_gather_object(gpu_identity(info.device)))
        if problem:
            raise UsageError(problem)
    run = setup(cfg, info, resume)
    run.signals, run.faults = signals, faults
    run.accumulator.guard = StepGuard(signals, info.device)
    if resume is not None and resume.path.parent == Path(cfg.out):  # already on disk: not saved again
        run.saved_step, run.saved_path = run.state.step, resume.path
    if info.is_main:
        prepare_run_folder(cfg.out, cfg.overwrite, resuming=resume is not None)
        save_config(cfg, cfg.out, {"world_size": info.world_size})
        signals.clear_marker()
        run.tb = TensorBoard(Path(cfg.out) / TB_DIR, purge_step=run.state.step + 1 if resume else None)
        if resume is None:  # what the augmentation does, once per run
            grid = augmentation_grid(run.loaders, cfg.dataset, cfg.resolved_image_size(),
                                     normalization=cfg.normalization)
            run.tb.image("data/augmented_views", grid, run.state.step)
    barrier()
    log_batch_geometry(run)
    return run


def download_once_per_node(cfg: TrainConfig, info: DistInfo) -> None:
    """``--download``: local rank 0 of each node fetches CIFAR-10 while the others wait (the
    agreement is the barrier, and a failed download stops every rank with exit 2); afterwards
    every rank only reads it (download=False: no checksum work repeated, no race on the files)."""
    if cfg.dataset == "cifar10" and cfg.download:
        with all_ranks_agree():
            if info.local_rank == 0:
                download_cifar10(cfg.data_dir)


def warn_if_restarts_can_hang(info: DistInfo) -> None:
    """torchrun shares its rendezvous store with the workers unless told not to; a restarted
    group can then read the dead group's addresses and hang at start-up (measured here: 1 of 2
    restarts hung; pytorch/pytorch#135712)."""
    if info.is_main and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) and \
            os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        log.warning("torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restarted "
                    "group can hang at start-up (pytorch/pytorch#135712); set it in torchrun's "
                    "environment (launch/*.sh do)")


def report_usage_error(prog: str, err: UsageError, reporter: bool) -> int:
    """Bad input: one line on stderr from rank 0 (the others agree silently); exit code 2."""
    if reporter and not said_in_an_earlier_attempt(str(err)):
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def said_in_an_earlier_attempt(message: str) -> bool:
    """torchrun restarts a failed group whatever the cause, a typo included (it cannot tell them
    apart): say a bad-input error in the job's first attempt only. Remembered per torchrun run
    in the temp folder; outside torchrun, always False."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return False
    memo = Path(tempfile.gettempdir()) / f"ddp-usage-error-{hashlib.sha1(run_id.encode()).hexdigest()[:16]}"
    if restart_count() > 0 and memo.is_file() and memo.read_text() == message:
        return True
    with contextlib.suppress(OSError):
        memo.write_text(message)
    return False


# What a collective raises when a peer died or stopped answering (a gloo or NCCL timeout included).
_COMM_FAILURE = re.compile(r"Connection (reset|closed) by peer|Broken pipe|gloo|NCCL")


def leave_after_failure(err: BaseException, info: DistInfo, run: TrainRun | None) -> None:
    """A distributed run that failed: say why once, then leave at once with exit code 1.

    ``sys.exit`` would tear down a process group whose peer may be dead, which can abort the
    process (gloo: "terminate called without an active exception"); ``os._exit`` after flushing
    the logs cannot. A rank whose own code failed shows its traceback; a rank that only lost a
    peer says so in one line, so the real error is shown once.
    """
    release_held_logs(show=True)
    text = str(err)
    if isinstance(err, getattr(dist, "DistError", ())) or _COMM_FAILURE.search(text):
        brief = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0] if text.strip() else "").split(". ")[0]
        log.error("rank %d stops: lost contact with another rank (%s); that rank's own error is shown "
                  "above or in its log", info.rank, brief or type(err).__name__)
    else:
        log.error("rank %d failed:", info.rank, exc_info=err)
    if run is not None:
        run.tb.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FAILURE)


def run_script(config_cls: type[C], argv: Sequence[str] | None, description: str, setup: Setup,
               fit: Callable[[R], object]) -> int:
    """Parse and validate, initialise the process group, check and build the run, train; the
    return value is the exit code (0, 2, 3 or 130; 1 leaves through leave_after_failure)."""
    prog = Path(sys.argv[0]).name
    launch = detect_launch()
    reporter = launch.rank == 0  # the one process that prints bad-input errors
    try:
        cfg = parse_config(config_cls, argv, description, quiet=not reporter)
        cfg.validate(launch)
    except UsageError as err:
        return report_usage_error(prog, err, reporter)
    signals = StopSignals(cfg.out, announce=reporter)  # before the rendezvous: a USR1 then must not kill us
    info: DistInfo | None = None
    run: TrainRun | None = None
    try:
        info = init_distributed(cfg.device, cfg.dist_timeout)
        setup_logging(info.rank, cfg.debug, hold=True)
        cfg.amp = resolve_amp(cfg.amp, info.device)  # before anything is built; config.json shows the choice
        configure_backends(info.device)
        log.info("%s launch: world size %d, backend %s, device %s, precision %s%s", info.launcher,
                 info.world_size, info.backend or "none", info.device, cfg.amp if cfg.amp != "none" else "fp32",
                 ", compiled" if cfg.compile else "")
        warn_if_restarts_can_hang(info)
        torch.autograd.set_detect_anomaly(cfg.debug)
        if cfg.debug:
            log.info("--debug: autograd anomaly detection on, small data subsets, extra checks after "
                     "every step")
        run = start_run(cfg, info, signals, setup)
        release_held_logs(show=True)
        signals.training_started()
        fit(run)
        return EXIT_OK
    except UsageError as err:
        release_held_logs(show=False)  # the error line says it all
        return report_usage_error(prog, err, reporter)
    except RunStopped as stop:
        if reporter:
            (log.warning if stop.code == EXIT_INTERRUPTED else log.error)("%s", stop)
        return stop.code
    except KeyboardInterrupt:
        where = run.last_checkpoint() if run is not None else "nothing was written"
        if reporter:
            print(f"{prog}: interrupted: stopped at once without a new checkpoint; {where}",
                  file=sys.stderr, flush=True)
        if info is not None and info.is_distributed:
            os._exit(EXIT_INTERRUPTED)  # peers may be inside a collective: no group teardown
        return EXIT_INTERRUPTED
    except Exception as err:
        if info is None or not info.is_distributed:
            raise  # one process: an ordinary traceback, the clearest report of a bug
        leave_after_failure(err, info, run)
        raise  # not reached: leave_after_failure exits
    finally:
        release_held_logs(show=True)
        signals.close()
        if run is not None:
            run.tb.close()
        cleanup_distributed()
