"""--weights and --test-only: torchvision's published weights read from torch's hub cache (made here,
in a temporary cache: no network) and evaluated with their own view, as torchvision's script prints
them; a checkpoint of this project evaluated again; fine-tuning from published weights of another
class count; and each mistake one line, exit 2."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import assert_ok, in_process, load_ckpt, run_ranks, write_image_folder

import train_classifier
from ddp_utils.models.weights import published_weights

WEIGHTS = "ShuffleNet_V2_X0_5_Weights.IMAGENET1K_V1"  # the smallest of torchvision's files that is an ImageNet model
MODEL = "shufflenet_v2_x0_5"
TEST_LINE = re.compile(r"Test: Acc@1 ([\d.]+) Acc@5 ([\d.]+) \((\d+) images")


@pytest.fixture
def hub(tmp_path, monkeypatch) -> dict[str, torch.Tensor]:
    """A hub cache in tmp_path holding WEIGHTS' file: seeded weights of the right model."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    torch.manual_seed(5)
    state = torchvision.models.get_model(MODEL, num_classes=1000).state_dict()
    path = published_weights(WEIGHTS).file
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    return state


@pytest.fixture(scope="module")
def thousand_classes(tmp_path_factory) -> Path:
    """An ImageFolder of ImageNet's 1000 classes, one training and one validation file each (links
    to three digit images of different sizes), as the published weights classify."""
    seed = tmp_path_factory.mktemp("seed")
    write_image_folder(seed, per_class=1)
    sources = [next((seed / "train" / f"class{c}").iterdir()) for c in range(3)]
    root = tmp_path_factory.mktemp("thousand")
    for split in ("train", "val"):
        for c in range(1000):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            (folder / "0.png").hardlink_to(sources[c % 3])
    return root


def expected_accuracy(model: torch.nn.Module, view, root: Path) -> tuple[float, float]:
    """acc@1 and acc@5 (3 decimals, as printed) of ``model`` on root/val, computed apart from the
    script: ``view`` on each decoded image, one at a time."""
    model.eval()
    top1 = top5 = 0
    folders = sorted((root / "val").iterdir())
    with torch.no_grad():
        for label, folder in enumerate(folders):
            image = torchvision.io.decode_image(str(folder / "0.png"), mode=torchvision.io.ImageReadMode.RGB)
            ranked = model(view(image)[None]).topk(5).indices[0].tolist()
            top1 += ranked[0] == label
            top5 += label in ranked
    return round(100 * top1 / len(folders), 3), round(100 * top5 / len(folders), 3)


@pytest.mark.slow
def test_test_only_evaluates_hub_cache_weights_as_torchvision_scores_them(hub, thousand_classes, tmp_path, capsys):
    proc = in_process(train_classifier.main, ["--data-path", str(thousand_classes), "--model", MODEL, "--test-only",
                                              "--weights", WEIGHTS, "--device", "cpu", "--out", str(tmp_path / "out")],
                      capsys)
    assert proc.returncode == 0, proc.stderr
    acc1, acc5, count = TEST_LINE.search(proc.stderr + proc.stdout).groups()
    model = torchvision.models.get_model(MODEL, num_classes=1000)
    model.load_state_dict(hub)
    view = torchvision.models.get_weight(WEIGHTS).transforms()
    assert (float(acc1), float(acc5), int(count)) == (*expected_accuracy(model, view, thousand_classes), 1000)
    assert not (tmp_path / "out").exists()  # nothing written


def test_weights_missing_from_the_hub_cache_are_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    folder = tmp_path / "data"
    write_image_folder(folder, per_class=2)
    for extra in ([], ["--check"]):
        proc = in_process(train_classifier.main, ["--data-path", str(folder), "--model", MODEL, "--test-only",
                                                  "--weights", WEIGHTS, "--device", "cpu", "-b", "2", *extra],
                          capsys)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert f"shufflenetv2_x0.5-f707e7126e.pth is not in torch's hub cache ({tmp_path / 'empty'}/hub/checkpoints)" \
            in lines[0]


@pytest.mark.parametrize("args, message", [
    (["--test-only"], "--test-only evaluates --weights: give torchvision's weights by name"),
    (["--weights", "ShuffleNet_V2_X0_5_Weights.IMAGENET1K_V2"], "not torchvision's weights; did you mean "
                                                                "ShuffleNet_V2_X0_5_Weights.IMAGENET1K_V1?"),
    (["--weights", "runs/none_such"], "--weights runs/none_such: no such file or folder"),
    (["--weights", WEIGHTS, "--linear-probe"], "--weights starts the whole network and --linear-probe its backbone"),
    (["--weights", "ResNet50_Weights.IMAGENET1K_V2"], "--weights ResNet50_Weights.IMAGENET1K_V2 are resnet50's, and "
                                                      "this run has --model shufflenet_v2_x0_5: give --model resnet50"),
])
def test_weights_mistakes_are_one_line(tmp_path, capsys, args, message):
    folder = tmp_path / "data"
    write_image_folder(folder, per_class=2)
    proc = in_process(train_classifier.main, ["--data-path", str(folder), "--model", MODEL, "--device", "cpu",
                                              "--out", str(tmp_path / "out"), "-b", "2", "--check", *args], capsys)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_evaluating_published_weights_on_other_classes_is_one_line(hub, tmp_path, capsys):
    folder = tmp_path / "data"
    write_image_folder(folder, per_class=2)
    proc = in_process(train_classifier.main, ["--data-path", str(folder), "--model", MODEL, "--test-only",
                                              "--weights", WEIGHTS, "--device", "cpu", "-b", "2"], capsys)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "fc.weight is (1000, 1024) there and (3, 1024) here: weights for other classes than this data's" in lines[0]


DIGITS = ["--dataset", "digits", "--device", "cpu", "--arch", "lenet", "--image-size", "16", "--batch-size", "32"]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> tuple[Path, tuple[str, str]]:
    """A LeNet run of one epoch on the digits: its folder and its last (acc1, acc5), as logged."""
    import contextlib
    import io
    import logging

    run = tmp_path_factory.mktemp("digits") / "run"
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    logging.getLogger("train").addHandler(handler)
    try:
        with contextlib.redirect_stdout(said):
            assert train_classifier.main([*DIGITS, "--epochs", "1", "--out", str(run)]) == 0
    finally:
        logging.getLogger("train").removeHandler(handler)
    return run, re.search(r"final val acc1 ([\d.]+)%, acc5 ([\d.]+)%", said.getvalue()).groups()


def test_test_only_on_a_checkpoint_scores_what_its_run_scored(digits_run, capsys):
    """A run's own checkpoint, evaluated again: its last validation accuracy, on the same images."""
    run, final = digits_run
    proc = in_process(train_classifier.main, [*DIGITS, "--test-only", "--weights", str(run)], capsys)
    assert proc.returncode == 0, proc.stderr
    acc1, acc5, _ = TEST_LINE.search(proc.stderr + proc.stdout).groups()
    assert (f"{float(acc1):.2f}", f"{float(acc5):.2f}") == final
    other = in_process(train_classifier.main, [*DIGITS, "--test-only", "--weights", str(run), "--arch", "small_cnn"],
                       capsys)
    assert other.returncode == 2 and "a lenet checkpoint, but this run has --model small_cnn" in other.stderr


@pytest.mark.slow
def test_test_only_on_two_ranks_scores_as_one_process(digits_run, tmp_path):
    """torchrun's way: each rank scores its share of the validation split, the sums agreed."""
    run, final = digits_run
    proc = run_ranks("train_classifier.py", [*DIGITS, "--test-only", "--weights", str(run)], tmp_path)
    assert_ok(proc)
    acc1, acc5, count = TEST_LINE.search(proc.stdout + proc.stderr).groups()
    assert (f"{float(acc1):.2f}", f"{float(acc5):.2f}", count) == (*final, "359")


def test_fine_tuning_published_weights_keeps_all_but_the_classifier(hub, tmp_path, capsys):
    """--weights without --test-only on 3 classes: every tensor but the 1000-class fc starts as the
    file's (one step at an LR that barely moves them), fc starts fresh, said in the log."""
    folder = tmp_path / "data"
    write_image_folder(folder, per_class=4)
    proc = in_process(train_classifier.main, ["--data-path", str(folder), "--model", MODEL, "--weights", WEIGHTS,
                                              "--device", "cpu", "--image-size", "64", "--train-crop-size", "64",
                                              "--val-resize-size", "64", "-b", "4", "--lr", "1e-9", "--momentum", "0",
                                              "--wd", "0", "--max-steps", "1", "-j", "0", "--out", str(tmp_path / "run")],
                      capsys)
    assert proc.returncode == 0, proc.stderr
    assert f"weights from {WEIGHTS}; fc.weight, fc.bias start fresh (another shape there)" in proc.stderr + proc.stdout
    model = load_ckpt(tmp_path / "run" / "checkpoint_last.pt")["model"]
    convs = [k for k in hub if k.endswith(".weight") and hub[k].dim() == 4]
    assert convs and all(torch.allclose(model[k], hub[k], atol=1e-6) for k in convs)
    assert model["fc.weight"].shape == (3, 1024)


def test_inception_takes_its_published_weights_without_the_auxiliary_head():
    """torchvision's Inception v3 weights hold AuxLogits, which this project's Inception leaves out:
    dropped; the input rescaling its builder sets with those weights is set (transform_input)."""
    from ddp_utils.models.backbones import build_model
    from ddp_utils.models.weights import put_weights

    torch.manual_seed(0)
    published = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=True).state_dict()
    assert any(k.startswith("AuxLogits.") for k in published)
    model = build_model("inception_v3", 1000, 299)
    assert not model.transform_input
    assert put_weights(model, published, "Inception_V3_Weights.IMAGENET1K_V1", exact=True, published=True) == []
    assert model.transform_input
    assert all(torch.equal(v, published[k]) for k, v in model.state_dict().items())


TIMM_WEIGHTS, TIMM_MODEL = "timm/mobilenetv3_small_050.lamb_in1k", "timm/mobilenetv3_small_050"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> dict[str, torch.Tensor]:
    """A Hugging Face hub cache in tmp_path holding TIMM_WEIGHTS (seeded weights of the right model,
    as safetensors in the cache's layout: refs/main naming the snapshot), HF_HOME pointing at it
    for a subprocess and the cache's constant for this one."""
    import timm
    from huggingface_hub import constants
    from safetensors.torch import save_file

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    torch.manual_seed(6)
    state = {k: v.contiguous() for k, v in timm.create_model(TIMM_MODEL[5:], num_classes=1000).state_dict().items()}
    repo = home / "hub" / "models--timm--mobilenetv3_small_050.lamb_in1k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    save_file(state, repo / "snapshots" / "0123abcd" / "model.safetensors")
    return state


@pytest.mark.slow
def test_test_only_evaluates_timms_weights_from_the_hugging_face_cache(hf_cache, thousand_classes, tmp_path, capsys):
    """timm's weights by their hub name, with timm's view of them (224 px crop of a 256 px resize,
    bicubic: crop_pct 0.875), scored as the same model scores the same images apart from the script."""
    import timm
    from torchvision.transforms import v2

    proc = in_process(train_classifier.main, ["--data-path", str(thousand_classes), "--model", TIMM_MODEL,
                                              "--test-only", "--weights", TIMM_WEIGHTS, "--device", "cpu"], capsys)
    assert proc.returncode == 0, proc.stderr
    said = proc.stderr + proc.stdout
    assert "evaluation view: resize 256 px, centre crop 224 px, bicubic" in said
    acc1, acc5, count = TEST_LINE.search(said).groups()
    model = timm.create_model(TIMM_MODEL[5:], num_classes=1000)
    model.load_state_dict(hf_cache)
    view = v2.Compose([v2.Resize(256, v2.InterpolationMode.BICUBIC, antialias=True), v2.CenterCrop(224),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    assert (float(acc1), float(acc5), int(count)) == (*expected_accuracy(model, view, thousand_classes), 1000)


def test_timms_weights_missing_or_mistaken_are_one_line(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty" / "hub"))
    folder = tmp_path / "data"
    write_image_folder(folder, per_class=2)
    for weights, message in (
            (TIMM_WEIGHTS, "model.safetensors is not in the Hugging Face hub cache ("),
            ("timm/mobilenetv3_small_050.nonesuch", "not timm's published weights (timm/ARCH.TAG"),
            ("timm/test_vit.r160_in1k", "are timm/test_vit's, and this run has --model timm/mobilenetv3_small_050"),
    ):
        proc = in_process(train_classifier.main, ["--data-path", str(folder), "--model", TIMM_MODEL, "--test-only",
                                                  "--weights", weights, "--device", "cpu", "-b", "2", "--check"],
                          capsys)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    proc = in_process(train_classifier.main, ["--data-path", str(folder), "--model", "timm/test_vit", "--test-only",
                                              "--weights", "timm/test_vit.r160_in1k", "-b", "2", "--check"], capsys)
    assert proc.returncode == 2 and "were trained on images normalised with mean (0.5, 0.5, 0.5)" in proc.stderr
