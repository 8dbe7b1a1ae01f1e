"""Shuffle BN with a permutation every rank derives itself, one all_to_all, keys gathered once,
and a queue pointer and shuffle counter kept on the host.

The distributed checks run on 2 and 3 gloo ranks and compare against the gather-based shuffle of
the MoCo authors' code (below: ``_gather_shuffle`` / ``_gather_unshuffle`` / ``_gather_enqueue``,
which take the permutation as an argument): on the same permutation, the same images reach the
same rank in the same order, the keys come home unchanged and the queue receives the same
columns, with one all_to_all and one all_gather per key batch (no broadcast) and no device->host
read in keys, forward or enqueue. The permutation, a function of (``shuffle_seed``, key batches
so far), is the same on every rank, changes from one key batch to the next, and is the same
after ``load_state_dict`` of a state saved mid-run as it would have been without the interruption.
"""
from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_on_ranks
from torch import nn

import ddp_utils.models.moco as moco_module
from ddp_utils.models.moco import MoCo
from ddp_utils.models.shuffle_bn import (
    SplitBatchNorm2d,
    plan_shuffle,
    shuffle_permutation,
    shuffle_to_ranks,
    split_batchnorm,
)
from ddp_utils.runtime.collectives import concat_all_gather
from ddp_utils.runtime.dist import DistInfo, get_rank, get_world_size

N, C, K = 6, 8, 30  # key images per rank, key size, queue length (wraps for W=2 and W=3)
SEED = 11           # MoCo's shuffle_seed in the distributed checks
COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all",
               "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
               "send", "recv", "isend", "irecv", "barrier", "all_gather_object", "broadcast_object_list")
# Tensor -> Python reads: on a GPU each one waits for the device (as in tests/test_host_syncs.py).
HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")


# ----------------------------------------------------------------------------- the reference
@torch.no_grad()
def _gather_shuffle(x: torch.Tensor, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather-based shuffle on a given permutation: every rank gathers all W*N images and
    keeps its N, ``perm[r*N:(r+1)*N]``."""
    x_all = concat_all_gather(x)
    return x_all[perm.view(get_world_size(), -1)[get_rank()]], torch.argsort(perm)


@torch.no_grad()
def _gather_unshuffle(k: torch.Tensor, unshuffle: torch.Tensor) -> torch.Tensor:
    return concat_all_gather(k)[unshuffle.view(get_world_size(), -1)[get_rank()]]


@torch.no_grad()
def _gather_enqueue(queue: torch.Tensor, ptr: int, k: torch.Tensor) -> int:
    """The gather-based enqueue, on a plain queue tensor; returns the new pointer."""
    keys = concat_all_gather(k)
    slots = (ptr + torch.arange(keys.shape[0])) % queue.shape[1]
    queue[:, slots] = keys.T.to(queue.dtype)
    return (ptr + keys.shape[0]) % queue.shape[1]


# ----------------------------------------------------------------------------- instruments
def _encoder() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, C))


@contextlib.contextmanager
def _counting_collectives(calls: dict[str, int], splits: list):
    """Count the Python-level torch.distributed collectives (as tests/test_accumulation.py does
    for all_reduce) and record the split sizes of all_to_all_single."""
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name):
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if name == "all_to_all_single":
                splits.append((kwargs["input_split_sizes"], kwargs["output_split_sizes"]))
            return real[name](*args, **kwargs)
        return counted

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def _watching_key_path(fixed: torch.Tensor | None = None):
    """Record what the key path does, optionally on a given permutation.

    Yields a namespace with ``perms`` (a copy of the permutation of every cross-rank shuffle, as
    ``plan_shuffle`` received it), ``reads`` (tensor -> Python reads, which wait for the device
    on a GPU) and ``planner_reads`` (the reads ``plan_shuffle`` makes of the CPU tensors it builds
    from the permutation to hand the split sizes to all_to_all_single as ints: ``name@device``).
    With ``fixed``, ``shuffle_permutation`` returns it instead of drawing one.
    """
    seen = SimpleNamespace(perms=[], reads={}, planner_reads={}, in_planner=False)
    real_reads = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    real_plan, real_perm = moco_module.plan_shuffle, moco_module.shuffle_permutation

    def counted(name):
        def read(self, *args, **kwargs):
            into, key = (seen.planner_reads, f"{name}@{self.device.type}") if seen.in_planner \
                else (seen.reads, name)
            into[key] = into.get(key, 0) + 1
            return real_reads[name](self, *args, **kwargs)
        return read

    def plan(perm, rank, world, device):
        seen.perms.append(perm.clone())
        seen.in_planner = True
        try:
            return real_plan(perm, rank, world, device)
        finally:
            seen.in_planner = False

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    moco_module.plan_shuffle = plan
    if fixed is not None:
        moco_module.shuffle_permutation = lambda seed, count, size: fixed.clone()
    try:
        yield seen
    finally:
        for name, fn in real_reads.items():
            setattr(torch.Tensor, name, fn)
        moco_module.plan_shuffle, moco_module.shuffle_permutation = real_plan, real_perm


def _perms(world: int) -> dict[str, torch.Tensor | None]:
    n = world * N
    swap_ends = torch.arange(n)
    swap_ends[[0, n - 1]] = swap_ends[[n - 1, 0]]  # rank 0 and the last rank trade one image
    return {
        "identity": torch.arange(n),  # nobody sends anything to a peer: zero-sized splits
        "swap_ends": swap_ends,
        "shift_reversed": torch.arange(n).roll(N).view(world, N).flip(1).reshape(-1),  # all leave
        "seeded": torch.randperm(n, generator=torch.Generator().manual_seed(1)),  # uneven splits
        "drawn": None,  # MoCo's own: shuffle_permutation(SEED, key batches so far)
    }


def _cloned_state(moco: MoCo) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in moco.state_dict().items()}


# ----------------------------------------------------------------------------- the worker
def _worker(info: DistInfo) -> dict:
    torch.manual_seed(100 + info.rank)  # different global RNGs on each rank: they must not matter
    rank, world = info.rank, info.world_size
    x = torch.randn(N, 3, 5, 5)
    moco = MoCo(_encoder(), dim=C, K=K, shuffle_seed=SEED)
    out: dict = {"x": x, "cases": {}}
    for name, fixed in _perms(world).items():
        calls, splits = {}, []
        with _watching_key_path(fixed) as seen, _counting_collectives(calls, splits):
            keys = moco.keys(x)  # one key batch: (W*N) x C
        perm = seen.perms[0]
        new_x = shuffle_to_ranks(x, plan_shuffle(perm, rank, world, x.device))
        # the reference, on the permutation the key batch used
        old_x, unshuffle = _gather_shuffle(x, perm)
        old_keys = _gather_unshuffle(F.normalize(moco.encoder_k(old_x), dim=1), unshuffle)
        out["cases"][name] = dict(
            new_x=new_x, old_x=old_x, local=keys[rank * N:(rank + 1) * N], all_ranks=keys, old_keys=old_keys,
            old_global=concat_all_gather(old_keys), calls=calls, splits=splits, perms=seen.perms,
            reads=seen.reads, planner_reads=seen.planner_reads)

    # no images: nothing moves, nothing breaks
    with _watching_key_path() as seen:  # the patched planner: its one read of CPU sizes is its own
        empty = shuffle_to_ranks(x[:0], moco_module.plan_shuffle(shuffle_permutation(SEED, 0, 0), rank, world,
                                                                 x.device))
    out["empty"] = dict(shape=tuple(empty.shape), reads=seen.reads)

    # forward + enqueue of its keys: one all_to_all, one all_gather, no read
    twin = copy.deepcopy(moco)  # the same state, so the same next permutation
    logits_twin, _ = twin(x, x)
    queue_before = moco.queue.clone()
    calls, splits = {}, []
    with _watching_key_path() as seen, _counting_collectives(calls, splits):
        logits, k_global = moco(x, x)
        moco.enqueue(k_global)
    out["step"] = dict(calls=calls, reads=seen.reads, logits_equal=torch.equal(logits, logits_twin),
                       k_global=k_global, queue_before=queue_before, queue_after=moco.queue.clone())

    # enqueue: same queue as the gather-based one, pointer int == buffer, through wrap-arounds
    moco = MoCo(_encoder(), dim=C, K=K)
    ref_queue, ref_ptr = moco.queue.clone(), 0
    ptrs, reads = [], {}
    for step in range(5):
        torch.manual_seed(1000 * step + info.rank)
        k = F.normalize(torch.randn(N, C), dim=1)
        everyone = concat_all_gather(k)
        ref_ptr = _gather_enqueue(ref_queue, ref_ptr, k)
        with _watching_key_path() as seen:
            moco.enqueue(everyone)
        for name, count in seen.reads.items():
            reads[name] = reads.get(name, 0) + count
        ptrs.append((ref_ptr, moco.queue_position, int(moco.queue_ptr)))
    out["enqueue"] = dict(ref_queue=ref_queue, queue=moco.queue.clone(), ptrs=ptrs, reads=reads, last=everyone)

    # checkpoint load and rank 0's state: the Python ints follow the buffers
    state = _cloned_state(moco)
    state["queue_ptr"] = torch.tensor([7 + 2 * info.rank])  # each rank's checkpoint differs
    state["shuffle_count"] = torch.tensor([3 + info.rank])
    fresh = MoCo(_encoder(), dim=C, K=K)
    fresh.load_state_dict(state)
    counters = lambda m: (m.queue_position, int(m.queue_ptr), m.key_batches_shuffled, int(m.shuffle_count))  # noqa: E731
    after_load = counters(fresh)
    fresh.sync_state_from_rank0()
    after_sync = counters(fresh)
    fresh.enqueue(everyone)
    out["load"] = dict(after_load=after_load, after_sync=after_sync, queue=fresh.queue.clone(),
                       state_queue=state["queue"], after_enqueue=counters(fresh))

    # resume: a state saved after 2 key batches gives the next 2 of the uninterrupted run
    run = MoCo(_encoder(), dim=C, K=K, shuffle_seed=SEED)
    with _watching_key_path() as seen:
        first = [run.keys(x) for _ in range(2)]
        state = _cloned_state(run)
        then = [run.keys(x) for _ in range(2)]
    resumed = MoCo(_encoder(), dim=C, K=K, shuffle_seed=SEED)
    resumed.load_state_dict(state)
    with _watching_key_path() as after_resume:
        again = [resumed.keys(x) for _ in range(2)]
    other_seed = MoCo(_encoder(), dim=C, K=K, shuffle_seed=SEED + 1)
    with _watching_key_path() as seen_other:
        other_seed.keys(x)
    out["resume"] = dict(perms=seen.perms, resumed_perms=after_resume.perms, then=then, again=again,
                         first=first, saved_count=int(state["shuffle_count"]),
                         counts=(run.key_batches_shuffled, int(run.shuffle_count), resumed.key_batches_shuffled,
                                 int(resumed.shuffle_count)),
                         other_seed_perm=seen_other.perms[0])
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def ranks(request, tmp_path_factory):
    return run_on_ranks(_worker, tmp_path_factory.mktemp(f"w{request.param}"), world_size=request.param)


# ----------------------------------------------------------------------------- the checks
def test_all_to_all_gives_each_rank_the_same_images_as_gathering(ranks):
    uneven = False
    for name in _perms(len(ranks)):
        for rank, r in enumerate(ranks):
            case = r["cases"][name]
            assert torch.equal(case["new_x"], case["old_x"]), name  # bit-identical, same order
            for sent, received in case["splits"]:
                assert sum(sent) == sum(received) == N  # each rank sends its N and receives its N
                uneven |= len(set(sent)) > 1
            if name == "identity":  # everything stays home: every split to a peer is empty
                assert case["splits"][0] == ([N if i == rank else 0 for i in range(len(ranks))],) * 2
    assert uneven
    # the images really moved between ranks: every global image encoded exactly once
    shuffled = torch.cat([r["cases"]["drawn"]["new_x"] for r in ranks]).flatten(1)
    originals = torch.cat([r["x"] for r in ranks]).flatten(1)
    assert not torch.equal(shuffled, originals)
    match = (shuffled.unsqueeze(1) == originals.unsqueeze(0)).all(2)
    assert torch.equal(match.sum(0), torch.ones(len(originals), dtype=torch.long))
    for r in ranks:  # an empty key batch moves nothing
        assert r["empty"]["shape"] == (0, 3, 5, 5) and r["empty"]["reads"] == {}


def test_keys_come_home_unchanged_and_the_global_batch_is_in_rank_order(ranks):
    for name in _perms(len(ranks)):
        cases = [r["cases"][name] for r in ranks]
        for rank, case in enumerate(cases):
            # the same encoder ops on bit-identical inputs, on CPU: exactly the same keys
            assert torch.equal(case["local"], case["old_keys"]), name
            assert torch.equal(case["all_ranks"], cases[0]["all_ranks"])  # identical on every rank
            assert torch.equal(case["all_ranks"][rank * N:(rank + 1) * N], case["local"])
        assert torch.equal(cases[0]["all_ranks"], torch.cat([c["local"] for c in cases]))
        assert torch.equal(cases[0]["all_ranks"], cases[0]["old_global"])  # what the old enqueue gathered


def test_every_rank_derives_the_same_permutation_and_it_changes_every_key_batch(ranks):
    world = len(ranks)
    for name, fixed in _perms(world).items():
        used = [r["cases"][name]["perms"] for r in ranks]
        assert all(len(p) == 1 for p in used)  # one per key batch, nothing else drew one
        for perms in used[1:]:
            assert all(torch.equal(a, b) for a, b in zip(perms, used[0])), name
        if fixed is not None:
            assert all(torch.equal(p, fixed) for p in used[0])
    # the drawn one: the (seed, count) function at count 4 (after 4 cases of one key batch each)
    assert torch.equal(ranks[0]["cases"]["drawn"]["perms"][0], shuffle_permutation(SEED, 4, world * N))
    resume = [r["resume"] for r in ranks]
    for res in resume[1:]:
        assert all(torch.equal(a, b) for a, b in zip(res["perms"], resume[0]["perms"]))
        assert torch.equal(res["other_seed_perm"], resume[0]["other_seed_perm"])
    perms = resume[0]["perms"]
    assert len(perms) == 4
    assert all(not torch.equal(a, b) for a, b in zip(perms, perms[1:]))  # a new one every batch
    assert not torch.equal(resume[0]["other_seed_perm"], perms[0])  # and it depends on the seed
    assert all(sorted(p.tolist()) == list(range(world * N)) for p in perms)


def test_a_resumed_run_draws_the_permutations_of_an_uninterrupted_one(ranks):
    for r in ranks:
        res = r["resume"]
        assert res["saved_count"] == 2
        assert res["counts"] == (4, 4, 4, 4)  # int == buffer, in both runs
        assert len(res["resumed_perms"]) == 2
        assert all(torch.equal(a, b) for a, b in zip(res["resumed_perms"], res["perms"][2:]))
        assert all(torch.equal(a, b) for a, b in zip(res["again"], res["then"]))  # same keys too
        assert not torch.equal(res["first"][0], res["first"][1])  # keys do depend on the perm


def test_one_all_to_all_one_all_gather_no_broadcast_per_key_batch(ranks):
    for r in ranks:
        for name, case in r["cases"].items():
            assert case["calls"] == {"all_to_all_single": 1, "all_gather": 1}, name
        # a whole step: forward with global keys, then an enqueue that gathers nothing
        assert r["step"]["calls"] == {"all_to_all_single": 1, "all_gather": 1}


def test_forward_global_keys_are_what_the_queue_takes(ranks):
    world = len(ranks)
    for r in ranks:
        step = r["step"]
        assert step["logits_equal"]  # watching changes nothing
        assert step["k_global"].shape == (world * N, C)
        assert torch.equal(step["k_global"], ranks[0]["step"]["k_global"])  # identical on every rank
        assert torch.equal(step["queue_after"][:, :world * N], step["k_global"].T)
        assert torch.equal(step["queue_after"][:, world * N:], step["queue_before"][:, world * N:])
        assert torch.equal(step["queue_after"], ranks[0]["step"]["queue_after"])


def test_enqueue_of_global_keys_writes_the_gather_based_queue_with_wrap_around(ranks):
    world = len(ranks)
    for r in ranks:
        e = r["enqueue"]
        assert torch.equal(e["queue"], e["ref_queue"])
        expected = [(world * N * (s + 1)) % K for s in range(5)]
        assert [p[0] for p in e["ptrs"]] == expected
        assert all(len(set(p)) == 1 for p in e["ptrs"]), e["ptrs"]  # int == buffer, both queues
        assert any(b < a for a, b in zip(expected, expected[1:]))  # it did wrap around


def test_python_counters_follow_load_state_dict_and_rank0_sync(ranks):
    world = len(ranks)
    for rank, r in enumerate(ranks):
        load = r["load"]
        # (pointer int, pointer buffer, shuffle count int, shuffle count buffer)
        assert load["after_load"] == (7 + 2 * rank, 7 + 2 * rank, 3 + rank, 3 + rank)  # this rank's
        assert load["after_sync"] == (7, 7, 3, 3)  # rank 0's
        assert load["after_enqueue"] == (7 + world * N, 7 + world * N, 3, 3)
        written = load["queue"]
        assert torch.equal(written[:, 7:7 + world * N], r["enqueue"]["last"].T)
        assert torch.equal(written[:, :7], ranks[0]["load"]["state_queue"][:, :7])


def test_no_host_read_in_keys_forward_or_enqueue(ranks):
    for r in ranks:
        assert r["enqueue"]["reads"] == {}
        assert r["step"]["reads"] == {}  # forward + enqueue
        for name, case in r["cases"].items():
            assert case["reads"] == {}, name
            # the planner's one conversion of the 2 x W split sizes, from a CPU tensor it built
            assert case["planner_reads"] == {"tolist@cpu": 1}, name


# ----------------------------------------------------------------------------- one process
def test_shuffle_permutation_is_a_pure_function_of_seed_and_count():
    rng = torch.get_rng_state()
    perm = shuffle_permutation(5, 3, 24)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is neither used nor moved
    assert perm.device.type == "cpu" and perm.dtype == torch.long
    assert sorted(perm.tolist()) == list(range(24))
    assert torch.equal(perm, shuffle_permutation(5, 3, 24))
    others = [shuffle_permutation(5, 4, 24), shuffle_permutation(6, 3, 24), shuffle_permutation(4, 4, 24)]
    assert not any(torch.equal(perm, other) for other in others)


def test_one_process_keys_and_queue_without_host_reads():
    torch.manual_seed(0)
    moco = MoCo(_encoder(), dim=C, K=K)
    x = torch.randn(2 * N, 3, 5, 5)
    with _watching_key_path() as seen:
        keys = moco.keys(x)
        for _ in range(4):
            moco.enqueue(keys)
    assert seen.reads == {} and seen.perms == []  # one process: the local shuffle, from the global RNG
    assert keys.shape == (2 * N, C)
    torch.testing.assert_close(keys, F.normalize(moco.encoder_k(x), dim=1), rtol=0, atol=1e-6)
    assert moco.queue_position == int(moco.queue_ptr) == (4 * 2 * N) % K
    assert moco.key_batches_shuffled == int(moco.shuffle_count) == 0
    with pytest.raises(ValueError, match="do not fit"):
        moco.enqueue(torch.zeros(K + 1, C))


def _inductor_unavailable() -> str | None:
    """Why torch.compile (inductor, C++ on CPU) cannot run here, or None."""
    try:
        torch.compile(lambda t: t * 2 + 1)(torch.ones(3))
    except Exception as err:  # any failure of the toolchain means: skip
        return f"torch.compile with inductor does not work here: {type(err).__name__}: {str(err)[:200]}"
    return None


@pytest.mark.slow  # torch.compile: seconds of C++ builds on a cold inductor cache
@pytest.mark.torch_versions  # torch.compile
def test_compiled_key_encoder_gives_the_eager_keys_and_keeps_the_state_dict():
    """With --bn-splits' BatchNorm, which updates its statistics in place inside the forward."""
    reason = _inductor_unavailable()
    if reason:
        pytest.skip(reason)
    eager = MoCo(split_batchnorm(_encoder(), 2), dim=C, K=K)
    compiled = copy.deepcopy(eager)
    names = list(compiled.state_dict())
    compiled.compile_key_encoder()
    try:
        assert list(compiled.state_dict()) == names  # not a submodule: no new keys
        assert dict(compiled.named_modules()).keys() == dict(eager.named_modules()).keys()
        wrapper = compiled.compiled_key_encoder
        assert eager.compiled_key_encoder is None and wrapper._orig_mod is compiled.encoder_k
        calls = []  # the key path must go through the compiled wrapper: count its calls
        object.__setattr__(compiled, "compiled_key_encoder", lambda t: calls.append(1) or wrapper(t))
        x = torch.randn(8, 3, 5, 5)
        for _ in range(2):  # before and after a momentum update (in place, seen by the compiled code)
            torch.manual_seed(3)  # one process: the same local shuffle for both
            want = eager.keys(x)
            torch.manual_seed(3)
            got = compiled.keys(x)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            for model in (eager, compiled):  # the encoder_q that both key encoders follow
                with torch.no_grad():
                    model.encoder_q[0].weight.add_(0.5)
                model.momentum_update(0.5)
        assert len(calls) == 2
        # the compiled forward updates encoder_k's own BatchNorm statistics
        bn_eager, bn_compiled = eager.encoder_k[1], compiled.encoder_k[1]
        assert isinstance(bn_compiled, SplitBatchNorm2d) and int(bn_compiled.num_batches_tracked) == 2
        for stat in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(bn_compiled, stat), getattr(bn_eager, stat), rtol=0, atol=1e-5)
    finally:
        torch.compiler.reset()
