"""The models by name: the classifier's, the small networks and every classification model
torchvision lists (``--arch``, spelled ``--model`` as torchvision's reference script spells it),
each able to take a training step; MoCo's, the small networks and torchvision's ResNet family
(``-a`` as main_moco.py spells it); the refusals of a name or a combination that cannot train."""
from __future__ import annotations

import json
import re

import pytest
import torch
import torchvision
from helpers import assert_ok, in_process, run_ranks

import train_classifier
import train_moco
from ddp_utils.config import build_parser, parse_config
from ddp_utils.models.backbones import build_model, input_refusal, model_names, shapes_only
from train_classifier import ClassifierConfig

DIGITS = ["--dataset", "digits", "--device", "cpu", "--batch-size", "8", "--epochs", "1"]

# One model of each torchvision family, at a small input it takes (px): the first five take their
# step in the fast tier (under a second each on 2 cores); every model, these included, in the
# slow tier's sweep (test_every_model_torchvision_lists_takes_a_training_step).
FAMILIES = [("mobilenet_v3_small", 32), ("resnext50_32x4d", 32), ("efficientnet_b0", 32), ("vit_b_32", 32),
            ("squeezenet1_1", 32), ("convnext_tiny", 32), ("swin_t", 32), ("swin_v2_t", 32),
            ("efficientnet_v2_s", 32), ("densenet121", 32), ("regnet_x_400mf", 32), ("regnet_y_400mf", 32),
            ("shufflenet_v2_x0_5", 32), ("mnasnet0_5", 32), ("mobilenet_v2", 32), ("wide_resnet50_2", 32),
            ("vgg11_bn", 32), ("alexnet", 64), ("googlenet", 32), ("inception_v3", 80), ("maxvit_t", 224),
            ("resnet152", 32)]
FAST = 5


def test_torchvisions_spellings_set_the_same_fields(tmp_path):
    assert parse_config(ClassifierConfig, ["--model", "vit_b_16"]).arch == "vit_b_16"
    assert parse_config(ClassifierConfig, ["--arch", "vit_b_16"]).arch == "vit_b_16"
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"model": "convnext_tiny"}))
    assert parse_config(ClassifierConfig, ["--config", str(recipe)]).arch == "convnext_tiny"
    assert re.search(r"--arch( ARCH)?, --model ARCH", build_parser(ClassifierConfig).format_help())
    spelled = parse_config(ClassifierConfig, ["--wd", "0.00002", "--clip-grad-norm", "1.5"])
    assert (spelled.weight_decay, spelled.clip_grad) == (2e-5, 1.5)


def test_every_torchvision_classification_model_is_a_name_the_classifier_takes():
    names = model_names()
    assert names[:2] == ["lenet", "small_cnn"]
    assert set(torchvision.models.list_models(module=torchvision.models)) == set(names[2:])
    assert {family for family, _ in FAMILIES} <= set(names)


@pytest.mark.parametrize("name,size", FAMILIES[:FAST])
def test_each_family_takes_a_training_step_with_the_data_sets_classes(name, size):
    """Built with 5 classes and no weights, in training mode: logits of 5 per image (the
    auxiliary classifiers left out), a finite loss, a gradient for every parameter (DDP, which
    looks for no unused ones, would wait for the others forever), and one SGD step that changes
    what the model answers."""
    take_a_training_step(name, size)


# The largest models, whose real step is seconds of memory traffic each that prove nothing a smaller
# model of the same class does not: the sweep checks their shapes on the meta device, and smaller
# models of their classes take the real step.
GIANTS = ("convnext_large", "regnet_y_128gf", "vit_h_14", "vit_l_16", "vit_l_32")


@pytest.mark.slow
def test_every_model_torchvision_lists_takes_a_training_step():
    """Each name list_models gives (about 80, up to ViT-H/14 and RegNet-Y-128GF), in one process,
    at the smallest of a few sizes the size probe accepts for it: the step of the test above; each
    of GIANTS its logits and a gradient for every parameter on the meta device, where a smaller
    model of its class took the real step."""
    stepped, giants = set(), set()
    for name in model_names()[2:]:
        size = next(size for size in (28, 32, 64, 80, 224) if input_refusal(name, size, [size]) is None)
        if name in GIANTS:
            giants.add(type(take_a_step_on_the_meta_device(name, size)))
        else:
            stepped.add(type(take_a_training_step(name, size)))
    assert len(giants) == 3 and giants <= stepped, (giants, stepped)


def take_a_step_on_the_meta_device(name: str, size: int) -> torch.nn.Module:
    """The shapes of the step below: 5 logits per image and a gradient for every parameter."""
    model = (shapes_only(name, 5, size) or build_model(name, 5, size).to("meta")).train()
    logits = model(torch.empty(2, 3, size, size, device="meta"))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 5)
    torch.nn.functional.cross_entropy(logits, torch.empty(2, dtype=torch.long, device="meta")).backward()
    assert all(p.grad is not None for p in model.parameters())
    return model


def take_a_training_step(name: str, size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(name, 5, size).train()
    images, targets = torch.randn(2, 3, size, size), torch.tensor([1, 4])
    logits = model(images)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 5)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        answer = model.eval()(images)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        assert not torch.equal(model(images), answer)
    return model


def test_a_resnet_below_64_px_gets_the_cifar_stem_and_others_keep_theirs():
    deep = build_model("resnet152", 10, 32)
    assert deep.conv1.stride == (1, 1) and isinstance(deep.maxpool, torch.nn.Identity)
    assert build_model("resnet152", 10, 224).conv1.stride == (2, 2)
    assert build_model("vit_b_16", 10, 32).image_size == 32  # its position embedding fits the image


def test_a_torchvision_model_trains_on_two_ranks_through_the_script(tmp_path):
    """``--model`` through the script's own code on 2 gloo ranks, with accumulation: the run ends,
    its ranks hold identical weights, and config.json and the checkpoint record the model."""
    out = tmp_path / "run"
    proc = run_ranks("train_classifier.py", [*DIGITS, "--model", "mobilenet_v3_small", "--image-size", "32",
                                             "--accum-steps", "2", "--max-steps", "2", "--out", str(out)], tmp_path)
    assert_ok(proc)
    assert re.search(r"weights identical on all 2 ranks", proc.stdout + proc.stderr)
    assert json.loads((out / "config.json").read_text())["config"]["arch"] == "mobilenet_v3_small"
    state = torch.load(out / "checkpoint_last.pt", weights_only=True, map_location="cpu")
    assert state["config"]["arch"] == "mobilenet_v3_small" and state["step"] == 2


@pytest.mark.parametrize("args,line", [
    (["--model", "vit_b_61"], "--arch vit_b_61: not a model of this project or of torchvision; did you mean vit_b_16?"),
    (["--model", "convnext_tiny", "--linear-probe"], "--linear-probe puts a new fc on the backbone, and --arch "
                                                     "convnext_tiny's classifier is not one named fc"),
])
def test_a_model_that_cannot_train_is_one_line_and_exit_2(args, line, capsys):
    proc = in_process(train_classifier.main, [*DIGITS, "--check", *args], capsys)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and line in proc.stderr


@pytest.mark.parametrize("name,size", [("alexnet", 32), ("alexnet", 64), ("maxvit_t", 32), ("vit_h_14", 32),
                                       ("inception_v3", 64), ("inception_v3", 80), ("resnet50", 16)])
def test_the_size_probe_agrees_with_a_real_forward(name, size):
    """The meta device's refusal (no memory, no arithmetic) is the model's own: a real build and
    training forward at that size on the CPU fail exactly where the probe refuses. (The words may
    differ: torch 2.11's meta kernels check some shapes in another op than its CPU kernels.)"""
    refusal = input_refusal(name, size, [size])
    try:
        build_model(name, 10, size).train()(torch.randn(2, 3, size, size))
        failed = None
    except (RuntimeError, ValueError, AssertionError) as err:
        failed = str(err).strip().splitlines()[0]
    assert (refusal is None) == (failed is None)
    assert refusal is None or refusal[0] == size and refusal[1]  # in the words of the op that refused (torch's own)


def test_a_vit_built_for_one_size_refuses_a_training_crop_of_another():
    assert input_refusal("vit_b_16", 224, [176, 224]) == (176, "Wrong image height! Expected 224 but got 176!")
    assert input_refusal("vit_b_16", 176, [176]) is None


@pytest.mark.parametrize("name", ["resnet50", "regnet_y_400mf"])  # counted on the meta device; RegNet built on the CPU
def test_check_names_the_network_and_its_parameters(name, capsys):
    proc = in_process(train_classifier.main, [*DIGITS, "--check", "--model", name, "--image-size", "32"], capsys)
    assert_ok(proc)
    count = sum(p.numel() for p in build_model(name, 10, 32).parameters())
    assert f"  network: {name} for 10 classes, {count:,} parameters\n" in proc.stdout


def test_a_size_the_model_cannot_take_is_one_line_and_exit_2(capsys):
    proc = in_process(train_classifier.main, [*DIGITS, "--check", "--model", "alexnet", "--image-size", "32"], capsys)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--arch alexnet cannot take 32 px images (Given input size: (256x1x1)" in proc.stderr
    assert "give a --image-size it takes" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnext50_32x4d", "efficientnet_b0"])
def test_moco_trains_a_backbone_on_two_ranks_with_shuffle_bn(name, tmp_path):
    """``-a NAME`` (main_moco.py's spelling) through the script's own code on 2 gloo ranks, shuffle
    BN included, a ResNet and a model whose classifier is not fc: the run ends with its encoders,
    queue and pointer identical on its ranks, and the checkpoint records the backbone."""
    out = tmp_path / "moco"
    proc = run_ranks("train_moco.py", ["--dataset", "digits", "--device", "cpu", "-a", name,
                                       "--image-size", "32", "--batch-size", "4", "--moco-k", "64", "--knn-every", "0",
                                       "--epochs", "1", "--max-steps", "2", "--out", str(out)], tmp_path)
    assert_ok(proc)
    assert "encoders, queue and pointer identical on all 2 ranks" in proc.stdout
    state = torch.load(out / "checkpoint_last.pt", weights_only=True, map_location="cpu")
    assert state["config"]["arch"] == name and state["step"] == 2


@pytest.mark.parametrize("name, message", [
    ("squeezenet1_1", "--arch squeezenet1_1: its logits come from no linear layer, and MoCo replaces a backbone's "
                      "linear classifier with its projection head"),
    ("resnet19", "--arch resnet19: not a model of this project or of torchvision")])
def test_moco_refuses_a_backbone_without_a_linear_classifier_in_one_line(name, message, capsys):
    proc = in_process(train_moco.main, ["--dataset", "digits", "--device", "cpu", "--check", "--arch", name], capsys)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr


# one model per family MoCo takes beyond the ResNets, at a size each takes
MOCO_FAMILIES = [("efficientnet_b0", 32, "classifier.1"), ("vit_b_32", 32, "heads.head"),
                 ("convnext_tiny", 32, "classifier.2"), ("mobilenet_v3_small", 32, "classifier.3"),
                 ("swin_t", 32, "head"), ("regnet_x_400mf", 32, "fc"), ("shufflenet_v2_x0_5", 32, "fc"),
                 ("densenet121", 32, "classifier")]


@pytest.mark.slow
@pytest.mark.parametrize("name, size, head", MOCO_FAMILIES)
def test_moco_pretrains_each_family_with_split_bn_and_the_knn_monitor(name, size, head, tmp_path, capsys):
    """MoCo on one process (BatchNorm split in 2, shuffle BN's stand-in) replaces the family's own
    classifier, named at --check and in the log, trains two steps and runs the kNN monitor."""
    common = ["--dataset", "digits", "--device", "cpu", "--arch", name, "--image-size", str(size), "--batch-size", "8",
              "--moco-k", "32", "--bn-splits", "2", "--lr", "0.01", "--out", str(tmp_path / "run")]
    check = in_process(train_moco.main, [*common, "--check"], capsys)
    assert check.returncode == 0 and f"backbone: {name}, its classifier {head} replaced by the projection head" \
        in check.stdout, check.stderr
    proc = in_process(train_moco.main, [*common, "--max-steps", "2", "--knn-every", "1", "--knn-bank-samples", "64"],
                      capsys)
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout + proc.stderr
    assert f"its classifier {head} replaced by the projection head" in said and "kNN" in said
    state = torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=True, map_location="cpu")
    assert state["step"] == 2 and not any(k.startswith(f"encoder_q.backbone.{head}.") for k in state["model"])


def test_the_embedding_decay_groups_are_torchvisions():
    """--transformer-embedding-decay: a group per torchvision key (train.py's class_token,
    position_embedding, relative_position_bias_table), in its order after other, norm and bias,
    by the parameter's own name: Swin's 12 tables; ViT's class token, not its pos_embedding (no
    key names it, there as here); every trainable parameter in exactly one group."""
    from ddp_utils.train.optimization import parameter_groups

    for arch, members in (("swin_t", {"relative_position_bias_table": 12}), ("vit_b_32", {"class_token": 1})):
        with torch.device("meta"):
            model = build_model(arch, 10, 224)
        groups = parameter_groups(model, 0.05, 0.0, 0.0, 0.0)
        names = [g["group"] for g in groups]
        assert names == ["other", "norm", "bias", *members], names
        for group in groups[3:]:
            assert group["weight_decay"] == 0.0 and len(group["params"]) == members[group["group"]]
        owners = {id(p): n.rsplit(".", 1)[-1] for n, p in model.named_parameters()}
        assert all(owners[id(p)] == g["group"] for g in groups[3:] for p in g["params"])
        assert sorted(id(p) for g in groups for p in g["params"]) == sorted(owners)
    vit = dict(model.named_parameters())
    assert any(p is vit["encoder.pos_embedding"] for p in groups[0]["params"])  # torchvision's key misses it


def test_sync_bn_converts_on_cuda_ranks_only():
    """--sync-bn: several CPU ranks are refused in one line (SyncBatchNorm has no CPU kernel);
    on CUDA ranks it is accepted and the network's BatchNorm layers become SyncBatchNorm; one
    process keeps BatchNorm (nothing to synchronise, as torchvision's script does)."""
    from ddp_utils.config import UsageError
    from ddp_utils.runtime.dist import DistInfo
    from ddp_utils.runtime.launch import LaunchEnv

    cfg = parse_config(ClassifierConfig, ["--arch", "resnet18", "--sync-bn", "--device", "auto"])
    two = LaunchEnv("torchrun", 0, 0, 2, 2)
    with pytest.raises(UsageError, match="--sync-bn needs CUDA: SyncBatchNorm has no CPU kernel"):
        cfg.validate(two, cuda_devices=0)
    cfg.validate(two, cuda_devices=2)
    cpu = torch.device("cpu")
    for world, kind in ((1, torch.nn.BatchNorm2d), (2, torch.nn.SyncBatchNorm)):
        info = DistInfo(0, 0, world, world, cpu, None, "single")
        norms = [m for m in train_classifier.build_network(cfg, info, 10, 32).modules()
                 if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert norms and all(type(m) is kind for m in norms)


def test_the_memory_at_the_batch_counts_what_a_forward_keeps(tmp_path, capsys):
    """activation_bytes (on the meta device) against the storages a real CPU forward keeps for the
    backward, within 15% (attention keeps more on the meta device); --check's line adds the fp32 weights, gradients and SGD's momentum."""
    from ddp_utils.data.host_memory import size_text
    from ddp_utils.models.backbones import activation_bytes

    for arch, size in (("resnet18", 64), ("vit_b_32", 32), ("convnext_tiny", 32)):
        torch.manual_seed(0)
        model = build_model(arch, 10, size).train()
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def keep(tensor, kept=kept, parameters=parameters):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameters:
                kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model(torch.randn(4, 3, size, size))
        real, estimate = sum(kept.values()), activation_bytes(arch, 10, size, 4)
        assert abs(estimate - real) <= 0.15 * real, (arch, estimate, real)
    proc = in_process(train_classifier.main, ["--dataset", "digits", "--arch", "resnet18", "--image-size", "64",
                                              "--batch-size", "4", "--check", "--out", str(tmp_path / "run")], capsys)
    weights = 4 * 3 * sum(p.numel() for p in build_model("resnet18", 10, 64).parameters())
    estimate = activation_bytes("resnet18", 10, 64, 4)
    assert f"memory at the batch: about {size_text(weights + estimate)} a rank: weights, gradients, sgd's state " \
           f"{size_text(weights)} (fp32), activations kept for the backward of 4 images at 64 px" in proc.stdout


def test_moco_refuses_a_size_its_backbone_cannot_take_in_one_line(capsys):
    proc = in_process(train_moco.main, ["--dataset", "digits", "--device", "cpu", "--check", "--arch", "maxvit_t",
                                        "--image-size", "64"], capsys)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--arch maxvit_t cannot take 64 px images (" in proc.stderr and "give a --image-size it takes" in proc.stderr
