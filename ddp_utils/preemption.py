"""Preemption: a signal asks the run to stop; it stops at the next optimizer-step boundary.

SLURM sends SIGUSR1 ahead of the time limit (``#SBATCH --signal=USR1@120``) or when an admin
or a test runs ``scancel --signal=USR1``; SIGTERM comes on ``scancel`` and on preemption. The
handler only sets a flag (doing I/O or collectives inside a signal handler can deadlock). After
every optimizer step the ranks agree with one tiny all_reduce, so all of them stop after the
same step even when the signal reached them at different moments; rank 0 writes the checkpoint
and a ``PREEMPTED`` marker, and every rank leaves with exit code 0. The launch script sees the
marker and requeues the job, which continues with ``--resume auto``.
"""
from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch

from .collectives import all_reduce_sum

log = logging.getLogger("train")
MARKER = "PREEMPTED"
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionGuard:
    def __init__(self, out_dir: str | Path, signals: tuple[signal.Signals, ...] = SIGNALS):
        self.marker = Path(out_dir) / MARKER
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def close(self) -> None:
        """Give the signals back to their previous handlers (the run is over)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame) -> None:
        self.received = signum  # nothing else here: act at the next step boundary

    def should_stop(self, device: torch.device) -> bool:
        """True on every rank once any rank has received a signal (a collective: all must call)."""
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32, device=device)
        return bool(all_reduce_sum(flag).item())

    def write_marker(self, step: int) -> None:
        """Rank 0, after the checkpoint: tells the launch script to requeue."""
        name = signal.Signals(self.received).name if self.received else "a peer's signal"
        self.marker.write_text(f"step {step}\n")
        log.warning("preempted (%s): checkpoint written at step %d; exiting for requeue", name, step)

    def clear_marker(self) -> None:
        self.marker.unlink(missing_ok=True)
