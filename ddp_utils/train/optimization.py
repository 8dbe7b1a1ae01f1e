"""The optimisation of a run: the optimizer (SGD by default; AdamW, RMSprop) over its parameter
groups, the fp16 scaler and the learning rate of every optimizer step.

LR schedules are pure functions of the optimizer step (not micro-steps, not epochs):
``LRSchedule(...)(step)`` is the LR of the step taken after ``step`` others (applied or skipped).
Nothing of it lives in a checkpoint: a resumed run's LR follows from its step and its own flags.
A schedule torchvision steps once per epoch (``steplr``, ``exponentiallr``, ``cosineannealinglr``,
the epoch warm-up) is the same function with the epoch ``step // steps_per_epoch`` in it: constant
within an epoch."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import nn

from ..runtime.precision import grad_scaler

LR_SCHEDULES = ("cosine", "step", "constant", "cosine-epoch", "cosineannealinglr", "steplr", "exponentiallr")
# what --lr-warmup-epochs warms up
EPOCH_WARMUP_SCHEDULES = ("cosineannealinglr", "constant", "steplr", "exponentiallr")
EPOCH_SCHEDULES = ("cosine-epoch", "cosineannealinglr", "steplr", "exponentiallr")  # one LR per epoch
WARMUP_METHODS = ("linear", "constant")
OPTIMIZERS = ("sgd", "sgd_nesterov", "adamw", "rmsprop")  # torchvision's --opt names
# torchvision's train.py: the parameters --transformer-embedding-decay covers, by their own name
EMBEDDING_KEYS = ("class_token", "position_embedding", "relative_position_bias_table")
# torchvision's references/classification: the layers whose parameters --norm-weight-decay covers
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
               nn.LocalResponseNorm)
RMSPROP_EPS, RMSPROP_ALPHA = 0.0316, 0.9  # torchvision's RMSprop (its EfficientNet and MobileNetV3 recipes)


def steps_per_epoch(batches_per_epoch: int, accum_steps: int) -> int:
    """Optimizer steps in one epoch: its accumulation windows (``accumulation.plan_windows``), a shorter last one counted."""
    return math.ceil(batches_per_epoch / accum_steps)


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier: linear from 1/warmup to 1 over ``warmup_steps``, then cosine down to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def warmup_step_factor(step: int, warmup_steps: int, milestones: Sequence[int], gamma: float = 0.1) -> float:
    """LR multiplier: linear warmup, then x ``gamma`` at each milestone (MoCo v1's schedule)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return gamma ** sum(step >= m for m in milestones)


def epoch_warmup_factor(epoch: int, warmup_epochs: int, method: str, decay: float) -> float:
    """LR multiplier of epoch ``epoch`` (0-based) of torchvision's warm-up (``--lr-warmup-epochs``),
    as its LinearLR / ConstantLR stepped once per epoch give it: linear from ``decay`` towards 1
    (``decay + (1 - decay) e / warmup_epochs``), or ``decay`` throughout (constant)."""
    if method == "constant":
        return decay
    return decay + (1.0 - decay) * min(epoch, warmup_epochs) / warmup_epochs


def cosine_annealing_factor(epoch: int, warmup_epochs: int, epochs: int) -> float:
    """LR multiplier of epoch ``epoch`` (0-based) under torchvision's CosineAnnealingLR (eta_min 0),
    started after ``warmup_epochs`` and stepped once per epoch: ``0.5 (1 + cos(pi t / T))`` with
    t = epoch - warmup_epochs, T = epochs - warmup_epochs; the last epoch trains above 0."""
    span = max(1, epochs - warmup_epochs)
    return 0.5 * (1.0 + math.cos(math.pi * min(max(0, epoch - warmup_epochs), span) / span))


def step_lr_factor(epoch: int, warmup_epochs: int, step_size: int, gamma: float) -> float:
    """LR multiplier of epoch ``epoch`` (0-based) under torchvision's StepLR, started after
    ``warmup_epochs`` and stepped once per epoch: ``gamma ** (t // step_size)``, t = epoch - warmup_epochs."""
    return gamma ** (max(0, epoch - warmup_epochs) // step_size)


def exponential_lr_factor(epoch: int, warmup_epochs: int, gamma: float) -> float:
    """LR multiplier of epoch ``epoch`` (0-based) under torchvision's ExponentialLR, started after
    ``warmup_epochs`` and stepped once per epoch: ``gamma ** t``, t = epoch - warmup_epochs."""
    return gamma ** max(0, epoch - warmup_epochs)


def epoch_cosine_factor(epoch: int, epochs: int) -> float:
    """LR multiplier of the MoCo authors' CIFAR-10 demo: ``0.5 * (1 + cos(pi * epoch / epochs))``
    for the whole of epoch ``epoch``, counted from 1 (the demo's loop runs epochs 1..epochs), so
    the first epoch already trains below the peak and the last one at exactly 0."""
    return 0.5 * (1.0 + math.cos(math.pi * epoch / epochs))


@dataclass(frozen=True)
class LRSchedule:
    """The LR of every optimizer step, after a linear warm-up of ``warmup_steps`` to ``peak``:
    ``cosine`` decays to 0 at ``total_steps``; ``step`` is x0.1 at each of ``milestones`` (steps);
    ``constant``; ``cosine-epoch`` takes one value per epoch of ``steps_per_epoch`` steps,
    ``peak * epoch_cosine_factor(e, epochs)``, which its warm-up multiplies (the LR rises to the
    epoch's value instead of dropping from the peak; without warm-up it is the demo's schedule);
    ``cosineannealinglr`` is torchvision's CosineAnnealingLR stepped once per epoch, over the epochs
    after ``warmup_epochs`` (:func:`cosine_annealing_factor`), down towards ``lr_min`` (its
    ``eta_min``, an LR: ``lr_min + (peak - lr_min) * factor``, torchvision's expression, so
    ``factor()`` is then ``self(step) / peak``); ``steplr`` is its StepLR, x ``gamma`` every
    ``step_size`` epochs (:func:`step_lr_factor`); ``exponentiallr`` its ExponentialLR, x ``gamma``
    every epoch (:func:`exponential_lr_factor`). These three take one LR per epoch and, like
    torchvision's after a SequentialLR hand-over, count their epochs from the end of the warm-up;
    ``warmup_steps`` multiplies them as it does ``cosine-epoch``.

    ``warmup_epochs`` (EPOCH_WARMUP_SCHEDULES): torchvision's warm-up, counted in epochs, a
    LinearLR or ConstantLR that a SequentialLR hands over to the main schedule: epoch
    e < warmup_epochs runs at ``peak * epoch_warmup_factor(e, ...)``, then the main schedule
    starts. Each epoch's LR is constant, as with torchvision's scheduler stepped after each epoch."""

    peak: float
    kind: str = "cosine"
    total_steps: int = 0
    warmup_steps: int = 0
    milestones: tuple[int, ...] = ()
    steps_per_epoch: int = 0  # EPOCH_SCHEDULES and warmup_epochs
    warmup_epochs: int = 0
    warmup_method: str = "linear"
    warmup_decay: float = 0.01
    step_size: int = 30  # steplr: epochs between decays
    gamma: float = 0.1  # steplr, exponentiallr: the factor of each decay
    lr_min: float = 0.0  # cosineannealinglr: the LR it anneals towards (0 = none)

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown LR schedule {self.kind!r}; one of {', '.join(LR_SCHEDULES)}")
        if (self.kind in EPOCH_SCHEDULES or self.warmup_epochs) and self.steps_per_epoch < 1:
            raise ValueError(f"the {self.kind} schedule needs steps_per_epoch >= 1")
        if self.warmup_epochs and self.kind not in EPOCH_WARMUP_SCHEDULES:
            raise ValueError(f"a warm-up in epochs applies to {', '.join(EPOCH_WARMUP_SCHEDULES)}, not {self.kind}")
        if self.warmup_method not in WARMUP_METHODS:
            raise ValueError(f"unknown warm-up method {self.warmup_method!r}; one of {', '.join(WARMUP_METHODS)}")
        if self.step_size < 1:
            raise ValueError(f"step_size {self.step_size}: the epochs between decays must be >= 1")
        if not 0.0 < self.gamma < math.inf:
            raise ValueError(f"gamma {self.gamma}: the decay factor must be a finite number > 0")
        if not 0.0 <= self.lr_min < math.inf or (self.lr_min and self.lr_min >= self.peak):  # 0: no floor, any peak
            raise ValueError(f"lr_min {self.lr_min}: the floor must be an LR >= 0 and below the peak {self.peak}")
        object.__setattr__(self, "milestones", tuple(self.milestones))  # a list is fine too

    @property
    def epochs(self) -> int:
        """Epochs the schedule spans (cosine-epoch, cosineannealinglr)."""
        return max(1, -(-self.total_steps // max(1, self.steps_per_epoch)))

    def _in_epoch_warmup(self, step: int) -> bool:
        return bool(self.warmup_epochs) and step // self.steps_per_epoch < self.warmup_epochs

    def _ramp(self, step: int, value: float) -> float:
        """``value`` under the linear warm-up in steps (``warmup_steps``), unchanged after it."""
        return value * (step + 1) / self.warmup_steps if step < self.warmup_steps else value

    def _floored(self, step: int) -> bool:
        return self.kind == "cosineannealinglr" and bool(self.lr_min) and not self._in_epoch_warmup(step)

    def factor(self, step: int) -> float:
        """The multiplier of ``peak`` at optimizer step ``step`` (0-based); under cosineannealinglr's
        floor, ``self(step) / peak`` (the LR itself is torchvision's expression, not peak x factor)."""
        if self._in_epoch_warmup(step):
            return epoch_warmup_factor(step // self.steps_per_epoch, self.warmup_epochs, self.warmup_method,
                                       self.warmup_decay)
        if self._floored(step):
            return self(step) / self.peak
        if self.kind == "cosineannealinglr":
            return self._ramp(step, cosine_annealing_factor(step // self.steps_per_epoch, self.warmup_epochs,
                                                            self.epochs))
        if self.kind == "steplr":
            return self._ramp(step, step_lr_factor(step // self.steps_per_epoch, self.warmup_epochs, self.step_size,
                                                   self.gamma))
        if self.kind == "exponentiallr":
            return self._ramp(step, exponential_lr_factor(step // self.steps_per_epoch, self.warmup_epochs,
                                                          self.gamma))
        if self.kind == "cosine":
            return warmup_cosine_factor(step, self.warmup_steps, self.total_steps)
        if self.kind == "cosine-epoch":
            epoch = min(step // self.steps_per_epoch + 1, self.epochs)
            return self._ramp(step, epoch_cosine_factor(epoch, self.epochs))
        # "constant" is a step schedule without milestones: warm-up, then flat.
        return warmup_step_factor(step, self.warmup_steps, self.milestones if self.kind == "step" else ())

    def __call__(self, step: int) -> float:
        if self._floored(step):  # CosineAnnealingLR's eta_min + (base - eta_min) x factor, its own rounding
            cosine = cosine_annealing_factor(step // self.steps_per_epoch, self.warmup_epochs, self.epochs)
            return self._ramp(step, self.lr_min + (self.peak - self.lr_min) * cosine)
        return self.peak * self.factor(step)  # LambdaLR's own product: the same bits


def parse_milestones(text: str, epochs: int | None = None) -> list[int]:
    """``"120,160"`` -> ``[120, 160]`` (epochs); ``"60%,80%"`` with ``epochs=200`` -> ``[120, 160]``
    (``round(N / 100 * epochs)``). Raises ValueError on anything else, and on a percentage
    without ``epochs``."""
    result = []
    for part in (p.strip() for p in text.split(",")):
        if part.endswith("%"):
            if epochs is None:
                raise ValueError(f"{part}: a percentage needs the number of epochs")
            percent = float(part[:-1])
            if not math.isfinite(percent):
                raise ValueError(f"{part}: not a number")
            result.append(round(percent / 100 * epochs))
        elif part:
            result.append(int(part))
    return sorted(result)


def cosine_to_one(base: float, step: int, total_steps: int) -> float:
    """A value rising from ``base`` to 1 on a half cosine (MoCo's momentum schedule, BYOL-style)."""
    progress = min(1.0, step / max(1, total_steps))
    return 1.0 - (1.0 - base) * 0.5 * (1.0 + math.cos(math.pi * progress))


def sgd(params, lr: float, momentum: float, weight_decay: float, device: torch.device,
        nesterov: bool = False) -> torch.optim.SGD:
    """Fused SGD on CUDA, the multi-tensor (foreach) one elsewhere: the same update rule."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, **fast)


def build_optimizer(kind: str, params, lr: float, momentum: float, weight_decay: float, device: torch.device,
                    nesterov: bool = False) -> torch.optim.Optimizer:
    """The optimizer torchvision's references/classification/train.py builds for ``--opt``: SGD
    (``nesterov``), AdamW (its defaults: betas 0.9, 0.999, eps 1e-8; ``momentum`` unused) or
    RMSprop (``alpha`` 0.9, ``eps`` 0.0316, ``momentum``); ``weight_decay`` is each group's
    default (SGD and RMSprop: L2 added to the gradient; AdamW: decoupled). Fused on CUDA where
    PyTorch has a fused kernel (SGD, AdamW), the multi-tensor (foreach) one otherwise."""
    if kind in ("sgd", "sgd_nesterov"):
        return sgd(params, lr, momentum, weight_decay, device, nesterov or kind == "sgd_nesterov")
    fused = device.type == "cuda"
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                                 **({"fused": True} if fused else {"foreach": True}))
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, momentum=momentum, weight_decay=weight_decay, eps=RMSPROP_EPS,
                                   alpha=RMSPROP_ALPHA, foreach=True)
    raise ValueError(f"unknown optimizer {kind!r}; one of {', '.join(OPTIMIZERS)}")


def state_copies(kind: str, momentum: float) -> int:
    """Tensors the optimizer ``kind`` keeps per parameter, each the parameter's size: SGD's momentum
    buffer, AdamW's two moments, RMSprop's square average (and its momentum buffer)."""
    if kind in ("sgd", "sgd_nesterov"):
        return 1 if momentum or kind == "sgd_nesterov" else 0
    return 2 if kind == "adamw" or momentum else 1


def parameter_groups(model: nn.Module, weight_decay: float, norm_weight_decay: float | None = None,
                     bias_weight_decay: float | None = None, embedding_decay: float | None = None) -> list[dict]:
    """The optimizer's parameter groups, by torchvision's rule (references/classification/utils.py,
    ``set_weight_decay``, with train.py's custom keys): with ``bias_weight_decay`` every parameter
    named ``bias`` gets it, with ``embedding_decay`` every one named as one of EMBEDDING_KEYS (a
    group per name), a name being asked before the layer; with ``norm_weight_decay`` the other
    parameters of normalisation layers (NORM_LAYERS) get it. Frozen parameters are left out;
    each group keeps the modules' order (a module's own parameters, then its children's); the
    groups come in torchvision's order (other, norm, bias, the embedding keys) and empty ones are
    dropped. None given: one group of every trainable parameter, its decay the optimizer's
    default. Each other group is named (``"group": "other"``, ``"norm"``, ``"bias"``, a key), so
    that a resume can tell a checkpoint of other groups (``resume.check_parameter_groups``)."""
    by_name = {} if bias_weight_decay is None else {"bias": bias_weight_decay}
    if embedding_decay is not None:
        by_name.update(dict.fromkeys(EMBEDDING_KEYS, embedding_decay))
    if norm_weight_decay is None and not by_name:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    groups: dict[str, list[nn.Parameter]] = {"other": [], "norm": [], **{name: [] for name in by_name}}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if name in by_name:
                groups[name].append(param)
            elif norm_weight_decay is not None and isinstance(module, NORM_LAYERS):
                groups["norm"].append(param)
            else:
                groups["other"].append(param)
    decay = {"other": weight_decay, "norm": norm_weight_decay, **by_name}
    return [{"params": params, "weight_decay": decay[name], "group": name} for name, params in groups.items() if params]


class OptimizationFlags(Protocol):
    """The flags :func:`build_optimization` reads (``train_config.TrainConfig`` has them)."""

    lr: float
    momentum: float
    weight_decay: float
    epochs: int
    accum_steps: int
    lr_schedule: str
    warmup_steps: int
    lr_warmup_epochs: int
    lr_warmup_method: str
    lr_warmup_decay: float
    lr_step_size: int
    lr_gamma: float
    lr_min: float
    amp: str

    def milestone_steps(self, steps_per_epoch: int) -> list[int]: ...


def build_optimization(cfg: OptimizationFlags, params, batches_per_epoch: int, device: torch.device,
                       optimizer: str = "sgd", nesterov: bool = False):
    """The optimizer (:func:`build_optimizer`; SGD unless told) over ``params`` (tensors, or the
    groups of :func:`parameter_groups`), the LR of every optimizer step over all --epochs, the
    fp16 scaler (disabled for other precisions) and the number of optimizer steps in all."""
    built = build_optimizer(optimizer, params, cfg.lr, cfg.momentum, cfg.weight_decay, device, nesterov)
    epoch_steps = steps_per_epoch(batches_per_epoch, cfg.accum_steps)
    total_steps = cfg.epochs * epoch_steps
    lr_schedule = LRSchedule(cfg.lr, cfg.lr_schedule, total_steps, cfg.warmup_steps,
                             tuple(cfg.milestone_steps(epoch_steps)), epoch_steps, cfg.lr_warmup_epochs,
                             cfg.lr_warmup_method, cfg.lr_warmup_decay, cfg.lr_step_size, cfg.lr_gamma, cfg.lr_min)
    return built, lr_schedule, grad_scaler(cfg.amp, device), total_steps
