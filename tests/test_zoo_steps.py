"""The training step is the same for every model: a ViT, a ConvNeXt and an EfficientNet (torchvision's
classes, at 32 px) through train_classifier.py on 2 gloo ranks keep what the small networks' tests promise
(tests/test_accumulation.py, test_training.py, test_host_syncs.py, test_reference_recipe.py):
accumulation under ``no_sync`` (one all-reduce of every gradient byte per optimizer step), the EMA,
MixUp/CutMix of each micro-batch on its own, a resume mid-epoch that ends bit for bit where the
uninterrupted run ends, identical weights on both ranks, and one read of the device per optimizer step.

This module is also the ranks' program (``helpers.run_ranks`` calls its :func:`main`): around the real
script it counts DDP's bucket all-reduces (a comm hook, PyTorch's ``allreduce_hook`` behind it) and the
host reads (tests/host_sync_probe.py) after each micro-step's backward, and records each micro-batch's
mixed targets, into RECORD/rank<R>.pt. Each model's promises: one slow test, a few steps of batch 4."""
from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import assert_ok, assert_same_state, load_ckpt, resume_folder, run_ranks
from torchvision.models import VisionTransformer
from torchvision.models.convnext import CNBlockConfig, ConvNeXt

import train_classifier

# torchvision's families whose steps differ most from a ResNet's: a ViT (no BatchNorm, a class token),
# ConvNeXt (LayerNorm, stochastic depth: random per rank and step) and EfficientNet (BatchNorm,
# stochastic depth and dropout). 32 px: what each takes (the configuration's size probe accepts it).
ZOO = [("vit_b_32", 32), ("convnext_tiny", 32), ("efficientnet_b0", 32)]
# The ViT and ConvNeXt built small from their own classes (ConvNeXt-T's stochastic depth kept): the
# step's promises do not depend on width or depth, and ViT-B/32's 88M parameters make each of a run's
# checkpoints about a gigabyte. Each keeps over 1 MB of parameters, so that DDP fills more than one
# gradient bucket once it has rebuilt them (the first then holds 1 MB), as EfficientNet-B0 does.
SMALL = {"vit_b_32": lambda classes: VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                                       hidden_dim=192, mlp_dim=768, num_classes=classes),
         "convnext_tiny": lambda classes: ConvNeXt([CNBlockConfig(32, 64, 1), CNBlockConfig(64, 128, 1),
                                                    CNBlockConfig(128, 256, 1), CNBlockConfig(256, None, 1)],
                                                   stochastic_depth_prob=0.1, num_classes=classes)}
STEPS, STOP, ACCUM, BATCH = 4, 2, 2, 4  # the resumed run starts 4 micro-batches into the epoch (of 179)


def recipe(arch: str, size: int) -> list[str]:
    return ["--device", "cpu", "--dataset", "digits", "--model", arch, "--image-size", str(size), "-b", str(BATCH),
            "--accum-steps", str(ACCUM), "--epochs", "1", "--lr", "0.01", "--model-ema", "--model-ema-steps", "1",
            "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--log-every", "1000"]  # a log line reads the loss


# ----------------------------------------------------------------------------- the ranks' program
def main(argv: list[str]) -> int:
    """``RECORD ARGS...``: train_classifier.main(ARGS) on this rank, counted; RECORD/rank<R>.pt
    gets ``host_reads`` (host_sync_probe's result), ``comm`` (all-reduce calls and bytes so far
    after each backward), ``grad_bytes`` (the trainable parameters' gradient bytes) and ``mixed``
    ({(epoch, micro-batch of the epoch): the soft targets the mixer made})."""
    from host_sync_probe import count_per_micro_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from torchvision.transforms.v2 import _augment

    record, args = Path(argv[0]), argv[1:]
    calls, comm, mixed, grad_bytes, one_hot_reads = [0, 0], [], {}, [], []
    wrap, mixer, one_hot = train_classifier.wrap_network, train_classifier.batch_mixer, _augment.one_hot
    build = train_classifier.build_model

    def one_hot_apart(label, num_classes):
        """MixUp/CutMix's one_hot, its reads kept apart: PyTorch checks the class values with two
        reads (min, max) on devices other than CUDA and MPS only (aten/src/ATen/native/Onehot.cpp;
        on CUDA the scatter's device assert checks them): no wait on a GPU."""
        counter = _get_current_dispatch_mode()
        before = len(counter.events)
        out = one_hot(label, num_classes=num_classes)
        one_hot_reads.append([tuple(event) for event in counter.events[before:]])
        del counter.events[before:]
        return out

    def counting_hook(state, bucket):
        calls[0] += 1
        calls[1] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    def counted_network(module, info, compile):
        network = wrap(module, info, compile)
        network.register_comm_hook(None, counting_hook)
        grad_bytes.append(sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad))
        return network

    def recording_mixer(cfg, num_classes, rank):
        mix = mixer(cfg, num_classes, rank)

        def spy(images, targets, epoch, index):
            images, soft = mix(images, targets, epoch, index)
            mixed[(epoch, index)] = soft.detach().clone()
            return images, soft
        return spy

    def counted_main(args: list[str]) -> int:  # inside the probe: its backward is the one wrapped here
        backward = torch.Tensor.backward

        def marked(self, *a, **kw):
            result = backward(self, *a, **kw)
            comm.append(tuple(calls))
            return result
        torch.Tensor.backward = marked
        return train_classifier.main(args)

    def small_model(arch, num_classes, image_size):
        return SMALL[arch](num_classes) if arch in SMALL else build(arch, num_classes, image_size)

    train_classifier.wrap_network, train_classifier.batch_mixer = counted_network, recording_mixer
    train_classifier.build_model = small_model  # the name build_network calls
    _augment.one_hot = one_hot_apart
    reads = count_per_micro_step(counted_main, args, setattr)
    torch.save({"host_reads": reads, "comm": comm, "grad_bytes": grad_bytes[0], "mixed": mixed,
                "one_hot_reads": one_hot_reads}, record / f"rank{os.environ.get('RANK', '0')}.pt")
    return reads["code"]


# ----------------------------------------------------------------------------- the test
def _run(tmp_path: Path, name: str, args: list[str]) -> tuple[str, list[dict]]:
    record = tmp_path / f"{name}.record"
    record.mkdir()
    proc = run_ranks("tests/test_zoo_steps.py", [str(record), *args], tmp_path, timeout=600)
    assert_ok(proc)
    return proc.stdout, [torch.load(record / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _assert_the_step(ranks: list[dict], steps: int, checkpoints: int) -> None:
    """Each rank: after each micro-step's backward, no all-reduce in a window's first micro-step
    (``no_sync``), every gradient byte once in its last (in more than one bucket from the second step);
    one device read per optimizer step (the ranks' agreement) and none in between, but one more after
    the step a checkpoint follows (its weights' finite check across ranks, checkpoint.py) for each of
    the ``checkpoints`` steps that end a window of STOP steps; each micro-batch mixed on its own (soft
    targets of BATCH images). Two reads the probe sees that a GPU would not wait for, told apart: the
    two class checks of each micro-batch's one_hot (:func:`main`), and one copy in the run's first
    all-reduce, DDP's first bucket fill through the counting comm hook (without the hook the probe sees
    none: a one-time event, as tests/test_host_syncs.py allows DDP's bucket rebuild)."""
    for rank in ranks:
        counts = [(0, 0), *rank["comm"]]
        per_micro = [(c - c0, b - b0) for (c0, b0), (c, b) in zip(counts, counts[1:])]
        assert len(per_micro) == steps * ACCUM
        assert per_micro[0::ACCUM] == [(0, 0)] * steps, per_micro  # under no_sync: nothing sent
        last = per_micro[ACCUM - 1::ACCUM]
        assert all(sent == rank["grad_bytes"] for _, sent in last), (per_micro, rank["grad_bytes"])
        # DDP's first step fills buckets of 25 MB (one here); from its second, after their rebuild, the first holds 1 MB
        assert last[0][0] >= 1 and all(calls >= 2 for calls, _ in last[1:]), per_micro
        assert all(soft.shape == (BATCH, 10) and soft.dtype == torch.float32 for soft in rank["mixed"].values())
        reads, expected = rank["host_reads"], ([0] * (ACCUM - 1) + [1]) * (steps - 1) + [0] * (ACCUM - 1)
        for step in range(STOP, STOP * checkpoints + 1, STOP):
            expected[step * ACCUM - 1] += 1
        events = Counter(map(tuple, reads["events"]))
        first_fill = events.pop(("read", "aten.copy_"), 0)  # 1 on torch 2.14.1
        assert first_fill <= 1 and reads["per_micro_step"] == [expected[0] + first_fill, *expected[1:]], events
        assert events == {("read", "Tensor.tolist"): steps - 1,  # the agreement, once per optimizer step
                          **({("read", "aten._local_scalar_dense.default"): checkpoints} if checkpoints else {})}
        assert len(rank["one_hot_reads"]) == steps * ACCUM  # one one_hot per micro-batch: each mixed on its own
        assert all(len(seen) <= 2 and set(seen) <= {("read", "aten._local_scalar_dense.default")}
                   for seen in rank["one_hot_reads"]), rank["one_hot_reads"]  # 2 each on torch 2.14.1


@pytest.mark.slow
@pytest.mark.parametrize("arch, size", ZOO)
def test_the_step_holds_for_a_vit_a_convnext_and_an_efficientnet(tmp_path, arch, size):
    """``--model ARCH`` (built as SMALL says where it names ARCH) on 2 gloo ranks, 2 micro-batches
    of 4 per step, the EMA after every step, MixUp and CutMix: a run of STEPS steps that keeps its
    checkpoint of step STOP (mid-epoch), and that checkpoint resumed with --resume auto to STEPS.
    Each run: the step's promises on each rank (_assert_the_step) and its weights and EMA identical
    on both ranks (the script's own end-of-run check). The resumed run mixes its micro-batches as
    the uninterrupted one did and ends with the same weights, buffers, momentum and EMA, bit for bit."""
    full = tmp_path / "full"
    base = recipe(arch, size)
    runs = {"full": _run(tmp_path, "full", [*base, "--max-steps", str(STEPS), "--ckpt-every", str(STOP),
                                            "--out", str(full)])}
    part = resume_folder(next(p for p in full.glob("checkpoint_*.pt") if load_ckpt(p)["step"] == STOP),
                         tmp_path / "part")
    runs["resumed"] = _run(tmp_path, "resumed", [*base, "--max-steps", str(STEPS), "--resume", "auto", "--out", str(part)])
    for name, (stdout, ranks) in runs.items():
        _assert_the_step(ranks, *((STEPS - STOP, 0) if name == "resumed" else (STEPS, 1)))
        assert "weights identical on all 2 ranks" in stdout and "EMA of the weights identical on all 2 ranks" in stdout
    assert f"step {STOP}, in epoch 1, {STOP * ACCUM} batches into the epoch" in runs["resumed"][0]
    for rank, (whole, resumed) in enumerate(zip(runs["full"][1], runs["resumed"][1])):
        assert sorted(whole["mixed"]) == [(0, i) for i in range(STEPS * ACCUM)], rank
        assert sorted(resumed["mixed"]) == [(0, i) for i in range(STOP * ACCUM, STEPS * ACCUM)], rank
        assert all(torch.equal(soft, whole["mixed"][key]) for key, soft in resumed["mixed"].items()), rank
    resumed, whole = load_ckpt(part / "checkpoint_last.pt"), load_ckpt(full / "checkpoint_last.pt")
    assert_same_state(resumed, whole)
    assert whole["step"] == STEPS and int(whole["model_ema"]["n_averaged"]) == STEPS  # an update after every step
    assert any(not torch.equal(whole["model_ema"][f"module.{name}"], value) for name, value in whole["model"].items())


if __name__ == "__main__":  # the ranks' program, by hand: python tests/test_zoo_steps.py RECORD ARGS...
    sys.exit(main(sys.argv[1:]))
