"""timm's models by name (``--model timm/NAME``, requirements-timm.txt, installed for the tests):
one trains through the script with the recipe's flags (on 2 ranks: slow), --check counts its
parameters, the size probe knows it, and an unknown name, a missing timm or an fc-only flag is one
line and exit 2."""
from __future__ import annotations

import sys

import pytest
import timm
import torch
from helpers import assert_ok, in_process, load_ckpt, run_ranks

import train_classifier
from ddp_utils.config import UsageError
from ddp_utils.models.backbones import build_model, ends_in_fc, input_refusal, parameter_count

DIGITS = ["--dataset", "digits", "--device", "cpu", "--image-size", "32", "--batch-size", "16"]


def test_a_timm_model_trains_through_the_script_with_the_recipes_flags(tmp_path, capsys):
    """timm's tiny ViT (built for the 32 px images: it takes an img_size) with AdamW, the EMA and
    mixup: the run ends, and the checkpoint records the name as given and timm's own weights."""
    out = tmp_path / "run"
    proc = in_process(train_classifier.main, [*DIGITS, "--model", "timm/test_vit", "--max-steps", "2", "--opt", "adamw",
                                              "--model-ema", "--mixup-alpha", "0.2", "--out", str(out)], capsys)
    assert_ok(proc)
    ckpt = load_ckpt(out / "checkpoint_last.pt")
    assert ckpt["config"]["arch"] == "timm/test_vit" and ckpt["step"] == 2
    assert ckpt["config"]["optimizer"] == "adamw" and ckpt["config"]["mixup_alpha"] == 0.2 and "model_ema" in ckpt
    assert "ema acc1" in proc.stdout + proc.stderr
    expected = timm.create_model("test_vit", num_classes=10, img_size=32).state_dict()
    assert {k: v.shape for k, v in ckpt["model"].items()} == {k: v.shape for k, v in expected.items()}


@pytest.mark.slow
def test_a_timm_model_trains_on_two_ranks_with_accumulation(tmp_path):
    """DDP around a timm model: the ranks end with identical weights and EMA."""
    proc = run_ranks("train_classifier.py", [*DIGITS, "--model", "timm/test_vit", "--max-steps", "2", "--accum-steps",
                                             "2", "--model-ema", "--out", str(tmp_path / "run")], tmp_path)
    assert_ok(proc)
    assert "weights identical on all 2 ranks" in proc.stdout + proc.stderr
    assert "EMA of the weights identical on all 2 ranks" in proc.stdout + proc.stderr


@pytest.mark.parametrize("name,size", [("test_vit", {"img_size": 32}), ("resnet10t", {})])  # a ViT built for 32 px
def test_check_names_the_model_and_timms_parameter_count(name, size, capsys):
    proc = in_process(train_classifier.main, [*DIGITS, "--check", "--model", f"timm/{name}"], capsys)
    assert_ok(proc)
    count = sum(p.numel() for p in timm.create_model(name, num_classes=10, **size).parameters())
    assert f"  network: timm/{name} for 10 classes, {count:,} parameters\n" in proc.stdout
    assert parameter_count(f"timm/{name}", 10, 32) == count


def test_timm_models_are_built_without_weights_for_the_image_size():
    """``pretrained=False``, the data set's classes; ``img_size`` where the model takes one (its
    position embedding fits the image, as torchvision's ViTs'), not where it does not (ResNet)."""
    vit, resnet = build_model("timm/test_vit", 7, 32), build_model("timm/resnet10t", 7, 32)
    assert vit.patch_embed.img_size == (32, 32) and vit.head.out_features == 7
    assert resnet.fc.out_features == 7 and resnet.conv1[0].stride == (2, 2)  # timm's own stem, not the CIFAR one
    assert vit.train()(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    assert not ends_in_fc("timm/resnet10t")  # the linear probe and --pretrained want torchvision's ResNets


def test_the_size_probe_knows_timm_models():
    """On the meta device (no memory, no arithmetic), in timm's words: a ViT built for one size
    refuses a training crop of another (test_vit resamples its position embedding: it takes
    both), a patch that does not divide the image, a window partition left with nothing; a
    convnet takes them."""
    assert input_refusal("timm/test_vit_relpos", 32, [48, 32]) == (48, "Input height (48) doesn't match model (32).")
    assert input_refusal("timm/test_vit", 32, [48, 32]) is None
    assert input_refusal("timm/test_vit", 24, [24]) == (24, "Input height (24) should be divisible by patch size (16).")
    assert input_refusal("timm/test_maxvit", 20, [20]) == (20, "integer modulo by zero")
    assert input_refusal("timm/resnet10t", 32, [48, 32]) is None


@pytest.mark.parametrize("args,line", [
    (["--model", "timm/test_vitt"], "--arch timm/test_vitt: not a model of timm; did you mean timm/test_vit? "
                                    "(every name: python -c 'import timm; print(timm.list_models())')"),
    (["--model", "timm/resnet10t", "--linear-probe"], "--linear-probe puts a new fc on the backbone, and --arch "
                                                      "timm/resnet10t's classifier is not one named fc"),
    (["--model", "timm/test_vit", "--image-size", "24"], "--arch timm/test_vit cannot take 24 px images (Input "
                                                         "height (24) should be divisible by patch size (16).)"),
])
def test_a_timm_model_that_cannot_train_is_one_line_and_exit_2(args, line, capsys):
    proc = in_process(train_classifier.main, [*DIGITS, "--check", *args], capsys)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and line in proc.stderr


def test_without_timm_a_timm_name_is_one_line_naming_the_requirement(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` now raises ImportError
    proc = in_process(train_classifier.main, [*DIGITS, "--check", "--model", "timm/resnet50"], capsys)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert "--arch timm/resnet50 needs timm: pip install -r requirements-timm.txt" in proc.stderr
    with pytest.raises(UsageError, match="requirements-timm.txt"):
        build_model("timm/resnet50", 10, 32)
    assert_ok(in_process(train_classifier.main, [*DIGITS, "--check", "--model", "resnet18"], capsys))
