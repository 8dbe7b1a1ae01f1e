"""Run by test_training.py in a fresh process: peak RSS of one optimizer step with A micro-batches.

mode "ours" uses GradientAccumulator (backward per micro-batch); mode "summed_loss" is the
classic mistake of summing the window's losses and calling backward once, which keeps every
micro-batch's graph alive until the end of the window. Prints the peak RSS in bytes.
"""
import resource
import sys

import torch
from torch import nn

from ddp_utils.accumulation import GradientAccumulator

MICRO_BATCH, SIZE, WIDTH = 32, 64, 32


def main(accum_steps: int, mode: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(3, WIDTH, 3, padding=1), nn.BatchNorm2d(WIDTH), nn.ReLU(),
                          nn.Conv2d(WIDTH, WIDTH, 3, padding=1), nn.BatchNorm2d(WIDTH), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(WIDTH, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = [(torch.randn(MICRO_BATCH, 3, SIZE, SIZE), torch.randint(10, (MICRO_BATCH,)))
               for _ in range(accum_steps)]
    accumulator = GradientAccumulator(model, optimizer, accum_steps)
    for _ in range(2):  # the second step runs with optimizer state and allocator caches in place
        if mode == "ours":
            for micro, (x, y) in accumulator.micro_batches(batches):
                with accumulator.sync_context(micro):
                    accumulator.backward(nn.functional.cross_entropy(model(x), y), micro)
        else:
            total = sum(nn.functional.cross_entropy(model(x), y) for x, y in batches)
            (total / accum_steps).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
