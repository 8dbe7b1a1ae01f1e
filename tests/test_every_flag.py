"""Every flag of both scripts does something: a value other than the base run's changes the
trained weights, the run folder's files, the kNN accuracy or the log, or is refused with one line.
The few whose effect needs CUDA, a hanging peer or an earlier run name the test that shows it."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from helpers import REPO, in_process, load_ckpt, read_scalars

import train_classifier
import train_moco

COMMON = ["--device", "cpu", "--dataset", "digits", "--image-size", "16", "--batch-size", "32", "--epochs", "2",
          "--max-steps", "2", "--log-every", "20"]
BASE = {"classifier": COMMON + ["--arch", "lenet"],
        "moco": COMMON + ["--arch", "small_cnn", "--moco-k", "64", "--knn-every", "0", "--bn-splits", "4",
                          "--lr", "0.03", "--moco-m", "0.999"]}  # not digits' own LR and momentum: see KNN runs
MAIN = {"classifier": train_classifier.main, "moco": train_moco.main}
CONFIG = {"classifier": train_classifier.ClassifierConfig, "moco": train_moco.MocoConfig}
KNN = ["--knn-every", "1"]  # the base run's monitor is off
SHORT_EPOCHS = ["--debug", "--max-steps", "0"]  # 256 training images: 8 steps per epoch

# flag: (arguments that change it, what they change[, arguments both runs get]): "weights" of the
# final checkpoint, the run folder's "files", the "knn" accuracies, the "log" (times left out), or
# "refused" (exit 2, one line); "elsewhere: TEST" names the test where the effect is shown.
SHARED = {
    "dataset": (["--dataset", "synthetic"], "weights"),
    "data_dir": (["--data-dir", "/tmp"], "refused"),
    "download": (["--download"], "refused"),
    "image_size": (["--image-size", "24"], "weights"),
    "synthetic_samples": (["--synthetic-samples", "128"], "refused"),
    "augment": (["--no-augment"], "weights"),
    "normalization": (["--normalization", "cifar10-demo"], "refused"),
    "aug_on": (["--aug-on", "loader"], "weights"),
    "decode_on": (["--decode-on", "device"], "refused"),  # digits; on image files: tests/test_jpeg_path.py
    "order": (["--order", "shards"], "refused"),  # digits; on shards: tests/test_shards.py, tests/test_object_store.py
    # digits; from a bucket: tests/test_object_store.py
    "shard_cache_dir": (["--shard-cache-dir", "/tmp"], "refused"),
    "shard_cache_gb": (["--shard-cache-gb", "1"], "refused"),
    "shard_read_ahead": (["--shard-read-ahead", "1"], "refused"),
    "shard_downloads": (["--shard-downloads", "1"], "refused"),
    "store_timeout": (["--store-timeout", "60"], "refused"),
    "store_if_match": (["--no-store-if-match"], "refused"),
    "keep_shard_cache": (["--keep-shard-cache"], "refused"),
    "workers": (["--workers", "1"], "log", ["--aug-on", "loader"]),  # the same batches, by design
    "arch": (["--arch", "small_cnn"], "weights"),
    "batch_size": (["--batch-size", "16"], "weights"),
    "accum_steps": (["--accum-steps", "2"], "weights"),
    "epochs": (["--epochs", "3"], "weights"),
    "max_steps": (["--max-steps", "1"], "weights"),
    "lr": (["--lr", "0.2"], "weights"),
    "momentum": (["--momentum", "0.5"], "weights"),
    "weight_decay": (["--weight-decay", "0.01"], "weights"),
    "lr_schedule": (["--lr-schedule", "constant"], "weights"),
    "lr_milestones": (["--lr-milestones", "1"], "weights", SHORT_EPOCHS + ["--lr-schedule", "step", "--lr-milestones", "2"]),
    "warmup_steps": (["--warmup-steps", "5"], "weights"),
    "lr_warmup_epochs": (["--lr-warmup-epochs", "1"], "weights", ["--lr-schedule", "cosineannealinglr"]),
    # linear and constant differ from the warm-up's second epoch on
    "lr_warmup_method": (["--lr-warmup-method", "constant"], "weights",
                         SHORT_EPOCHS + ["--epochs", "3", "--lr-schedule", "cosineannealinglr", "--lr-warmup-epochs", "2"]),
    "lr_warmup_decay": (["--lr-warmup-decay", "0.5"], "weights",
                        ["--lr-schedule", "cosineannealinglr", "--lr-warmup-epochs", "1"]),
    "lr_step_size": (["--lr-step-size", "1"], "weights", SHORT_EPOCHS + ["--lr-schedule", "steplr"]),
    "lr_gamma": (["--lr-gamma", "0.5"], "weights", SHORT_EPOCHS + ["--lr-schedule", "exponentiallr"]),
    "lr_min": (["--lr-min", "0.01"], "weights", SHORT_EPOCHS + ["--lr-schedule", "cosineannealinglr"]),
    "lr_ranks": (["--lr-ranks", "8"], "log"),  # the start-up line on the LR's published global batch
    "clip_grad": (["--clip-grad", "0.01"], "weights"),
    "amp": (["--amp", "bf16"], "weights"),
    "tf32": (["--no-tf32"], "elsewhere: tests/test_training.py::test_backend_switches_for_cuda_and_their_restore"),
    "deterministic": (["--deterministic"],
                      "elsewhere: tests/test_training.py::test_backend_switches_for_cuda_and_their_restore"),
    "compile": (["--compile"], "elsewhere: tests/test_compile.py::test_compiled_moco_with_split_bn_matches_eager"),
    "seed": (["--seed", "1"], "weights"),
    "device": (["--device", "cuda"], "refused"),
    "dist_timeout": (["--dist-timeout", "5"],
                     "elsewhere: tests/test_launch_env.py::test_dead_peer_ends_the_job_instead_of_hanging"),
    "out": (["--out", "{tmp}/elsewhere"], "files"),
    "resume": (["--resume", "auto"], "elsewhere: tests/test_training.py::test_resume_mid_epoch_ends_exactly_as_the_uninterrupted_run"),
    "overwrite": (["--overwrite"], "elsewhere: tests/test_run_safety.py::test_overwrite_starts_over_and_never_mixes_two_runs"),
    "allow_changes": (["--allow-changes"], "refused"),  # without --resume; with it: tests/test_user_path.py
    "check": (["--check"], "files"),
    "check_data": (["--check-data"], "refused"),  # digits; on image files: tests/test_image_files.py
    "ckpt_every": (["--ckpt-every", "1"], "files"),
    "keep_checkpoints": (["--keep-checkpoints", "1"], "files", ["--ckpt-every", "1"]),
    "skip_nonfinite": (["--skip-nonfinite", "1"],
                       "elsewhere: tests/test_run_safety.py::test_a_nan_loss_on_one_rank_stops_or_is_skipped_on_every_rank"),
    "log_every": (["--log-every", "1"], "log"),
    "debug": (["--debug"], "weights"),
}
ONLY = {
    "classifier": {
        "pretrained": (["--pretrained", "{moco_run}"], "weights", ["--arch", "small_cnn"]),
        "weights": (["--weights", "{classifier_run}"], "weights"),
        "test_only": (["--test-only"], "elsewhere: tests/test_weights.py::test_test_only_on_a_checkpoint_scores_what_its_run_scored"),
        "linear_probe": (["--linear-probe"], "weights"),
        "probe_bn": (["--probe-bn"], "weights", ["--linear-probe"]),
        "label_smoothing": (["--label-smoothing", "0.1"], "weights"),
        "optimizer": (["--optimizer", "adamw"], "weights"),
        "nesterov": (["--nesterov"], "weights"),
        "norm_weight_decay": (["--norm-weight-decay", "0"], "weights", ["--arch", "small_cnn"]),  # lenet has no norm
        "bias_weight_decay": (["--bias-weight-decay", "0"], "weights"),
        "transformer_embedding_decay": (["--transformer-embedding-decay", "0"], "elsewhere: tests/test_model_zoo.py::"
                                        "test_the_embedding_decay_groups_are_torchvisions"),
        "sync_bn": (["--sync-bn"], "elsewhere: tests/test_model_zoo.py::test_sync_bn_converts_on_cuda_ranks_only"),
        "interpolation": (["--interpolation", "bicubic"], "refused"),  # digits; on image files: test_torchvision_commands.py
        # the EMA's weights count as weights: the checkpoint's model_ema beside its model
        "model_ema": (["--model-ema"], "weights"),
        "model_ema_steps": (["--model-ema-steps", "1"], "weights", ["--model-ema"]),
        "model_ema_decay": (["--model-ema-decay", "0.9"], "weights", ["--model-ema", "--model-ema-steps", "1"]),
        "mixup_alpha": (["--mixup-alpha", "0.2"], "weights"),
        "cutmix_alpha": (["--cutmix-alpha", "1.0"], "weights"),
        "ra_reps": (["--ra-reps", "2"], "weights"),
        # digits are float tensors; on 8-bit images: tests/test_augment_recipe.py
        "auto_augment": (["--auto-augment", "ta_wide"], "refused"),
        "ra_magnitude": (["--ra-magnitude", "5"], "refused"),  # without --auto-augment ra
        "augmix_severity": (["--augmix-severity", "5"], "refused"),  # without --auto-augment augmix
        "random_erase": (["--random-erase", "0.5"], "weights", ["--aug-on", "loader"]),
        # digits; on image files: tests/test_augment_recipe.py
        "train_crop_size": (["--train-crop-size", "24"], "refused"),
        "val_resize_size": (["--val-resize-size", "24"], "refused"),
    },
    "moco": {
        "preset": (["--preset", "v1"], "weights"),
        "arch": (["--arch", "lenet"], "weights"),
        "augment": (["--no-augment"], "refused"),
        "moco_dim": (["--moco-dim", "32"], "weights"),
        "moco_k": (["--moco-k", "96"], "weights"),
        "moco_m": (["--moco-m", "0.5"], "weights"),
        "moco_m_cos": (["--moco-m-cos"], "weights", ["--moco-m", "0.5"]),
        "moco_t": (["--moco-t", "0.5"], "weights"),
        "symmetric": (["--symmetric"], "weights"),
        "mlp": (["--no-mlp"], "weights"),
        "aug": (["--aug", "v1"], "weights"),
        "crop_min": (["--crop-min", "0.9"], "weights"),
        "shuffle_bn": (["--no-shuffle-bn"], "weights"),
        "bn_splits": (["--bn-splits", "2"], "weights"),
        "sync_bn": (["--sync-bn"], "weights"),
        "knn_k": (["--knn-k", "1"], "knn", KNN),
        "knn_t": (["--knn-t", "5"], "knn", KNN),
        "knn_features": (["--knn-features", "head"], "knn", KNN),
        "knn_every": (["--knn-every", "1"], "log"),
        "knn_bank_samples": (["--knn-bank-samples", "50"], "knn", KNN),
        "export_backbone": (["--export-backbone", "{tmp}/backbone.pt"], "files"),
    },
}
CASES = [(script, name, *(ONLY[script].get(name) or SHARED[name]), [])[:5]
         for script in ("classifier", "moco") for name in (f.name for f in dataclasses.fields(CONFIG[script]))]
_TIMES = re.compile(r"^\d\d:\d\d:\d\d |\d+(\.\d+)? s\b|[\d,]+ img/s|eta \S+|sha256 \w+|/tmp/\S+")


# What a resume may do with each flag and each flag's --help section, declared with its field
# (opt(group=..., on_resume=...)): pinned here, so that a change to them is a change of this file.
FIXED = {"classifier": ("arch", "linear_probe", "probe_bn", "optimizer"), "moco": ("arch", "moco_dim", "moco_k", "mlp")}
FREE = ("epochs", "max_steps", "data_dir", "shard_cache_dir", "shard_cache_gb", "shard_read_ahead", "shard_downloads",
        "store_timeout", "store_if_match", "keep_shard_cache", "download", "aug_on", "decode_on", "workers", "amp", "tf32",
        "deterministic", "compile", "device", "dist_timeout", "ckpt_every", "keep_checkpoints", "skip_nonfinite",
        "log_every", "lr_ranks")
FREE_OF = {"classifier": FREE, "moco": FREE + ("knn_k", "knn_t", "knn_features", "knn_every", "knn_bank_samples",
                                               "export_backbone")}
INVOCATION = ("out", "resume", "overwrite", "allow_changes", "check", "check_data")
NOT_FROM_FILE = ("resume", "overwrite", "allow_changes", "check", "check_data")
SECTIONS = {
    "data": ["dataset", "data_dir", "order", "shard_cache_dir", "shard_cache_gb", "shard_read_ahead", "shard_downloads",
             "store_timeout", "store_if_match", "keep_shard_cache", "download", "image_size", "synthetic_samples", "augment",
             "normalization", "aug_on", "decode_on", "workers"],
    "model and optimisation": ["arch", "batch_size", "accum_steps", "lr_ranks", "epochs", "max_steps", "lr",
                               "momentum", "weight_decay", "lr_schedule", "lr_milestones", "lr_step_size", "lr_gamma",
                               "lr_min", "warmup_steps", "lr_warmup_epochs",
                               "lr_warmup_method", "lr_warmup_decay", "clip_grad", "seed"],
    "precision and speed": ["amp", "tf32", "deterministic", "compile"],
    "run folder and checkpoints": ["out", "resume", "overwrite", "allow_changes", "check", "check_data", "ckpt_every",
                                   "keep_checkpoints", "skip_nonfinite", "log_every", "debug"],
    "distributed": ["device", "dist_timeout"],
}
SECTIONS_OF = {
    "classifier": {**SECTIONS, "pretrained weights, evaluation": ["pretrained", "weights", "test_only", "linear_probe", "probe_bn"],
                   "torchvision's recipe: loss, optimizer, weight average": [
                       "label_smoothing", "optimizer", "nesterov", "norm_weight_decay", "bias_weight_decay",
                       "transformer_embedding_decay", "sync_bn", "model_ema", "model_ema_steps", "model_ema_decay"],
                   "torchvision's recipe: augmentation and image sizes": [
                       "mixup_alpha", "cutmix_alpha", "auto_augment", "ra_magnitude", "augmix_severity",
                       "random_erase", "ra_reps", "train_crop_size", "val_resize_size", "interpolation"]},
    "moco": {**SECTIONS, "MoCo": ["moco_dim", "moco_k", "moco_m", "moco_m_cos", "moco_t", "symmetric", "mlp", "aug",
                                  "crop_min", "shuffle_bn", "bn_splits", "sync_bn", "export_backbone"],
             "kNN monitor": ["knn_k", "knn_t", "knn_features", "knn_every", "knn_bank_samples"]},
}


@pytest.mark.parametrize("script", ["classifier", "moco"])
def test_each_fields_resume_rule_and_section_are_declared_with_it(script):
    from ddp_utils.config import fields_on_resume, flag_groups, not_from_file

    cls = CONFIG[script]
    assert fields_on_resume(cls, "fixed") == FIXED[script]
    assert set(fields_on_resume(cls, "free")) == set(FREE_OF[script])
    own = ("test_only",) if script == "classifier" else ()
    assert fields_on_resume(cls, "invocation") == INVOCATION + own and not_from_file(cls) == NOT_FROM_FILE + own
    assert flag_groups(cls) == SECTIONS_OF[script]
    ungrouped = [f.name for f in dataclasses.fields(cls) if f.metadata["group"] is None]
    assert ungrouped == (["preset"] if script == "moco" else [])  # listed first, with --config


def test_every_flag_has_an_entry():
    """A new flag must be added here with what it changes; an entry for a removed flag goes."""
    for script in CONFIG:
        fields = {f.name for f in dataclasses.fields(CONFIG[script])}
        assert set(ONLY[script]) <= fields and (fields - set(ONLY[script])) <= set(SHARED), script
    assert set(SHARED) <= {f.name for f in dataclasses.fields(train_classifier.ClassifierConfig)}


def _run(script: str, extra: list[str], root: Path, files: dict[str, Path], capsys) -> dict:
    out = root / "run"
    argv = [a.format(tmp=root, **{k: str(v) for k, v in files.items()}) for a in BASE[script] + extra]
    proc = in_process(MAIN[script], argv + ([] if "--out" in extra else ["--out", str(out)]), capsys)
    if "--out" in extra:
        out = Path(argv[argv.index("--out") + 1])
    state = load_ckpt(out / "checkpoint_last.pt") if (out / "checkpoint_last.pt").exists() else None
    return {"code": proc.returncode, "stderr": proc.stderr,
            "weights": {**state["model"], **{f"ema.{k}": v for k, v in state.get("model_ema", {}).items()}}
            if state else None,
            "files": sorted(str(p.relative_to(root)) for p in root.rglob("*") if "tb" not in p.parts),
            "log": [_TIMES.sub("", line) for line in proc.stdout.splitlines()],
            "knn": [v for _, v in read_scalars(out / "tb").get("knn/acc1", [])] if (out / "tb").exists() else []}


def _same_weights(a: dict | None, b: dict | None) -> bool:
    return a is not None and b is not None and a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def inputs(trained_moco, tmp_path_factory) -> dict[str, Path]:
    classifier_run = tmp_path_factory.mktemp("classifier") / "run"  # --weights: another run's last weights
    assert train_classifier.main(BASE["classifier"] + ["--seed", "3", "--out", str(classifier_run)]) == 0
    return {"moco_run": trained_moco / "run", "classifier_run": classifier_run}


@pytest.fixture(scope="module")
def base_runs(tmp_path_factory, inputs):
    """The base run of each (script, shared arguments), made once."""
    made: dict[tuple[str, ...], dict] = {}

    def base(script: str, context: list[str], capsys) -> dict:
        key = (script, *context)
        if key not in made:
            made[key] = _run(script, context, tmp_path_factory.mktemp("base"), inputs, capsys)
        return made[key]

    return base


@pytest.mark.slow  # 99 short runs: the whole sweep; test_every_flag_has_an_entry stays in the fast tier
@pytest.mark.parametrize("script, name, args, effect, context", CASES,
                         ids=[f"{s} --{n.replace('_', '-')}" for s, n, *_ in CASES])
def test_a_flag_changes_something_or_is_refused(script, name, args, effect, context, inputs, base_runs, tmp_path,
                                                capsys):
    if effect.startswith("elsewhere: "):
        path, test = effect.removeprefix("elsewhere: ").split("::")
        assert f"def {test}(" in (REPO / path).read_text()
        return
    if name == "device" and torch.cuda.is_available():
        pytest.skip("--device cuda is accepted on this machine")
    base = base_runs(script, context, capsys)
    changed = _run(script, context + args, tmp_path, inputs, capsys)
    assert base["code"] == 0, base["stderr"]
    if effect == "refused":
        assert changed["code"] == 2 and changed["stderr"].count("\n") == 1, changed["stderr"]
        return
    assert changed["code"] == 0, changed["stderr"]
    if effect == "weights":
        assert not _same_weights(base["weights"], changed["weights"])
    else:
        assert base[effect] != changed[effect], (effect, base[effect])
