"""The bytes autograd keeps for backward while one optimizer step runs, at their peak.

Counts every tensor saved for backward by its storage (each storage once, however many views
of it are saved), from when the graph saves it until the graph lets it go. Unlike the process's
resident memory (which the allocator's caching makes vary by 100 MiB from run to run), this is
exact and repeatable: it is the memory a graph that outlives its micro-step would cost.

mode "ours" is train_classifier.py itself (a backward per micro-batch, then the optimizer step);
mode "summed_loss" is the classic mistake of summing the window's losses and calling backward
once, which keeps every micro-batch's graph alive until the end of the window.
"""
from __future__ import annotations

import torch
from torch import nn

MICRO_BATCH, SIZE, WIDTH = 32, 32, 32


class SavedTensorMeter:
    """A ``saved_tensors_hooks`` pair that tracks the live and peak bytes of saved storages."""

    def __init__(self):
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> "_Held":
        return _Held(self, tensor)

    @staticmethod
    def unpack(held: "_Held") -> torch.Tensor:
        return held.tensor

    def hold(self, key: int, nbytes: int) -> None:
        self.refs[key] = self.refs.get(key, 0) + 1
        if self.refs[key] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes


class _Held:
    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        self.meter, self.tensor = meter, tensor
        self.key, self.nbytes = storage.data_ptr(), storage.nbytes()
        meter.hold(self.key, self.nbytes)

    def __del__(self):  # the graph that saved the tensor is gone
        self.meter.release(self.key, self.nbytes)


def peak_saved_bytes(accum_steps: int, mode: str, out: str) -> int:
    """mode "ours": the real train_classifier.py (its train_one_epoch) on synthetic 32 px
    images, two optimizer steps of ``accum_steps`` micro-batches; "summed_loss": the mistake on
    a small CNN, one window."""
    if mode == "ours":
        import train_classifier

        args = ["--device", "cpu", "--dataset", "synthetic", "--synthetic-samples", str(2 * MICRO_BATCH * accum_steps),
                "--image-size", str(SIZE), "--arch", "small_cnn", "--no-augment", "--batch-size", str(MICRO_BATCH),
                "--accum-steps", str(accum_steps), "--epochs", "1", "--out", out]
        meter = SavedTensorMeter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            assert train_classifier.main(args) == 0
        assert meter.live == 0, "a saved tensor outlived the run"
        return meter.peak
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, WIDTH, 3, padding=1), nn.BatchNorm2d(WIDTH), nn.ReLU(),
                          nn.Conv2d(WIDTH, WIDTH, 3, padding=1), nn.BatchNorm2d(WIDTH), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(WIDTH, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = [(torch.randn(MICRO_BATCH, 3, SIZE, SIZE), torch.randint(10, (MICRO_BATCH,)))
               for _ in range(accum_steps)]
    meter = SavedTensorMeter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        total = sum(nn.functional.cross_entropy(model(x), y) for x, y in batches)
        (total / accum_steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del total
    assert meter.live == 0, "a saved tensor outlived the step"
    return meter.peak
