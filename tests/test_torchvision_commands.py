"""torchvision's published classification commands (recipes/torchvision-commands.md, written from its
references/classification/README.md) run as typed with `train.py` replaced by `train_classifier.py`:
each parses to the values torchvision's train.py gives them (read here from the command and train.py's
defaults, independently of the project's parser), and each one's --check on a stand-in ImageFolder
exits 0 describing that run."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torchvision
from helpers import REPO, Published, in_process, published_commands

import train_classifier
from ddp_utils.config import config_dict, flag_name, parse_config

# references/classification/train.py's defaults (pytorch/vision 428a54c), by its own flag names
REFERENCE_DEFAULTS = {
    "model": "resnet18", "batch-size": 32, "epochs": 90, "opt": "sgd", "lr": 0.1, "momentum": 0.9, "wd": 1e-4,
    "lr-scheduler": "steplr", "lr-warmup-epochs": 0, "lr-warmup-method": "constant", "lr-warmup-decay": 0.01,
    "lr-step-size": 30, "lr-gamma": 0.1, "lr-min": 0.0, "label-smoothing": 0.0, "mixup-alpha": 0.0,
    "cutmix-alpha": 0.0, "auto-augment": None, "random-erase": 0.0, "clip-grad-norm": None, "ra-reps": 3,
    "val-resize-size": 256, "val-crop-size": 224, "train-crop-size": 224, "interpolation": "bilinear",
    "model-ema-steps": 32, "model-ema-decay": 0.99998, "norm-weight-decay": None, "bias-weight-decay": None,
    "transformer-embedding-decay": None, "policy-magnitude": 9, "weights": None,
}
FLOATS = {"clip-grad-norm", "norm-weight-decay", "bias-weight-decay", "transformer-embedding-decay"}  # default None
SWITCHES = {"amp", "model-ema", "ra-sampler", "sync-bn", "test-only"}
SAME_FLAG = {"weight-decay": "wd"}


def reference_reading(argv: tuple[str, ...]) -> dict:
    """What torchvision's train.py makes of ``argv``: its defaults, overridden by the flags given."""
    args, tokens = dict(REFERENCE_DEFAULTS), list(argv)
    while tokens:
        flag = tokens.pop(0)
        assert flag.startswith("--"), flag
        name, _, value = flag[2:].partition("=")
        name = SAME_FLAG.get(name, name)
        if name in SWITCHES:
            args[name] = True
            continue
        value = value or tokens.pop(0)
        default = REFERENCE_DEFAULTS[name]
        args[name] = float(value) if name in FLOATS else type(default)(value) if default is not None else value
    return args


COMMANDS = published_commands()
TRAINING = [c for c in COMMANDS if "--test-only" not in c.argv]


def test_the_table_holds_the_readmes_commands_and_torchvisions_accuracies():
    """53 training commands (the 4 VGG with BatchNorm on the defaults, as the README's text says)
    and 9 evaluations; each accuracy is the one torchvision publishes with weights of that model
    (the installed torchvision's own record)."""
    assert len(COMMANDS) == 62 and len(TRAINING) == 53
    for command in COMMANDS:
        published = {w.meta["_metrics"]["ImageNet-1K"]["acc@1"]
                     for w in torchvision.models.get_model_weights(command.model)}
        assert command.acc1 in published, (command.name, published)
    covered = {c.model for c in COMMANDS}
    assert covered <= set(torchvision.models.list_models(module=torchvision.models))


def expected_config(args: dict) -> dict:
    """The project's config values that mean what ``args`` (torchvision's reading) says."""
    unset = train_classifier.UNSET
    return dict(
        dataset="imagefolder", arch=args["model"], batch_size=args["batch-size"], epochs=args["epochs"],
        optimizer=args["opt"], lr=args["lr"], momentum=args["momentum"], weight_decay=args["wd"],
        lr_schedule=args["lr-scheduler"], lr_warmup_epochs=args["lr-warmup-epochs"],
        lr_warmup_method=args["lr-warmup-method"] if args["lr-warmup-epochs"] else "linear",
        lr_warmup_decay=args["lr-warmup-decay"], lr_step_size=args["lr-step-size"], lr_gamma=args["lr-gamma"],
        lr_min=args["lr-min"], label_smoothing=args["label-smoothing"], mixup_alpha=args["mixup-alpha"],
        cutmix_alpha=args["cutmix-alpha"], auto_augment=args["auto-augment"] or "",
        random_erase=args["random-erase"], clip_grad=args["clip-grad-norm"] or 0.0,
        ra_reps=args["ra-reps"] if args.get("ra-sampler") else 1, val_resize_size=args["val-resize-size"],
        image_size=args["val-crop-size"], train_crop_size=args["train-crop-size"],
        interpolation=args["interpolation"], model_ema=bool(args.get("model-ema")),
        model_ema_steps=args["model-ema-steps"], model_ema_decay=args["model-ema-decay"],
        norm_weight_decay=unset if args["norm-weight-decay"] is None else args["norm-weight-decay"],
        bias_weight_decay=unset if args["bias-weight-decay"] is None else args["bias-weight-decay"],
        transformer_embedding_decay=(unset if args["transformer-embedding-decay"] is None
                                     else args["transformer-embedding-decay"]),
        sync_bn=bool(args.get("sync-bn")), amp="torchvision" if args.get("amp") else "none",
        ra_magnitude=args["policy-magnitude"], lr_ranks=8)


@pytest.mark.parametrize("command", TRAINING, ids=[c.name for c in TRAINING])
def test_each_command_means_what_it_means_to_torchvision(command, tmp_path):
    """Every value torchvision's train.py reads from the command (or its defaults), the project's
    config holds with the same meaning (its LR for 8 GPUs: --lr-ranks 8)."""
    cfg = parse_config(train_classifier.ClassifierConfig, [*command.argv, "--data-path", str(tmp_path)])
    expected = expected_config(reference_reading(command.argv))
    got = {name: getattr(cfg, name) for name in expected}
    assert got == expected
    assert cfg.data_dir == str(tmp_path)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    """An ImageFolder with room for the largest published batch (512 a rank): 3 classes, 174
    training files each (links to one digit image), 2 validation files each."""
    from helpers import write_image_folder

    seed = tmp_path_factory.mktemp("seed")
    write_image_folder(seed, per_class=1)
    root = tmp_path_factory.mktemp("stand_in")
    for split, count in (("train", 174), ("val", 2)):
        for cls in range(3):
            source = next((seed / "train" / f"class{cls}").iterdir())
            folder = root / split / f"class{cls}"
            folder.mkdir(parents=True)
            for i in range(count):
                (folder / f"{i}.png").hardlink_to(source)
    return root


def check_output(command: Published, stand_in: Path, out: Path, capsys) -> str:
    proc = in_process(train_classifier.main, [*command.argv, "--data-path", str(stand_in), "--out", str(out),
                                              "--check"], capsys)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def assert_describes(text: str, command: Published, ranks: int = 8) -> None:
    """--check's lines name every value of the run torchvision would start (its LR for ``ranks``
    GPUs)."""
    args = reference_reading(command.argv)
    lr_per_gpu = args["batch-size"]
    expected = [f"model: {args['model']}", f"network: {args['model']} for 3 classes",
                f"global batch {lr_per_gpu} = 1 rank x 1 micro-step x {lr_per_gpu}; lr {args['lr']:g}, "
                f"{args['lr-scheduler']}", f"{args['opt']}", f"weight decay {args['wd']:g}",
                f"in {args['epochs']} epochs",
                f"published for a global batch of {ranks * lr_per_gpu:,} ({ranks} ranks x {lr_per_gpu})",
                f"give --accum-steps {ranks}",
                f"random resized crop {args['train-crop-size']} px",
                f"resize {args['val-resize-size']} px, centre crop {args['val-crop-size']} px",
                "defaults: torchvision's train.py's"]
    if args["lr-scheduler"] == "steplr":
        expected.append(f"steplr (x{args['lr-gamma']:g} every {args['lr-step-size']} epochs)")
    if args["lr-min"]:
        expected.append(f"cosineannealinglr (down to {args['lr-min']:g})")
    if args["lr-warmup-epochs"]:
        expected.append(f"{args['lr-warmup-method']} warm-up over {args['lr-warmup-epochs']} epoch(s) from "
                        f"x{args['lr-warmup-decay']:g}")
    if args["label-smoothing"]:
        expected.append(f"label smoothing {args['label-smoothing']:g}")
    for name, flag in (("MixUp", "mixup-alpha"), ("CutMix", "cutmix-alpha")):
        if args[flag]:
            expected.append(f"{name} {args[flag]:g}")
    if args.get("model-ema"):
        expected.append(f"EMA of the weights every {args['model-ema-steps']} step(s)")
    if args["clip-grad-norm"]:
        expected.append(f"gradient norm clipped to {args['clip-grad-norm']:g}")
    if args.get("ra-sampler"):
        expected.append(f"each sample {args['ra-reps']} times an epoch")
    if args["auto-augment"]:
        expected.append(f"--auto-augment {args['auto-augment']}")
    if args["random-erase"]:
        expected.append(f"random erasing p {args['random-erase']:g}")
    if args.get("amp"):
        expected.append("precision fp32 (bare --amp, torchvision's: fp16 with a GradScaler on CUDA)")
    if args.get("sync-bn"):
        expected.append("SyncBatchNorm across the ranks on CUDA")
    missing = [part for part in expected if part not in text]
    assert not missing, (missing, text)


def one_per_section() -> list[Published]:
    seen, chosen = set(), []
    for command in TRAINING:
        if command.section not in seen:
            seen.add(command.section)
            chosen.append(command)
    return chosen


FAST = [c for c in one_per_section() if c.section in ("vit_b_16", "swintransformer", "mobilenetv3-large--small")]


@pytest.mark.parametrize("command", FAST, ids=[c.name for c in FAST])
def test_a_published_command_checks_on_a_cpu_and_describes_its_run(command, stand_in, tmp_path, capsys):
    assert_describes(check_output(command, stand_in, tmp_path / "run", capsys), command)


@pytest.mark.slow
def test_every_published_training_command_checks_on_a_cpu_and_describes_its_run(stand_in, tmp_path, capsys):
    """All 53, in one process (each builds its network's shapes once)."""
    for i, command in enumerate(TRAINING):
        assert_describes(check_output(command, stand_in, tmp_path / f"run{i}", capsys), command)


def test_the_maxvit_commands_magnitude_is_accepted_and_said_to_do_nothing(stand_in, tmp_path, capsys):
    command = next(c for c in TRAINING if c.section == "maxvit")
    text = check_output(command, stand_in, tmp_path / "run", capsys)
    assert "warning: --ra-magnitude/--policy-magnitude 15 does nothing with --auto-augment ta_wide" in text
    assert not math.isnan(command.acc1)


EVALUATIONS = [c for c in COMMANDS if "--test-only" in c.argv]


@pytest.mark.parametrize("command", [pytest.param(c, marks=() if c.model == "inception_v3" else pytest.mark.slow)
                                     for c in EVALUATIONS], ids=[c.name for c in EVALUATIONS])
def test_each_published_evaluation_takes_its_weights_own_view(command, tmp_path):
    """--test-only --weights NAME: the weights' own evaluation view (crop, resize, interpolation),
    as torchvision's script takes it from weights.transforms()."""
    from ddp_utils.train.train_config import parse_args

    cfg = parse_args(train_classifier.ClassifierConfig, [*command.argv, "--data-path", str(tmp_path)],
                     train_classifier.__doc__)
    views = train_classifier.views_of(cfg)
    view = torchvision.models.get_weight(reference_reading(command.argv)["weights"]).transforms()
    assert cfg.test_only and cfg.arch == command.model
    assert (views.image_size, views.val_resize_size, views.interpolation) == \
        (view.crop_size[0], view.resize_size[0], view.interpolation.value)


# ----------------------------------------------------------------------------- the recipe files
def recipe_rows() -> dict[str, list[Published]]:
    """The table's rows by the recipe file written from them (its models, in the table's order)."""
    rows: dict[str, list[Published]] = {}
    for command in TRAINING:
        if command.recipe:
            rows.setdefault(command.recipe, []).append(command)
    return rows


def recipe_of(rows: list[Published]) -> dict:
    """recipes/NAME.json for one row of the table: its first model's command as this script reads
    it (``--data-path`` bringing train.py's defaults), the values other than the script's own
    defaults, the GPUs its LR is for (``lr_ranks``), a run folder; notes on the source, the launch
    and the other models."""
    def values(command: Published) -> dict:  # those torchvision's defaults set too: the file reads the same with --data-path
        cfg = parse_config(train_classifier.ClassifierConfig, [*command.argv, "--data-path", "/data/imagenet"])
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        return {k: v for k, v in config_dict(cfg).items()
                if v != defaults[k] or k in train_classifier.TORCHVISION_DEFAULTS}

    first, *others = rows
    own = {**values(first), "lr_ranks": first.gpus, "out": f"runs/{first.recipe}"}
    batch, lr = own.get("batch_size", 64), own.get("lr", 0.1)
    differ = [" ".join([f"--model {c.model}"] + [f"{flag_name(k)} {v}" for k, v in values(c).items()
                                                  if own.get(k) != v and k != "arch"]) for c in others]
    return {
        "_source": f"torchvision's published command (references/classification/README.md at 428a54c, "
                   f"#{first.section}; recipes/torchvision-commands.md); Acc@1 of torchvision's weights: "
                   + "; ".join(f"{c.model} {c.acc1:g}" for c in rows),
        "_launch": f"{first.gpus} GPUs x {batch} = global batch {first.gpus * batch}, the batch its LR {lr:g} is for; "
                   f"on fewer GPUs add --accum-steps (its GPUs / yours), as --check and the start say (--lr-ranks)",
        **({"_models": "the row's other models: " + "; ".join(differ)} if others else {}),
        **own}


def test_each_torchvision_recipe_file_is_its_row_of_the_table():
    """recipes/torchvision_*.json are written from the table (``python tests/test_torchvision_commands.py``):
    a file and its published command cannot drift."""
    rows = recipe_rows()
    assert sorted(p.stem for p in (REPO / "recipes").glob("torchvision_*.json")) == sorted(rows)
    for name, commands in rows.items():
        assert json.loads((REPO / "recipes" / f"{name}.json").read_text()) == recipe_of(commands), name


@pytest.mark.slow
def test_every_torchvision_recipe_file_checks_on_a_stand_in(stand_in, tmp_path, capsys):
    """Each file as a --config on this project's own data flags: --check exits 0 and describes its
    first command's run (the same lines as the command itself, but the defaults line)."""
    for name, (first, *_) in recipe_rows().items():
        proc = in_process(train_classifier.main, ["--config", str(REPO / "recipes" / f"{name}.json"), "--data-dir",
                                                  str(stand_in), "--out", str(tmp_path / name), "--check"], capsys)
        assert proc.returncode == 0, (name, proc.stderr)
        assert_describes(proc.stdout + "defaults: torchvision's train.py's", first, ranks=first.gpus)


if __name__ == "__main__":  # PYTHONPATH=. python tests/test_torchvision_commands.py: rewrite the recipe files
    for name, commands in recipe_rows().items():
        (REPO / "recipes" / f"{name}.json").write_text(json.dumps(recipe_of(commands), indent=2) + "\n")
