"""Probe: the device augmentation of a packed batch is one capturable sequence of kernels.

    python bench/augment_capture.py --device cuda        # CUDA graph + torch.compile(fullgraph=True)
    python bench/augment_capture.py --device cpu         # torch.compile(fullgraph=True) only

Both MoCo v2 views at 224 px of a packed batch of ImageNet-size noise images (noise: the
steepest edges, where a wrong read shows most), from the uint8 atlas on the device to the
normalised views, as ``DeviceAugment.packed`` runs them after its uniforms and places are on
the device:

- ``torch.compile(fullgraph=True, backend="eager")``, on the CPU whatever ``--device`` (on
  CUDA the blur's switch away from cuDNN is Python state that a trace leaves out): a graph
  break or a data-dependent host read raises; its views must be eager's to float32 round-off
  (:data:`ROUND_OFF`: bit for bit on torch 2.14, 6e-7 to 1.4e-6 apart on 2.11, whose trace rewrites an
  op or two).
- on CUDA, a CUDA graph captured once (after a warm-up on a side stream, as capture requires),
  then replayed on other images and other draws copied into its static inputs: its views must
  equal eager's on those inputs bit for bit. A host read during capture (``.item()``, a
  pageable copy, a nonzero) makes the capture itself fail. Also printed: the host's time to
  issue one batch's augmentation eagerly and as one replay (what the GPU step saves).

The probe's scope (:data:`SCOPE`, printed with its result): a graph replays the shapes it was
captured with, here one atlas shape and one batch size. A training run's batches change both
(the atlas's tiles with the images' sizes, a smaller last batch), and the training loop runs the
augmentation eagerly: capture there would need a fixed-capacity atlas and a fixed batch, which
this project does not build. The probe shows that the kernels themselves can be captured (no
host read, no shape drawn), not that a run replays them.

Exit code 0 when every check passes, 1 when one fails (one line each says which and by how much),
2 when the device asked for is not there.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

import torch
import torchvision.ops  # noqa: F401  (roi_align's fake-tensor rules, which torch.compile traces with)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_utils.data import batch_augment as ba  # noqa: E402
from ddp_utils.data.files_on_device import pack  # noqa: E402
from ddp_utils.data.recipes import moco_recipe  # noqa: E402

SCOPE = ("scope: one atlas shape and batch size, captured and replayed here; training runs the augmentation "
         "eagerly (its atlases and last batch change shape)")
ROUND_OFF = 1e-5  # compiled against eager views: a few float32 steps of normalised values (std ~0.22)
SIZES = [(375, 500), (500, 375), (333, 500), (500, 333), (400, 400), (480, 640)]


def packed_batch(batch: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(atlas on ``device``, places on ``device``) of ``batch`` noise images of ImageNet sizes."""
    g = torch.Generator().manual_seed(seed)
    images = [torch.randint(0, 256, (3, *SIZES[i % len(SIZES)]), dtype=torch.uint8, generator=g) for i in range(batch)]
    atlas, places = pack(images)
    return atlas.to(device), places.to(device)


def make_views(out: int):
    augment = ba.BatchAugment(moco_recipe("imagefolder", out, "v2"), out)

    def views(atlas: torch.Tensor, places: torch.Tensor, u: torch.Tensor) -> list[torch.Tensor]:
        x = ba.atlas_for_resampling(atlas)
        return [augment.apply_packed(x, places, u[:, v * ba.VIEW_COLUMNS:(v + 1) * ba.VIEW_COLUMNS]) for v in (0, 1)]
    return views


def uniforms(epoch: int, batch: int, device: torch.device) -> torch.Tensor:
    return ba.keyed_uniforms(0, epoch, torch.arange(batch), views=2).to(device)


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def check_compile(views, atlas, places, u) -> bool:
    import torch._dynamo

    torch._logging.set_logs(dynamo=logging.ERROR)  # not its note that profiler ranges are left out
    warnings.filterwarnings("ignore", "Dynamo detected a call to a `functools.lru_cache`")  # cached constants
    torch._dynamo.reset()
    try:
        captured = torch.compile(views, fullgraph=True, backend="eager")(atlas, places, u)
    except Exception as err:  # noqa: BLE001 (the probe reports whatever stops the trace)
        print(f"FAILED torch.compile(fullgraph=True): {type(err).__name__}: {str(err).splitlines()[0]}")
        return False
    difference = largest_difference(captured, views(atlas, places, u))
    ok = difference <= ROUND_OFF
    print(f"{'ok' if ok else 'FAILED'} torch.compile(fullgraph=True): max |compiled - eager| {difference:.3g}")
    return ok


def host_ms(fn, repeats: int) -> float:
    """Host milliseconds to issue ``fn`` (the GPU's work is not waited for, except between calls)."""
    total = 0.0
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * total / repeats


def check_cuda_graph(views, batch: int, device: torch.device, repeats: int) -> bool:
    atlas, places = packed_batch(batch, 0, device)
    u = uniforms(0, batch, device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up: cached constants, cuDNN's choices, the allocator's pools
        for _ in range(2):
            views(atlas, places, u)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_out = views(atlas, places, u)
    except Exception as err:  # noqa: BLE001
        print(f"FAILED CUDA graph capture: {type(err).__name__}: {str(err).splitlines()[0]}")
        return False
    # Other images of the same sizes (the same atlas shape) and another epoch's draws, copied in.
    other_atlas, other_places = packed_batch(batch, 1, device)
    atlas.copy_(other_atlas)
    places.copy_(other_places)
    u.copy_(uniforms(1, batch, device))
    graph.replay()
    difference = largest_difference(static_out, views(atlas, places, u))
    eager_ms = host_ms(lambda: views(atlas, places, u), repeats)
    replay_ms = host_ms(graph.replay, repeats)
    ok = difference == 0
    print(f"{'ok' if ok else 'FAILED'} CUDA graph, {batch} images, replayed on other inputs: max |graph - eager| "
          f"{difference:.3g}; host time per batch: eager {eager_ms:.2f} ms, replay {replay_ms:.3f} ms")
    return ok


def device_arg(text: str) -> str:
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N")
    parser.add_argument("--batch", type=int, default=None, help="images per batch (default: 128 on CUDA, 4 on CPU)")
    parser.add_argument("--size", type=int, default=None, help="output px (default: 224 on CUDA, 64 on CPU)")
    parser.add_argument("--repeats", type=int, default=20, help="batches timed on the host (CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("augment_capture: --device cuda, but torch sees no GPU here; run it on a GPU machine or with --device cpu",
              file=sys.stderr)
        return 2
    batch = args.batch or (128 if cuda else 4)
    views = make_views(args.size or (224 if cuda else 64))
    cpu = torch.device("cpu")
    ok = check_compile(views, *packed_batch(min(batch, 4), 0, cpu), uniforms(0, min(batch, 4), cpu))
    if cuda:
        ok = check_cuda_graph(views, batch, device, args.repeats) and ok
    else:
        print("(CUDA graph capture: needs a GPU, not run)")
    print(SCOPE)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
