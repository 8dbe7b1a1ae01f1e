"""What a run does around its optimizer steps, for the training loops to call by name: the start
of training, checkpoints, and after a step a NaN/Inf loss skipped or stopped on, or a stop
signal."""
from __future__ import annotations

import logging
from dataclasses import asdict

from ..config import config_dict
from ..runtime.logs import release_held_logs
from ..runtime.stopping import EXIT_INTERRUPTED, EXIT_NONFINITE, RunStopped, StepVerdict
from .accumulation import steps_per_epoch
from .checkpoint import checkpoint_contents, weights_finite, write_checkpoint
from .monitor import Progress, StepMeter
from .run import TrainRun

log = logging.getLogger("train")


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
    contents.update(run.checkpoint_extras())
    path = write_checkpoint(contents, run.cfg.out, run.cfg.keep_checkpoints)
    run.session.saved.step, run.session.saved.path = step, path
    log.info("saved checkpoint %s (%s)", path, run.state.describe())


def start_training(run: TrainRun) -> StepMeter:
    """Everything is built and checked: show the start-up log, arm Ctrl-C's checkpoint, and
    return the meter of the training steps."""
    cfg, info = run.cfg, run.info
    log.info("global batch %d = %d rank(s) x %d accum steps x %d per micro-batch; %d optimizer "
             "steps per epoch, %d in all", info.world_size * cfg.accum_steps * cfg.batch_size,
             info.world_size, cfg.accum_steps, cfg.batch_size,
             steps_per_epoch(run.loaders.batches_per_epoch, cfg.accum_steps), run.total_steps)
    release_held_logs(show=True)
    run.session.signals.training_started()
    progress = Progress(min(run.total_steps, cfg.max_steps or run.total_steps), cfg.epochs, info.is_main,
                        start_step=run.state.step)
    return StepMeter(run.tb, progress, info.device, info.world_size, cfg.log_every, run.batches.data_wait)


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
