"""Counts, while the real training loop runs, every operation that would make the host wait for
a GPU, at each micro-step.

On a CPU nothing waits, so the probe makes host and device tensors tell apart: the run trains
on ``cpu:0`` (the CPU under an explicit device index: factories asked for the training device
and copies to it show that index to the dispatcher), and a ``TorchDispatchMode`` follows each
storage from there: an operation with a device input writes device storage, everything else
(Python data, the sampler, DataLoader batches before their copy) stays on the host. Counted,
when a device tensor is involved:

- reads of a device value: ``_local_scalar_dense`` (``item``, ``bool``, ``int``, ``float``),
  ``tolist``, ``numpy``, ``cpu``, and the operators whose output size depends on the data
  (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave``
  without ``output_size``) or that answer on the host (``equal``, ``is_nonzero``);
- blocking copies from the host to the device: ``copy_``/``_to_copy`` without ``non_blocking``
  (``t[i] = 1`` copies a host scalar), and ``torch.tensor``/``as_tensor`` with a ``device``.

Run as a script (one rank or under torchrun), it writes each rank's counts as JSON:
    python tests/host_sync_probe.py OUT_DIR [--plant mask|tensor] train_moco.py ARGS...
``--plant`` adds a known sync to every micro-step's loss (the negative control).
"""
from __future__ import annotations

import dataclasses
import json
import linecache
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
aten = torch.ops.aten
TRAINING_DEVICE = torch.device("cpu", 0)
_READS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2, aten.unique_dim,
          aten.unique_consecutive, aten.equal, aten.is_nonzero}
_COPIES = {aten.copy_, aten._to_copy}


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class HostSyncCounter(TorchDispatchMode):
    """``events``: (kind, operation) for each counted operation; ``count`` their number;
    ``ddp_rebuild``: those made by DDP's one-time bucket rebuild."""

    def __init__(self):
        super().__init__()
        self.device_storage: set[int] = set()
        self.events: list[tuple[str, str]] = []
        self.ddp_rebuild: list[tuple[str, str]] = []
        self._patches: list[tuple[object, str, object]] = []

    @property
    def count(self) -> int:
        return len(self.events)

    def on_device(self, t: torch.Tensor) -> bool:
        return _storage(t) in self.device_storage

    def _mark(self, tensors, device: bool) -> None:
        for t in tensors:
            ptr = _storage(t)
            if ptr is not None and ptr != 0:
                (self.device_storage.add if device else self.device_storage.discard)(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        from_device = any(self.on_device(t) for t in inputs)
        packet = func.overloadpacket
        if from_device and self._reads(packet, args, kwargs):
            self._record("read", str(func))
        if packet in _COPIES:
            self._count_copy(packet, args, kwargs)
        out = func(*args, **kwargs)
        made_here = kwargs.get("device") == TRAINING_DEVICE  # a factory or copy for the training device
        if packet is aten.lift_fresh:
            made_here = False  # Python data: on the host until copied
        else:
            made_here = made_here or from_device
        written = [a for a, spec in zip(args, func._schema.arguments) if spec.alias_info is not None
                   and spec.alias_info.is_write]  # in-place and out= arguments
        self._mark(_tensors(out) + _tensors(written), made_here)
        return out

    @staticmethod
    def _reads(packet, args, kwargs) -> bool:
        if packet in _READS:
            return True
        if packet in (aten.index, aten.index_put_, aten.index_put, aten._index_put_impl_):
            return any(i is not None and i.dtype == torch.bool for i in args[1])  # boolean mask
        if packet is aten.repeat_interleave:
            return kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor) and len(args) < 3
        return False

    def _count_copy(self, packet, args, kwargs) -> None:
        if packet is aten.copy_:  # copy_(dst, src, non_blocking)
            to_device, from_device = self.on_device(args[0]), self.on_device(args[1])
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        else:  # _to_copy(src, dtype=..., device=..., non_blocking=...)
            # Only cpu:0 names the training device; a plain "cpu" may be a device tensor's own
            # .device (autograd casts gradients back to it), so it stays where the source is.
            from_device = self.on_device(args[0])
            to_device = from_device or kwargs.get("device") == TRAINING_DEVICE
            non_blocking = kwargs.get("non_blocking", False)
        if non_blocking or to_device == from_device:
            return
        self._record("host-to-device copy" if to_device else "read", str(packet))

    def _record(self, kind: str, what: str) -> None:
        """DDP's one bucket rebuild (after its first iteration it broadcasts rank 0's gradient
        order, through the host with NCCL) is kept apart: it happens once per run."""
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_pre_forward" and "_rebuild_buckets" in linecache.getline(
                    frame.f_code.co_filename, frame.f_lineno):
                self.ddp_rebuild.append((kind, what))
                return
            frame = frame.f_back
        self.events.append((kind, what))

    # -- the calls that never reach the dispatcher on a CPU
    def _wrap_reads(self) -> None:
        for name in ("tolist", "numpy", "cpu"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, __original=original, __name=name, **kwargs):
                if self.on_device(tensor):
                    self.events.append(("read", f"Tensor.{__name}"))
                return __original(tensor, *args, **kwargs)
            self._patch(torch.Tensor, name, counted)
        to = torch.Tensor.to

        def to_host(tensor, *args, **kwargs):
            if self.on_device(tensor) and any(isinstance(a, str) and a.startswith("cpu")
                                              for a in args[:1] + (kwargs.get("device"),)):  # .to("cpu")
                self.events.append(("read", "Tensor.to('cpu')"))
            return to(tensor, *args, **kwargs)
        self._patch(torch.Tensor, "to", to_host)
        for name in ("tensor", "as_tensor"):
            original = getattr(torch, name)

            def from_python(*args, __original=original, __name=name, **kwargs):
                out = __original(*args, **kwargs)
                # made on the host, then copied; the per-sample transforms of the data loading
                # machinery (workers, or the main process with --workers 0) are host code
                if kwargs.get("device") is not None and not _in_data_loading():
                    self.events.append(("host-to-device copy", f"torch.{__name}(device=...)"))
                    self._mark([out], True)
                return out
            self._patch(torch, name, from_python)

    def _patch(self, owner, name: str, value) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self):
        self._wrap_reads()
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()
        return super().__exit__(*exc)


def _in_data_loading() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "torch/utils/data" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def on_training_device(init_distributed):
    """``init_distributed`` whose CPU runs train on ``cpu:0``."""
    def init(*args, **kwargs):
        info = init_distributed(*args, **kwargs)
        assert info.device.type == "cpu", "the probe is for CPU runs"
        return dataclasses.replace(info, device=TRAINING_DEVICE)
    return init


def plant(kind: str):
    """A loss that adds a known sync: a boolean mask (a data-dependent size) or a tensor made
    from Python data on the device; the loss's value is unchanged."""
    def add_sync(loss: torch.Tensor) -> torch.Tensor:
        if kind == "mask":
            return loss + 0 * loss[loss > 0].sum()
        return loss + torch.tensor([0.0], device=loss.device).sum()
    return add_sync


def count_per_micro_step(main, args: list[str], monkeypatch_setattr, plant_kind: str | None = None) -> dict:
    """Run ``main(args)`` under the counter; return the counts between the end of one
    micro-step's backward and the end of the next one's (set-up before the first and the work
    after the last left out), and the counted events."""
    import ddp_utils.train.session as session
    from ddp_utils.data import files_on_device
    from ddp_utils.data.data_stream import LoopBatches

    monkeypatch_setattr(session, "init_distributed", on_training_device(session.init_distributed))
    # Image files on the device: each batch made on this thread when the loop asks for it, under this
    # thread's dispatch mode (a thread of its own would escape the count; this thread does more then)
    monkeypatch_setattr(files_on_device, "AHEAD", 0)
    counter, marks = HostSyncCounter(), []
    backward = torch.Tensor.backward

    def marked(self, *a, **kw):
        if plant_kind is not None:
            self = plant(plant_kind)(self)
        result = backward(self, *a, **kw)
        marks.append(counter.count)
        return result

    monkeypatch_setattr(torch.Tensor, "backward", marked)
    prepared = []  # (backward passes so far, whether no sync came since the last of them)
    prepare_next = LoopBatches.prepare_next

    def recorded(self):
        prepared.append((len(marks), bool(marks) and counter.count == marks[-1]))
        return prepare_next(self)

    monkeypatch_setattr(LoopBatches, "prepare_next", recorded)
    with counter:
        code = main(args)
    first = marks[0] if marks else 0
    return {"code": code, "per_micro_step": [b - a for a, b in zip(marks, marks[1:])],
            "events": counter.events[first:marks[-1]] if marks else [], "prepared": prepared,
            "ddp_rebuild": counter.ddp_rebuild}


def main(argv: list[str]) -> int:
    out_dir, argv = Path(argv[0]), argv[1:]
    plant_kind = None
    if argv[0] == "--plant":
        plant_kind, argv = argv[1], argv[2:]
    script, args = argv[0], argv[1:]
    sys.path.insert(0, str(REPO))
    module = __import__(Path(script).stem)
    result = count_per_micro_step(module.main, args, setattr, plant_kind)
    rank = int(os.environ.get("RANK", "0"))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    return result["code"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
