"""Fault injection for the tests (and for anyone checking their cluster's restart path).

``DDP_FAULT="KIND:RANK:STEP[,KIND:RANK:STEP...]"`` makes rank RANK misbehave at optimizer step
STEP, in a job's first attempt only (torchrun restart count and SLURM requeue count 0):

* ``kill``  after step STEP, the process kills itself with SIGKILL (like ``kill -9`` of a worker);
* ``raise`` after step STEP, the process raises RuntimeError("injected fault ...");
* ``nan``   the network's first training forward of step STEP returns NaN on that rank.

The training loops never see it: the ``nan`` fault is a forward hook on the network, the others
run after each optimizer step. Unset (the normal case) nothing is installed.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Callable, Mapping

from torch import nn

from ..config import UsageError
from .launch import restart_count

ENV = "DDP_FAULT"
KINDS = ("kill", "raise", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


class FaultPlan:
    def __init__(self, faults: tuple[Fault, ...] = ()):
        self.faults = faults

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "FaultPlan":
        env = os.environ if env is None else env
        text = env.get(ENV, "").strip()
        if not text or restart_count(env) > 0:
            return cls()
        faults = []
        for part in text.split(","):
            kind, _, rest = part.strip().partition(":")
            rank, _, step = rest.partition(":")
            if kind not in KINDS or not rank.isdigit() or not step.isdigit():
                raise UsageError(f"{ENV}={text!r}: expected KIND:RANK:STEP with KIND one of "
                                 f"{', '.join(KINDS)}, e.g. kill:1:7")
            faults.append(Fault(kind, int(rank), int(step)))
        return cls(tuple(faults))

    def _steps(self, kind: str, rank: int) -> set[int]:
        return {f.step for f in self.faults if f.kind == kind and f.rank == rank}

    def install(self, module: nn.Module, rank: int, step_in_progress: Callable[[], int]) -> None:
        """The ``nan`` faults of ``rank``: ``module``'s first training forward of each such step
        (``step_in_progress()``, counted from 1) returns NaN."""
        steps = self._steps("nan", rank)
        if not steps:
            return
        fired: set[int] = set()

        def poison(module: nn.Module, inputs, output):
            step = step_in_progress()
            if module.training and step in steps and step not in fired:
                fired.add(step)
                return output * float("nan")
            return output

        module.register_forward_hook(poison)

    def after_step(self, rank: int, step: int) -> None:
        if step in self._steps("kill", rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if step in self._steps("raise", rank):
            raise RuntimeError(f"injected fault ({ENV}) on rank {rank} after step {step}")
