"""A rank's training batches, epoch by epoch, in accumulation windows (:class:`TrainingBatches`),
the clock of the time the loop waits for them (:class:`WaitClock`), and the window's undo
(:class:`WindowUndo`): what a window changes besides the gradients, kept as it begins so that a
window given up leaves the run as the last completed step left it."""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from ..data.data_stream import Batches
from ..data.pipeline import Loaders
from .accumulation import MicroStep, plan_windows
from .run_state import RunState

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
