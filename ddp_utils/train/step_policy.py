"""What follows an optimizer step, for the training loops to call by name: whether the run ends
there, a NaN/Inf loss skipped or stopped on, a stop signal answered with a checkpoint."""
from __future__ import annotations

import logging

from ..runtime.stopping import EXIT_INTERRUPTED, EXIT_NONFINITE, RunStopped, StepVerdict
from .checkpoint import save_checkpoint
from .run import TrainRun

log = logging.getLogger("train")


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
