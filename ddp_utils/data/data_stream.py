"""How a pass hands its batches to the training loop: :class:`Batches`, the one protocol of every
path's passes (:class:`LoopBatches`, made on the loop's thread; ``files_on_device.ThreadBatches``,
by a thread of its own), and the device paths' batches made on a CUDA stream of their own, the
data stream, and handed to the training stream: the ordering contract of
``files_on_device.FinishOnDevice`` and ``pipeline.DeviceBatches``.

On CUDA a batch's host-to-device copies and its augmentation (for image files also the decode
and the packing) run on the data stream (one per device), so that they overlap the training
stream's kernels instead of queueing between them. Who waits for whom:

1. **The data stream waits for the training stream once**, when a :class:`DataStream` is made
   (``build_data``): what the device holds from before (an in-memory split copied and resized
   there) is complete before the data stream reads it. After that, never: what it reads is host
   memory (pinned, contiguous, copied ``non_blocking``) or those tensors, never something the
   training stream writes.
2. **The training stream waits for each batch** (``wait_event``): :meth:`DataStream.run`
   records an event on the data stream after the batch's last copy and kernel; :meth:`Made.hand_over`,
   called by the thread that trains as the batch is handed out, makes the current (training)
   stream wait for that event, so that its kernels read whole batches. Nothing else is ordered:
   the data stream goes on with the next batch while the training stream computes.
3. **Each device tensor handed over is recorded on the training stream** (``record_stream``):
   it was allocated on the data stream, and without the record the caching allocator would give
   its block back to the data stream as soon as the training thread frees it, while training
   kernels that read it may still be queued: the next batch would be written under them. With
   the record, the block is reused only once the training stream's work queued before the free
   has run.
4. **Pinned host memory outlives its copy**: a ``non_blocking`` copy from pinned memory returns
   before it runs, so each batch's pinned sources are held with its event (``run``'s ``hold``)
   and let go once the event has completed (the caching host allocator, which pins the loader's
   batches, also keeps a block from reuse until its copies are done; the hold makes it so for any
   pinned memory). A source that is not contiguous would be copied through a pageable staging
   buffer, synchronously: the callers copy contiguous tensors only.
5. What is made on the data stream and freed there (intermediate results, a batch never handed
   over) needs nothing more: the data stream's own order protects it.

On a CPU device none of this applies, every operation having run when it returns: ``run`` calls
``make`` and ``hand_over`` returns its batch as it is. :class:`CudaCalls` is every CUDA call the
contract makes, so that a test can record their order without a GPU.
"""
from __future__ import annotations

import collections
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import Tensor

HELD_BATCHES = 4  # batches whose pinned sources are held at most; beyond, the oldest copy is waited for


class CudaCalls:
    """The CUDA calls of the contract (a test passes a stand-in that records them)."""

    def new_stream(self, device: torch.device):
        return _data_stream(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))

    def use(self, stream):
        """A context in which ``stream`` is the current stream (of this thread)."""
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def record_stream(self, tensor: Tensor, stream) -> None:
        tensor.record_stream(stream)


@functools.lru_cache(maxsize=None)
def _data_stream(device: torch.device) -> torch.cuda.Stream:
    """One data stream per device, whoever makes batches there: the caching allocator keeps a
    pool per stream, which a stream per loader would multiply."""
    return torch.cuda.Stream(device)


@dataclass
class Made:
    """A batch made on the data stream, not yet handed to the training stream: ``ready`` (an
    event recorded after its work; None on a CPU) and its device tensors."""

    batch: Any
    ready: Any = None
    on_device: list[Tensor] = field(default_factory=list)
    calls: CudaCalls | None = None
    device: torch.device | None = None

    def hand_over(self) -> Any:
        """The batch, for the current (training) stream of the calling thread: that stream waits
        for the batch's event, and each of its device tensors is recorded on it (see the module's
        contract, 2 and 3)."""
        if self.ready is None:
            return self.batch
        training = self.calls.current_stream(self.device)
        training.wait_event(self.ready)
        for tensor in self.on_device:
            self.calls.record_stream(tensor, training)
        return self.batch


class DataStream:
    """Where a device path makes its batches: on CUDA the device's data stream, which waits once
    for the current stream when this is made (the contract's point 1); on a CPU, in order where
    :meth:`run` is called. ``calls``: the CUDA calls (a test's stand-in runs the CUDA path's
    logic on a CPU device)."""

    def __init__(self, device: torch.device, calls: CudaCalls | None = None):
        self.device = device
        self.calls = calls if calls is not None else (CudaCalls() if device.type == "cuda" else None)
        self.stream = None
        self._held: collections.deque = collections.deque()  # (event, pinned host tensors) per batch
        self._lock = threading.Lock()
        if self.calls is not None:
            self.stream = self.calls.new_stream(device)
            self.stream.wait_stream(self.calls.current_stream(device))

    def run(self, make: Callable[[], Any], hold: tuple[Tensor, ...] = ()) -> Made:
        """``make()`` (a batch: tensors in tuples and lists) with the data stream current on CUDA,
        an event recorded after it; ``hold``: the pinned host tensors it copied ``non_blocking``,
        kept until that event has completed."""
        if self.calls is None:
            return Made(make())
        with self.calls.use(self.stream):
            batch = make()
        ready = self.calls.event()
        ready.record(self.stream)
        self._hold(ready, hold)
        on_device = [t for t in _tensors(batch) if t.device.type == self.device.type]
        return Made(batch, ready, on_device, self.calls, self.device)

    def _hold(self, ready, hold: tuple[Tensor, ...]) -> None:
        with self._lock:
            while self._held and self._held[0][0].query():  # copies done: their sources may go
                self._held.popleft()
            if hold:
                self._held.append((ready, hold))
            while len(self._held) > HELD_BATCHES:  # the data stream far behind: wait for the oldest
                self._held[0][0].synchronize()
                self._held.popleft()


def _tensors(batch: Any) -> Iterator[Tensor]:
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, (tuple, list)):
        for part in batch:
            yield from _tensors(part)


class Batches(Protocol):
    """One pass over a rank's batches (training, evaluation or the kNN bank): what ``iter()`` of a
    path's batches gives. ``next()`` hands out the next batch, in order, ready for the calling
    thread's current stream (:meth:`Made.hand_over`); a pass of image files records the files a
    batch could not decode as it hands the batch out, valid labels in their placeholders' place
    (``UnreadableFiles.record``). ``prepare_next()`` makes the next batch now where the loop's
    thread makes it on the device, its kernels queued while the host waits; elsewhere (a
    loader's workers, a thread of its own: both run ahead already), or asked again, it does
    nothing. ``close()`` ends the pass: batches made and not handed out are dropped, a thread
    making them stopped."""

    def __iter__(self) -> Batches: ...

    def __next__(self) -> Any: ...

    def prepare_next(self) -> None: ...

    def close(self) -> None: ...


class LoopBatches:
    """:class:`Batches` taken on the loop's thread when it asks: the items of ``source``, each a
    batch (a DataLoader's), or with ``make`` turned into one made on the data stream
    (:class:`Made`) and handed over as ``next()`` hands it out, not when it was made; each
    handed-out batch passes through ``record`` where given. Only with ``make`` does
    ``prepare_next()`` make the next batch early: taking a loader's early would only wait for
    its workers."""

    def __init__(self, source: Iterator, make: Callable[[Any], Made] | None = None,
                 record: Callable[[Any], Any] | None = None):
        self._source, self._make, self._record = source, make, record
        self._ahead: Made | None = None

    def __iter__(self) -> LoopBatches:
        return self

    def __next__(self):
        if self._make is None:
            batch = next(self._source)
        else:
            made, self._ahead = self._ahead, None
            batch = (self._make(next(self._source)) if made is None else made).hand_over()
        return batch if self._record is None else self._record(batch)

    def prepare_next(self) -> None:
        if self._make is not None and self._ahead is None:
            item = next(self._source, None)  # None at the end: next() then stops
            self._ahead = None if item is None else self._make(item)

    def close(self) -> None:
        """Drops the batch made ahead and the source (a DataLoader's iterator: its workers of the
        pass stop; a generator: its ``finally`` runs)."""
        self._ahead, self._source = None, iter(())
