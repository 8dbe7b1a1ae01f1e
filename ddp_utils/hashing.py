"""Counter-based randomness: a random choice that must replay exactly is a hash of integers
(a seed, an epoch, a sample index, a counter), the same on every rank, at any world size, after
any resume, with no generator state to save. One mixing function serves the shuffle BN
permutations, the kNN bank subset, the batched augmentation and the per-sample transforms."""
from __future__ import annotations

import torch
from torch import Tensor

MASK32 = 0xFFFF_FFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63 (no int64 overflow).
_MUL1, _MUL2 = 0x7FEB_352D, 0x6C8E_9CF5
_START = 0x243F_6A88  # any non-zero start (the first digits of pi)


def mix32(h):
    """A bijective 32-bit finaliser (xorshift-multiply rounds, as MurmurHash3's fmix32), for
    Python ints and int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _MUL1) & MASK32
    h = h ^ (h >> 15)
    h = (h * _MUL2) & MASK32
    return h ^ (h >> 16)


def key(*words: int) -> int:
    """A 32-bit hash of integers of any size and sign (each as its low and high 32 bits)."""
    h = _START
    for word in words:
        for half in (word, word >> 32):
            h = mix32(h ^ (half & MASK32))
    return h


def seed(*words: int) -> int:
    """A 64-bit seed for ``torch.manual_seed`` from integers: two independent 32-bit keys."""
    return (key(*words) << 32) | key(*words, 1)


def hashes(key_: int, index: Tensor, count: int, first: int = 0) -> Tensor:
    """B x count 32-bit hashes (int64) of ``key_``, ``index[b]`` (any device) and the columns
    ``first`` .. ``first + count - 1``."""
    idx = index.to(torch.int64)
    h = mix32((idx & MASK32) ^ key_)
    h = mix32(h ^ ((idx >> 32) & MASK32))
    columns = torch.arange(first, first + count, dtype=torch.int64, device=idx.device)
    return mix32(mix32(h[:, None] ^ columns))  # two rounds, so neighbouring columns decorrelate


def uniforms(key_: int, index: Tensor, count: int, first: int = 0) -> Tensor:
    """B x count float32 uniforms in [0, 1) with 24 random bits each (exact multiples of 2**-24)."""
    return (hashes(key_, index, count, first) >> 8).to(torch.float32) * 2.0 ** -24


def ranking(key_: int, index: Tensor) -> Tensor:
    """A 63-bit random score per entry of ``index``: sorting by it shuffles them."""
    h = hashes(key_, index, 2)
    return (h[:, 0] << 31) | (h[:, 1] >> 1)


def permutation(key_: int, size: int) -> Tensor:
    """A random permutation of ``range(size)`` on the CPU, a pure function of ``key_``."""
    return torch.argsort(ranking(key_, torch.arange(size)), stable=True)
