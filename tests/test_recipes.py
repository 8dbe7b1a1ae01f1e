"""recipes/*.json: each is a valid --config of its script, the README lists exactly what each one
sets, and a run's own config.json repeats that run bit for bit."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
from helpers import REPO, in_process, load_ckpt, published_commands

import train_classifier
import train_moco
from ddp_utils.config import UsageError, flag_name, parse_config
from ddp_utils.runtime.launch import LaunchEnv

# recipe -> (script, world size it is meant for, extra flags a user must add, what it reached and where)
RECIPES = {
    "classifier_digits_quickstart": ("train_classifier.py", 2, [], "val acc1 97.21 to 98.05% (this README)"),
    "classifier_digits_regularized": ("train_classifier.py", 2, [], "val acc1 98.05 to 98.61%, its EMA 98.33 to "
                                      "98.89% (this README)"),
    "moco_digits_quickstart": ("train_moco.py", 2, [], "kNN acc1 86.9 to 90.0% (this README)"),
    "moco_cifar10_demo": ("train_moco.py", 1, [], "kNN acc1 82.6% (the MoCo authors' demo)"),
    "moco_cifar10_demo_symmetric": ("train_moco.py", 1, [], "kNN acc1 85.3% (the MoCo authors' demo)"),
    "moco_v1_imagenet": ("train_moco.py", 8, [], "linear probe 60.6% (the MoCo authors)"),
    "moco_v2_imagenet": ("train_moco.py", 8, [], "linear probe 67.7% (the MoCo authors)"),
    "probe_digits": ("train_classifier.py", 2, [], "val acc1 94.15 to 96.66% (this README)"),
    "linear_probe_imagenet": ("train_classifier.py", 8, ["--pretrained", "runs/mocov2_in1k/checkpoint_last.pt"],
                              "67.7% on MoCo v2's backbone (the MoCo authors)"),
    "resnet50_imagenet_torchvision_v2": ("train_classifier.py", 8, [], "Acc@1 80.86% (torchvision)"),
}
# recipes/torchvision_*.json: one per row of torchvision's published commands (tests/test_torchvision_commands.py)
for _row in published_commands():
    if _row.recipe and "--test-only" not in _row.argv:
        _script, _gpus, _extra, _reached = RECIPES.get(_row.recipe, ("train_classifier.py", _row.gpus, [], ""))
        RECIPES[_row.recipe] = (_script, _gpus, _extra, f"{_reached.removesuffix(' (torchvision)')}"
                                f"{', ' if _reached else 'Acc@1 '}{_row.model} {_row.acc1:g}% (torchvision)")
CONFIGS = {"train_classifier.py": train_classifier.ClassifierConfig, "train_moco.py": train_moco.MocoConfig}


def recipe_flags(name: str) -> str:
    """What a recipe sets, as command-line flags (notes left out)."""
    parts = []
    for key, value in json.loads((REPO / "recipes" / f"{name}.json").read_text()).items():
        if key.startswith("_"):
            continue
        if isinstance(value, bool):
            parts.append(flag_name(key) if value else "--no-" + flag_name(key)[2:])
        else:
            parts += [flag_name(key), shlex.quote(str(value))]
    return " ".join(parts)


def recipe_table() -> str:
    """The README's table of recipes (tests below keep the two equal)."""
    rows = ["| recipe | script | reached (where published) | sets |", "| --- | --- | --- | --- |"]
    for name, (script, _, extra, reached) in RECIPES.items():
        needs = f" (add `{' '.join(extra)}`)" if extra else ""
        rows.append(f"| `recipes/{name}.json` | `{script}`{needs} | {reached} | `{recipe_flags(name)}` |")
    return "\n".join(rows)


def test_every_recipe_file_is_listed():
    assert sorted(p.stem for p in (REPO / "recipes").glob("*.json")) == sorted(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_a_valid_config_of_its_script(name):
    script, world, extra, _ = RECIPES[name]
    cls = CONFIGS[script]
    cfg = parse_config(cls, ["--config", str(REPO / "recipes" / f"{name}.json"), *extra])
    gpus = min(world, 8) if world > 1 else 0  # a recipe for several ranks is meant for GPUs (--sync-bn needs them)
    cfg.validate(LaunchEnv("torchrun" if world > 1 else "single", 0, 0, world, min(world, 8)), cuda_devices=gpus)
    values = {k: v for k, v in json.loads((REPO / "recipes" / f"{name}.json").read_text()).items()
              if not k.startswith("_")}
    assert {k: getattr(cfg, k) for k in values} == values  # every value arrived as written


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, jpeg_folder, trained_moco) -> dict[str, list[str]]:
    """Per recipe, the flags that point it at a stand-in of its data: a CIFAR-10 folder in
    torchvision's format (520 training images, one batch of 512), the ImageNet-like JPEG folder
    (39 training images, a batch of 32) and one of 128 (a batch of 128), the MoCo quick start's
    run folder for the digits probe."""
    from fake_cifar import write_fake_cifar10

    from bench.imagenet_like import write_imagenet_like

    root = tmp_path_factory.mktemp("stand_ins")
    write_fake_cifar10(root / "cifar", train_per_class=52)
    # torchvision's recipes' batches are 128 images a rank: one batch needs that many
    write_imagenet_like(root / "imagenet_128", classes=2, train_per_class=64, val_per_class=2, oddities=False)
    cifar, imagenet = ["--data-dir", str(root / "cifar")], ["--data-dir", str(jpeg_folder)]
    return {"moco_cifar10_demo": cifar, "moco_cifar10_demo_symmetric": cifar, "moco_v1_imagenet": imagenet,
            "moco_v2_imagenet": imagenet, "linear_probe_imagenet": imagenet,
            "resnet50_imagenet_torchvision_v2": ["--data-dir", str(root / "imagenet_128")],
            "probe_digits": ["--pretrained", str(trained_moco / "run")]}


@pytest.fixture(scope="module")
def resnet50_moco_run(tmp_path_factory) -> Path:
    """A ResNet-50 MoCo run folder (one step at 32 px) for the ImageNet probe's --pretrained."""
    out = tmp_path_factory.mktemp("mocov2_in1k") / "run"
    assert train_moco.main(["--device", "cpu", "--arch", "resnet50", "--image-size", "32", "--batch-size", "8",
                            "--moco-k", "16", "--max-steps", "1", "--knn-every", "0", "--out", str(out)]) == 0
    return out


# The ImageNet probe needs a ResNet-50 run folder: a 336 MB checkpoint to write, so the slow tier.
# torchvision's commands' files are checked on a stand-in of their batches in tests/test_torchvision_commands.py.
CHECKED = [pytest.param(name, marks=pytest.mark.slow) if name == "linear_probe_imagenet" else name
           for name in sorted(RECIPES) if not name.startswith("torchvision_")]


@pytest.mark.parametrize("name", CHECKED)
def test_every_recipe_passes_check_on_a_stand_in_of_its_data(name, stand_ins, request, tmp_path, capsys,
                                                             monkeypatch):
    """What the launchers run before any worker starts: each recipe's --check, as written, on a
    stand-in of its data (CIFAR-10's md5 check bypassed: the stand-in is not the real data)."""
    from torchvision.datasets import CIFAR10

    monkeypatch.setattr(CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": None})
    script = {"train_classifier.py": train_classifier, "train_moco.py": train_moco}[RECIPES[name][0]]
    extra = stand_ins.get(name, [])
    if name == "linear_probe_imagenet":
        extra = extra + ["--pretrained", str(request.getfixturevalue("resnet50_moco_run"))]
    args = ["--config", str(REPO / "recipes" / f"{name}.json"), *extra, "--check", "--out", str(tmp_path / "run")]
    capsys.readouterr()  # what a fixture's run printed
    proc = in_process(script.main, args, capsys)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{RECIPES[name][0]} --check: ok, nothing written; the run:")
    assert not (tmp_path / "run").exists()
    if name == "resnet50_imagenet_torchvision_v2":  # what the run would do, said before it starts
        assert "training view: random resized crop 176 px, flip, --auto-augment ta_wide, random erasing p 0.1; " \
               "evaluation view: resize 232 px, centre crop 224 px" in proc.stdout
        assert "model: resnet50; sgd, weight decay 2e-05 (norm layers 0), linear warm-up over 5 epoch(s) from x0.01, " \
               "label smoothing 0.1, MixUp 0.2 or CutMix 1 per micro-batch, each sample 4 times an epoch, EMA of the " \
               "weights every 32 step(s) (--model-ema-decay 0.99998)" in proc.stdout


def test_readme_lists_what_each_recipe_sets():
    assert recipe_table() in (REPO / "README.md").read_text()


def test_the_demo_recipes_are_the_demos_code():
    """The values read in the MoCo authors' CIFAR-10 demo (facebookresearch/moco, branch
    colab-notebook, colab/moco_cifar10_demo.ipynb): its argparse defaults, the cell that sets
    epochs/cos/symmetric, train_transform, test(): kNN on the encoder's output."""
    demo = dict(arch="resnet18", lr=0.06, epochs=200, batch_size=512, weight_decay=5e-4, moco_dim=128,
                moco_k=4096, moco_m=0.99, moco_t=0.1, bn_splits=8, knn_k=200, knn_t=0.1, momentum=0.9,
                crop_min=0.08, lr_schedule="cosine-epoch", mlp=False, aug="v2-noblur", knn_features="head",
                normalization="cifar10-demo", warmup_steps=0)
    for name, symmetric in (("moco_cifar10_demo", False), ("moco_cifar10_demo_symmetric", True)):
        cfg = parse_config(train_moco.MocoConfig, ["--config", str(REPO / "recipes" / f"{name}.json")])
        assert {k: getattr(cfg, k) for k in demo} == demo and cfg.symmetric is symmetric


def test_the_resnet50_recipes_are_torchvisions_commands():
    """The values of torchvision's newer ResNet-50 command (its 2021 recipe, 8 GPUs), each under
    this script's name; its evaluation resize 232 (its weights' published accuracy). The README's
    commands, the classic ResNet-50's included: tests/test_torchvision_commands.py."""
    new = dict(arch="resnet50", batch_size=128, lr=0.5, momentum=0.9, lr_schedule="cosineannealinglr",
               lr_warmup_epochs=5, lr_warmup_method="linear", lr_warmup_decay=0.01, warmup_steps=0,
               auto_augment="ta_wide", epochs=600, random_erase=0.1, weight_decay=2e-5, norm_weight_decay=0.0,
               bias_weight_decay=-1.0, label_smoothing=0.1, mixup_alpha=0.2, cutmix_alpha=1.0, train_crop_size=176,
               model_ema=True, model_ema_steps=32, model_ema_decay=0.99998, val_resize_size=232, image_size=224,
               ra_reps=4, optimizer="sgd", nesterov=False)
    for name, values in (("resnet50_imagenet_torchvision_v2", new),):
        cfg = parse_config(train_classifier.ClassifierConfig, ["--config", str(REPO / "recipes" / f"{name}.json")])
        assert {k: getattr(cfg, k) for k in values} == values, name
        assert (cfg.amp, cfg.dataset) == ("none", "imagefolder")  # torchvision's runs: fp32


@pytest.mark.parametrize("world, accum", [(8, 1), (4, 2), (2, 4), (1, 8)])
def test_the_v2_recipe_keeps_its_global_batch_on_fewer_gpus_with_accum_steps(world, accum, tmp_path, capsys):
    """Its _launch note: --accum-steps 8 / GPUs gives the 8-GPU global batch of 1024, so the same
    LR and the same EMA decay per update."""
    from ddp_utils.train.ema import ema_decay

    cfg = parse_config(train_classifier.ClassifierConfig,
                       ["--config", str(REPO / "recipes/resnet50_imagenet_torchvision_v2.json"),
                        "--accum-steps", str(accum)])
    cfg.validate(LaunchEnv("torchrun", 0, 0, world, world), cuda_devices=0)
    assert world * accum * cfg.batch_size == 1024
    assert ema_decay(cfg.model_ema_decay, world * accum * cfg.batch_size, cfg.model_ema_steps, cfg.epochs) == \
        ema_decay(0.99998, 8 * 128, 32, 600)
    note = json.loads((REPO / "recipes/resnet50_imagenet_torchvision_v2.json").read_text())["_launch"]
    assert world == 8 or f"on {world} GPU{'s' if world > 1 else ''} add --accum-steps {accum}" in note


def test_the_digits_probe_takes_its_image_size_from_the_pretraining_run(trained_moco, tmp_path, capsys):
    """recipes/probe_digits.json on a MoCo run folder (16 px) probes at 16 px: --check says so."""
    proc = in_process(train_classifier.main, ["--config", str(REPO / "recipes/probe_digits.json"), "--pretrained",
                                              str(trained_moco / "run"), "--out", str(tmp_path / "p"), "--check"],
                      capsys)
    assert proc.returncode == 0 and "validation images; 16 px, " in proc.stdout and "warning" not in proc.stdout
    assert f"model: small_cnn, linear probe, from {trained_moco / 'run'}" in proc.stdout


def test_command_line_overrides_the_file_and_the_file_overrides_the_preset(tmp_path):
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"preset": "v1", "moco_t": 0.5, "resume": "auto", "_note": "ignored"}))
    cfg = parse_config(train_moco.MocoConfig, ["--config", str(recipe), "--batch-size", "48"])
    assert (cfg.preset, cfg.lr_schedule, cfg.mlp) == ("v1", "step", False)  # the file's preset
    assert cfg.moco_t == 0.5 and cfg.batch_size == 48 and cfg.resume == ""  # never resumes from a file
    cfg = parse_config(train_moco.MocoConfig, ["--config", str(recipe), "--moco-t", "0.3", "--preset", "v2"])
    assert (cfg.preset, cfg.lr_schedule, cfg.moco_t) == ("v2", "cosine", 0.3)


@pytest.mark.parametrize("content, says", [
    ('{"batchsize": 3}', "unknown key 'batchsize': not a flag of this script; did you mean --batch-size?"),
    ('{"aug": "v9"}', "'aug' is 'v9'; choose one of v1, v2, v2-noblur"),
    ('{"epochs": "3"}', "'epochs' must be int, got '3'"),
    ('{"epochs": 3', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"preset": "v7"}', "'preset' is 'v7'; choose one of v1, v2"),
])
def test_a_bad_config_file_is_one_line_naming_the_problem(tmp_path, content, says):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(UsageError, match=None) as err:
        parse_config(train_moco.MocoConfig, ["--config", str(bad)])
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_runs_config_json_repeats_the_run_exactly(tmp_path):
    """--config RUN/config.json --out OTHER: the same flags, so the same weights, queue and all."""
    first = tmp_path / "first"
    args = ["--device", "cpu", "--image-size", "16", "--batch-size", "16", "--moco-k", "64", "--max-steps", "4",
            "--knn-every", "0", "--moco-m", "0.9", "--accum-steps", "2", "--out", str(first)]
    assert train_moco.main(args) == 0
    again = tmp_path / "again"
    assert train_moco.main(["--config", str(first / "config.json"), "--out", str(again)]) == 0
    a, b = load_ckpt(first / "checkpoint_last.pt"), load_ckpt(again / "checkpoint_last.pt")
    assert a["step"] == b["step"] == 4
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert json.loads((again / "config.json").read_text())["config"] == \
        {**json.loads((first / "config.json").read_text())["config"], "out": str(again)}
