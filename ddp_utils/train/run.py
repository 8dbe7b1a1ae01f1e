"""One training run: what it is made of and where it stands (:class:`TrainRun`,
:class:`RunState`); its batches in accumulation windows (:class:`TrainingBatches`), with the
clock of the loop's wait for them (:class:`WaitClock`) and the window's undo
(:class:`WindowUndo`: what a window changes besides the gradients, kept as it begins, so that a
window given up leaves the run as the last completed step left it); its start
(:func:`start_training`); what follows an optimizer step (:func:`ends_the_run`,
:func:`skip_or_stop_nonfinite`, :func:`stop_for_signal`); and its checkpoint
(:func:`save_checkpoint`)."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from ..config import config_dict
from ..data.data_stream import Batches
from ..data.pipeline import Loaders
from ..runtime.dist import DistInfo, unwrap
from ..runtime.logs import release_held_logs
from ..runtime.stopping import EXIT_INTERRUPTED, EXIT_NONFINITE, RunStopped, StepVerdict
from .accumulation import MicroStep, plan_windows
from .checkpoint import checkpoint_contents, weights_finite, write_checkpoint
from .ema import WeightsEMA
from .monitor import INPUT_BOUND, Progress, StepMeter, TensorBoard, input_advice
from .optimization import LRSchedule, steps_per_epoch
from .train_config import ResolvedSettings, TrainConfig

if TYPE_CHECKING:
    from .session import RunSession

log = logging.getLogger("train")


# ----------------------------------------------------------------------------- where it stands
@dataclass
class RunState:
    """Where a run stands: the position every checkpoint records and every message counts by."""

    epoch: int = 0              # epochs completed (0-based index of the epoch in progress)
    step: int = 0               # optimizer steps taken, applied or skipped: the one step counter
    batches_done: int = 0       # micro-batches of `epoch` this rank consumed (a multiple of accum_steps)
    nonfinite_skipped: int = 0  # optimizer steps skipped for a non-finite loss (--skip-nonfinite)

    def next_epoch(self) -> None:
        self.epoch, self.batches_done = self.epoch + 1, 0

    @property
    def epoch_number(self) -> int:
        """The epoch of the last step, counted from 1, as every message counts epochs (0 = none yet)."""
        return self.epoch if self.batches_done == 0 else self.epoch + 1

    def describe(self) -> str:
        return describe_position(self.step, self.epoch, self.batches_done)


def is_complete(cfg: TrainConfig, state: RunState) -> bool:
    """Nothing left to train: every epoch done, or --max-steps reached."""
    return state.epoch >= cfg.epochs or bool(cfg.max_steps and state.step >= cfg.max_steps)


def describe_position(step: int, epoch: int, batches_done: int) -> str:
    if batches_done == 0:
        return f"step {step}, end of epoch {epoch}" if epoch else f"step {step}"
    return f"step {step}, in epoch {epoch + 1}"


# ----------------------------------------------------------------------------- its batches
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@runtime_checkable
class ForwardState(Protocol):
    """A module whose training forward changes state that neither the optimizer step nor
    BatchNorm holds (MoCo: the count of key batches shuffled, which seeds the next shuffle).
    Registered with :meth:`WindowUndo.register`, it is kept as each window begins and put back
    when the window is given up."""

    def forward_state(self) -> Any:
        """The state, as a value that later forwards do not change."""

    def restore_forward_state(self, state: Any) -> None:
        """Put back a value :meth:`forward_state` returned."""


class _NormStatistics:
    """The running statistics (and batch counts) of every BatchNorm layer in a model: kept by one
    foreach copy per window (kilobytes), no device read."""

    def __init__(self, model: nn.Module):
        self.live = [b for m in model.modules() if isinstance(m, NORMS) for b in m.buffers(recurse=False)]
        self.kept = [torch.empty_like(b) for b in self.live]

    def save(self) -> None:
        if self.live:
            torch._foreach_copy_(self.kept, self.live)

    def restore(self) -> None:
        if self.live:
            torch._foreach_copy_(self.live, self.kept)


class _RngStreams:
    """The process's CPU random stream and, on CUDA, the device's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kept: tuple = ()

    def save(self) -> None:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.kept = (torch.get_rng_state(), cuda)

    def restore(self) -> None:
        cpu, cuda = self.kept
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)


class _ModuleState:
    def __init__(self, module: ForwardState):
        self.module, self.kept = module, None

    def save(self) -> None:
        self.kept = self.module.forward_state()

    def restore(self) -> None:
        self.module.restore_forward_state(self.kept)


class WindowUndo:
    """Everything a window changes besides the gradients (which ``zero_grad`` drops), each entry
    registered here explicitly, kept at :meth:`save` and put back by :meth:`restore` in the order
    registered. :class:`TrainingBatches` registers the model's BatchNorm statistics
    (:meth:`keep_norm_statistics`) and the RNG streams (:meth:`keep_rng`); a module whose forward
    changes other state implements :class:`ForwardState` and the script's ``setup`` registers it
    (:meth:`register`; ``train_moco.setup`` registers MoCo). What is not registered is not
    undone."""

    def __init__(self):
        self.entries: list[_NormStatistics | _RngStreams | _ModuleState] = []

    def keep_norm_statistics(self, model: nn.Module) -> None:
        self.entries.append(_NormStatistics(model))

    def keep_rng(self, device: torch.device) -> None:
        self.entries.append(_RngStreams(device))

    def register(self, module: ForwardState) -> None:
        if not isinstance(module, ForwardState):
            raise TypeError(f"{type(module).__name__} has no forward_state()/restore_forward_state(): "
                            f"it cannot take part in the window's undo")
        self.entries.append(_ModuleState(module))

    def save(self) -> None:
        for entry in self.entries:
            entry.save()

    def restore(self) -> None:
        for entry in self.entries:
            entry.restore()


class WaitClock:
    """Seconds the training loop spent waiting for its next batch: in the loader's ``next()``
    (workers behind, or decoding and augmenting in this process) and making device batches.
    A host clock: reading it never waits for a device."""

    def __init__(self):
        self.seconds = 0.0

    def next(self, batches: Iterator, default: Any = None) -> Any:
        started = time.perf_counter()
        try:
            return next(batches, default)
        finally:
            self.seconds += time.perf_counter() - started

    def call(self, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds += time.perf_counter() - started


class TrainingBatches:
    """This rank's training batches, epoch by epoch, in accumulation windows. A batch counts as
    consumed (``state.batches_done``) when it is handed out; the window in progress can be given
    up (:meth:`undo_window`, by ``window_undo``); the time the loop waits for batches is measured
    (``data_wait``, its :class:`WaitClock`, which the step meter reads)."""

    def __init__(self, loaders: Loaders, state: RunState, accum_steps: int, model: nn.Module, device: torch.device):
        self.loaders, self.state, self.accum_steps = loaders, state, accum_steps
        self.data_wait = WaitClock()
        self.epoch_started = (0.0, 0, 0.0)  # this epoch's start here: time, batches done, data wait
        self._window_start = 0  # state.batches_done before the window in progress
        self.window_undo = WindowUndo()  # the rest of what the window changes
        self.window_undo.keep_norm_statistics(model)
        self.window_undo.keep_rng(device)
        self._batches: Batches | None = None  # the pass in progress

    def this_epoch(self) -> Iterator[tuple[MicroStep, Any]]:
        """The rest of this epoch's batches, each with its place in its accumulation window."""
        state = self.state
        self.loaders.set_epoch(state.epoch, skip_batches=state.batches_done)
        if state.batches_done >= self.loaders.batches_per_epoch:  # resumed with fewer batches per epoch
            state.next_epoch()
            self.loaders.set_epoch(state.epoch)
        self.epoch_started = (time.perf_counter(), state.batches_done, self.data_wait.seconds)
        self._batches = self.data_wait.call(lambda: iter(self.loaders.train))  # may start the workers
        try:
            for micro in plan_windows(len(self.loaders.train), self.accum_steps):
                batch = self.data_wait.next(self._batches)
                if batch is None:
                    return
                if micro.index == 0:
                    self._window_start = state.batches_done
                    self.window_undo.save()
                state.batches_done += 1
                yield micro, batch
        finally:  # a pass left early (--max-steps) keeps no batch made ahead through what follows
            self._batches = None
            self.loaders.stop_making(self.loaders.train)

    def prepare_next(self) -> None:
        """Batches made on the device: queue the next one's augmentation now, so the device
        works on it while the host waits (a no-op for DataLoader workers, which run ahead anyway)."""
        if self._batches is not None:
            self.data_wait.call(self._batches.prepare_next)

    def undo_window(self) -> None:
        """Every rank: give up the window in progress (its optimizer step was not taken): its
        batches count as unseen again, and what ``window_undo`` holds (BatchNorm statistics, RNG
        streams, registered modules' state) is as the last completed step left it."""
        self.state.batches_done = self._window_start
        self.window_undo.restore()


# ----------------------------------------------------------------------------- the run
@dataclass(kw_only=True)
class TrainRun:
    """What one run is made of. ``model`` is what checkpoints store; ``network`` is what runs
    forward (DDP-wrapped when distributed, compiled with --compile)."""

    cfg: TrainConfig
    info: DistInfo
    session: RunSession                # signals, the per-step agreement, fault plan, last checkpoint
    loaders: Loaders
    model: nn.Module
    network: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: LRSchedule            # the LR of each optimizer step, from state.step
    scaler: torch.amp.GradScaler       # disabled unless --amp fp16
    total_steps: int
    state: RunState
    tb: TensorBoard
    script: str                        # "train_classifier.py" / "train_moco.py"
    resolved: ResolvedSettings         # what the "auto" data flags became (preflight.resolved_settings)
    facts: dict[str, Any] = field(default_factory=dict)  # must match on resume (e.g. the class count)
    ema: WeightsEMA | None = None      # --model-ema: the average of the weights, kept in checkpoints
    preempted: bool = False
    batches: TrainingBatches = field(init=False, repr=False)
    said_input_bound: bool = False

    def __post_init__(self):
        # DDP_FAULT=nan:RANK:STEP (tests): a NaN from the network's forward of that step
        self.session.faults.install(unwrap(self.network), self.info.rank, lambda: self.state.step + 1)
        self.batches = TrainingBatches(self.loaders, self.state, self.cfg.accum_steps, unwrap(self.model),
                                       self.info.device)

    def end_epoch_if_done(self) -> None:
        """After an optimizer step: once the epoch's batches are all consumed, the next epoch
        starts, so every message and checkpoint of the step agrees on which epoch it ended."""
        state = self.state
        if state.batches_done < self.loaders.batches_per_epoch:
            return
        started, first_batch, waited_before = self.batches.epoch_started
        seconds = max(time.perf_counter() - started, 1e-9)
        images = (state.batches_done - first_batch) * self.cfg.batch_size * self.info.world_size
        waited = (self.batches.data_wait.seconds - waited_before) / seconds
        fallbacks = self.loaders.decode_fallbacks  # --decode-on device: images its decoder refused, so far
        refused = (f"; {fallbacks.count:,} image(s) the {self.info.device.type} decoder refused decoded on the CPU "
                   f"so far" if fallbacks is not None and fallbacks.count else "")
        log.info("epoch %d trained in %.1f s (%s%s img/s, waited for data %.0f%% of it%s)", state.epoch_number,
                 seconds, "resumed part way, " if first_batch else "", f"{images / seconds:,.0f}", 100 * waited,
                 refused)
        advice = input_advice(self.cfg, self.resolved)
        if waited > INPUT_BOUND and advice and not first_batch and not self.said_input_bound and self.info.is_main:
            self.said_input_bound = True
            log.warning("input-bound: the training loop waited for its batches %.0f%% of epoch %d (rank 0); %s",
                        100 * waited, state.epoch_number, advice)
        state.next_epoch()

    def finished(self) -> bool:
        """All epochs done, --max-steps reached, or stopped by a preemption signal."""
        return self.preempted or is_complete(self.cfg, self.state)


def start_training(run: TrainRun) -> StepMeter:
    """Everything is built and checked: show the start-up log, arm Ctrl-C's checkpoint, and
    return the meter of the training steps."""
    cfg, info = run.cfg, run.info
    log.info("global batch %d = %d rank(s) x %d accum steps x %d per micro-batch; %d optimizer "
             "steps per epoch, %d in all", run.resolved.global_batch,
             info.world_size, cfg.accum_steps, cfg.batch_size,
             steps_per_epoch(run.loaders.batches_per_epoch, cfg.accum_steps), run.total_steps)
    remark = cfg.global_batch_remark(info.world_size, run.resolved.global_batch)
    if remark:
        log.warning("%s", remark)
    release_held_logs(show=True)
    run.session.signals.training_started()
    progress = Progress(min(run.total_steps, cfg.max_steps or run.total_steps), cfg.epochs, info.is_main,
                        start_step=run.state.step)
    return StepMeter(run.tb, progress, info.device, info.world_size, cfg.log_every,
                     waited=lambda: run.batches.data_wait.seconds)


# ----------------------------------------------------------------------------- after a step
def ends_the_run(run: TrainRun, verdict: StepVerdict) -> bool:
    """Whether the step just taken is the run's last (its metrics are then logged whatever
    --log-every says): a stop signal, a NaN/Inf loss beyond --skip-nonfinite, or the end."""
    stops_on_nonfinite = verdict.nonfinite_ranks > 0 and run.state.nonfinite_skipped >= run.cfg.skip_nonfinite
    return verdict.stop or stops_on_nonfinite or run.finished()


def skip_or_stop_nonfinite(run: TrainRun, ranks: int) -> None:
    """The step's loss was NaN/Inf on ``ranks`` ranks and its update was dropped on every rank:
    count it against --skip-nonfinite, or stop every rank with exit code 3."""
    cfg, state, world = run.cfg, run.state, run.info.world_size
    if state.nonfinite_skipped < cfg.skip_nonfinite:
        state.nonfinite_skipped += 1
        run.tb.scalars(state.step, train__nonfinite_skipped=state.nonfinite_skipped)
        if run.info.is_main:
            log.warning("step %d: NaN/Inf loss on %d of %d rank(s); step skipped (%d of --skip-nonfinite %d)",
                        state.step, ranks, world, state.nonfinite_skipped, cfg.skip_nonfinite)
        return
    raise RunStopped(f"step {state.step}: the loss was NaN or Inf on {ranks} of {world} rank(s); that step was "
                     f"not applied and the run stops; {run.session.saved.describe()}. Lower --lr, add "
                     f"--clip-grad, or allow skipping such steps with --skip-nonfinite N", EXIT_NONFINITE)


def stop_for_signal(run: TrainRun, verdict: StepVerdict) -> None:
    """A stop signal reached some rank: every rank checkpoints this step; Ctrl-C then stops the
    process (exit 130), SIGUSR1/SIGTERM marks the run preempted (the loop returns, the launcher
    requeues it)."""
    save_checkpoint(run)
    if verdict.interrupted:
        raise RunStopped(f"interrupted at step {run.state.step}: checkpoint written in {run.cfg.out}; continue "
                         f"with the same command plus --resume auto", EXIT_INTERRUPTED)
    if run.info.is_main:
        run.session.signals.write_marker(run.state.step)
    run.preempted = True


def save_checkpoint(run: TrainRun) -> None:
    """Checkpoint the run, unless this very step is on disk already (every rank calls; rank 0
    writes). Weights that are NaN or Inf are never written over a good checkpoint."""
    step = run.state.step
    if run.session.saved.step == step:
        return
    if not weights_finite(run.model, run.info.device):
        raise RunStopped(f"step {step}: the weights are NaN or Inf, so no checkpoint was written; "
                         f"{run.session.saved.describe()}. Lower --lr or add --clip-grad", EXIT_NONFINITE)
    order = run.loaders.train_sampler.state_dict(run.state.epoch, run.state.batches_done)  # how far the epoch went
    contents = checkpoint_contents(state={**asdict(run.state), "order": order}, script=run.script, facts=run.facts,
                                   world_size=run.info.world_size, config=config_dict(run.cfg),
                                   resolved=run.resolved, model=run.model, optimizer=run.optimizer,
                                   scaler=run.scaler, device=run.info.device)
    if run.ema is not None:  # read back by the classifier's setup
        contents["model_ema"] = run.ema.state_dict()
    path = write_checkpoint(contents, run.cfg.out, run.cfg.keep_checkpoints)
    run.session.saved.step, run.session.saved.path = step, path
    log.info("saved checkpoint %s (%s)", path, run.state.describe())
