"""kNN monitor: the sharded search (each rank keeps M/W bank rows) against the search over the
whole gathered bank (tests/knn_reference.py), on 2 gloo ranks and on one process; collectives per pass; bf16 bank storage;
deterministic ties; the seeded bank subset. One 2-rank job runs every distributed scenario
(module fixture); the tests read its results."""
from __future__ import annotations

import math
from contextlib import contextmanager

import knn_reference as reference
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_on_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_utils.eval.knn as knn
from ddp_utils.data.order import ShardedEvalSampler
from ddp_utils.data.pipeline import data_loader
from ddp_utils.data.sets import bank_subset
from ddp_utils.runtime.dist import DistInfo

CLASSES, IN_DIM, DIM, T = 7, 16, 24, 0.1
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all",
               "all_to_all_single", "broadcast", "all_gather_object", "broadcast_object_list", "gather",
               "scatter", "reduce", "reduce_scatter_tensor", "barrier", "send", "recv")


# ----------------------------------------------------------------------------- data and probes
def _clusters(n: int, dim: int, seed: int, noise: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy Gaussian clusters, one per class (fixed centres): kNN gets ~70-90%, not 100%."""
    centres = torch.randn(CLASSES, dim, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    return centres[labels] + noise * torch.randn(n, dim, generator=gen), labels


def _backbone() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and in the test process
    return nn.Linear(IN_DIM, DIM)


def _loader(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=32)


def _sharded_loader(x: torch.Tensor, y: torch.Tensor, info: DistInfo) -> DataLoader:
    """What train_moco.py builds: rank r takes samples r, r+W, ..."""
    data = TensorDataset(x, y)
    return data_loader(data, ShardedEvalSampler(data, info.world_size, info.rank), batch_size=32, workers=0,
                       pin_memory=False, train=False)


class Spy:
    """Records what the two searches were given and returned, while knn_accuracy* run."""

    def __init__(self):
        self.calls: list[dict] = []

    @contextmanager
    def installed(self):
        real_sharded, real_gathered = knn.knn_predict_sharded, reference.knn_predict

        def record(real, name):
            def wrapper(features, bank, bank_labels, *args, **kwargs):
                preds = real(features, bank, bank_labels, *args, **kwargs)
                self.calls.append({"fn": name, "bank_shape": tuple(bank.shape), "bank_dtype": bank.dtype,
                                   "bank_bytes": bank.numel() * bank.element_size(), "preds": preds.clone()})
                return preds
            return wrapper

        knn.knn_predict_sharded = record(real_sharded, "sharded")
        reference.knn_predict = record(real_gathered, "gathered")
        try:
            yield self
        finally:
            knn.knn_predict_sharded, reference.knn_predict = real_sharded, real_gathered

    def last(self) -> dict:
        return self.calls[-1]


class CollectiveCounter:
    """Counts top-level torch.distributed collectives (one inside another, e.g. the all_gather
    that all_gather_object runs, is not counted again) and the largest tensor each moved."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.depth = 0

    @contextmanager
    def installed(self):
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def wrap(name, fn):
            def wrapper(*args, **kwargs):
                if self.depth == 0:
                    tensors = [a for a in args if isinstance(a, torch.Tensor)]
                    tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
                    self.calls.append((name, max((t.numel() * t.element_size() for t in tensors), default=0)))
                self.depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.depth -= 1
            return wrapper

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def take(self) -> list[tuple[str, int]]:
        calls, self.calls = self.calls, []
        return calls


def _expected_collectives(val_sizes: list[int], queries_per_step: int) -> int:
    """1 size exchange + (all_gather + all_to_all) per step + 1 all_reduce of the counts."""
    per_rank = math.ceil(queries_per_step / len(val_sizes))
    return 2 + 2 * math.ceil(max(val_sizes) / per_rank)


def _reference(val: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor, k: int) -> torch.Tensor:
    """The gathered search in this process (bank in the gathered order: rank 0's rows first)."""
    return reference.knn_predict(F.normalize(val, dim=1), F.normalize(bank, dim=1), bank_labels, CLASSES, k, T)


def _assert_tie_free(val: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor, k: int) -> None:
    """Equality tests mean something only if float rounding cannot decide them: no near-tie at
    the k-th neighbour and no near-tie between the two best classes (float64)."""
    val, bank = F.normalize(val.double(), dim=1), F.normalize(bank.double(), dim=1)
    sim = val @ bank.T
    ordered, idx = sim.sort(dim=1, descending=True)
    if k < bank.shape[0]:
        assert (ordered[:, k - 1] - ordered[:, k]).min() > 1e-6
    k = min(k, bank.shape[0])
    votes = torch.zeros(len(val), CLASSES, dtype=torch.float64)
    votes.scatter_add_(1, bank_labels[idx[:, :k]], (ordered[:, :k] / T).exp())
    best = votes.topk(2, dim=1).values
    assert ((best[:, 0] - best[:, 1]) / best[:, 0]).min() > 1e-6


def _tie_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bank made of 12 random prototypes, each copied 10 times with random labels, scattered:
    a query's similarities to the copies of one prototype are exactly equal, so which copies
    make the top k is decided by the tie rule alone."""
    gen = torch.Generator().manual_seed(7)
    protos = F.normalize(torch.randn(12, DIM, generator=gen), dim=1)
    order = torch.randperm(120, generator=gen)
    bank = protos.repeat_interleave(10, dim=0)[order]
    labels = torch.randint(0, CLASSES, (120,), generator=gen)
    queries = protos[torch.randint(0, 12, (40,), generator=gen)] + 0.3 * torch.randn(40, DIM, generator=gen)
    return F.normalize(queries, dim=1), bank, labels


def _rule_reference(queries, bank, labels, k: int, lowest_first: bool = True) -> torch.Tensor:
    """Brute force with an explicit tie rule: equal similarities, lower bank position first (or last)."""
    sim = queries @ bank.T
    if not lowest_first:
        sim, labels = sim.flip(1), labels.flip(0)
    idx = sim.argsort(dim=1, descending=True, stable=True)[:, :k]
    votes = torch.zeros(len(queries), CLASSES)
    votes.scatter_add_(1, labels[idx], (sim.gather(1, idx) / T).exp())
    return votes.argmax(dim=1)


# ----------------------------------------------------------------------------- the 2-rank job
def _knn_worker(info: DistInfo, data: dict) -> dict:
    out: dict = {}
    spy, counter = Spy(), CollectiveCounter()
    with spy.installed(), counter.installed():
        # 1. The real path: Linear backbone, ShardedEvalSampler's shards (601 bank rows: 301 / 300).
        backbone = _backbone().train()
        bank_loader = _sharded_loader(data["bank_x"], data["bank_y"], info)
        val_loader = _sharded_loader(data["val_x"], data["val_y"], info)
        counter.take()
        out["acc_sharded"] = knn.knn_accuracy(backbone, bank_loader, val_loader, CLASSES, info.device, k=40, T=T,
                                              queries_per_step=64)
        out["sharded_calls"], out["sharded"] = counter.take(), spy.last()
        out["still_training"] = backbone.training
        out["acc_gathered"] = reference.knn_accuracy_gathered(backbone, bank_loader, val_loader, CLASSES, info.device,
                                                        k=40, T=T)
        out["gathered_calls"], out["gathered"] = counter.take(), spy.last()
        out["acc_bf16"] = knn.knn_accuracy(backbone, bank_loader, val_loader, CLASSES, info.device, k=40, T=T,
                                           bank_dtype=torch.bfloat16, queries_per_step=64)
        out["bf16"] = spy.last()

        # 2. Uneven shards: rank 0 holds 37 bank rows and no validation sample, rank 1 the rest;
        #    k = 60 exceeds rank 0's shard, k = 1000 the whole bank.
        identity = nn.Identity()
        bank_rows = slice(0, 37) if info.rank == 0 else slice(37, 400)
        val_rows = slice(0, 0) if info.rank == 0 else slice(0, 150)
        bank_loader = _loader(data["bank_x2"][bank_rows], data["bank_y2"][bank_rows])
        val_loader = _loader(data["val_x2"][val_rows], data["val_y2"][val_rows])
        for k in (60, 1000):
            counter.take()
            out[f"uneven_acc_sharded_{k}"] = knn.knn_accuracy(identity, bank_loader, val_loader, CLASSES,
                                                              info.device, k=k, T=T, queries_per_step=48,
                                                              bank_block=50)
            out[f"uneven_calls_{k}"], out[f"uneven_sharded_{k}"] = counter.take(), spy.last()
            out[f"uneven_acc_gathered_{k}"] = reference.knn_accuracy_gathered(identity, bank_loader, val_loader,
                                                                        CLASSES, info.device, k=k, T=T)
            out[f"uneven_gathered_{k}"] = spy.last()

        # 2b. Rank 0 holds no bank row at all (the gathered search cannot run this: its padded
        #     all_gather needs the feature width on every rank).
        bank_rows = slice(0, 0) if info.rank == 0 else slice(0, 400)
        val_rows = slice(0, 20) if info.rank == 0 else slice(20, 150)
        out["no_bank_acc"] = knn.knn_accuracy(identity, _loader(data["bank_x2"][bank_rows], data["bank_y2"][bank_rows]),
                                              _loader(data["val_x2"][val_rows], data["val_y2"][val_rows]), CLASSES,
                                              info.device, k=60, T=T, queries_per_step=48)
        out["no_bank"] = spy.last()

        # 3. Collectives per pass for a 4x larger bank: the same number, the same largest tensor.
        val_loader = _sharded_loader(data["val_x2"], data["val_y2"], info)
        for m in (300, 1200):
            bank_loader = _sharded_loader(data["bank_x3"][:m], data["bank_y3"][:m], info)
            counter.take()
            knn.knn_accuracy(identity, bank_loader, val_loader, CLASSES, info.device, k=40, T=T,
                             queries_per_step=32)
            out[f"count_sharded_{m}"] = counter.take()
            reference.knn_accuracy_gathered(identity, bank_loader, val_loader, CLASSES, info.device, k=40, T=T)
            out[f"count_gathered_{m}"] = counter.take()

    # 4. Ties: this rank's rows of the prototype bank (rank 0: 0-54, rank 1: 55-119).
    queries, bank, labels = _tie_data()
    rows = slice(0, 55) if info.rank == 0 else slice(55, 120)
    mine = queries[info.rank::2]
    out["ties"] = {k: knn.knn_predict_sharded(mine, bank[rows], labels[rows], CLASSES, k, T, queries_per_step=8,
                                              bank_block=16) for k in (5, 15, 25)}

    # 5. The bank subset: the same indices on every rank; the shards cover it exactly once.
    subset = bank_subset(TensorDataset(data["bank_x3"]), 500, seed=3)
    out["subset"] = list(subset.indices)
    out["subset_shard"] = [subset.indices[i] for i in ShardedEvalSampler(subset, info.world_size, info.rank)]
    return out


def _data() -> dict:
    bank_x, bank_y = _clusters(601, IN_DIM, seed=1)
    val_x, val_y = _clusters(203, IN_DIM, seed=2)
    bank_x2, bank_y2 = _clusters(400, DIM, seed=3)
    val_x2, val_y2 = _clusters(150, DIM, seed=4)
    bank_x3, bank_y3 = _clusters(1200, DIM, seed=5)
    return dict(bank_x=bank_x, bank_y=bank_y, val_x=val_x, val_y=val_y, bank_x2=bank_x2, bank_y2=bank_y2,
                val_x2=val_x2, val_y2=val_y2, bank_x3=bank_x3, bank_y3=bank_y3)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    data = _data()
    return data, run_on_ranks(_knn_worker, tmp_path_factory.mktemp("knn"), data)


# ----------------------------------------------------------------------------- tests
def test_sharded_equals_gathered_on_two_ranks(two_ranks):
    data, ranks = two_ranks
    with torch.no_grad():
        bank_feats, val_feats = _backbone()(data["bank_x"]), _backbone()(data["val_x"])
    _assert_tie_free(val_feats, bank_feats, data["bank_y"], k=40)
    gathered_order = torch.cat([bank_feats[0::2], bank_feats[1::2]])
    gathered_labels = torch.cat([data["bank_y"][0::2], data["bank_y"][1::2]])
    for rank, r in enumerate(ranks):
        assert r["sharded"]["fn"] == "sharded" and r["gathered"]["fn"] == "gathered"
        assert torch.equal(r["sharded"]["preds"], r["gathered"]["preds"])
        assert torch.equal(r["sharded"]["preds"], _reference(val_feats[rank::2], gathered_order, gathered_labels, 40))
        assert r["acc_sharded"] == r["acc_gathered"] == ranks[0]["acc_sharded"]
        assert r["still_training"]  # the backbone's mode is restored
    correct = sum((r["sharded"]["preds"] == data["val_y"][rank::2]).sum().item() for rank, r in enumerate(ranks))
    assert ranks[0]["acc_sharded"] == pytest.approx(100.0 * correct / 203)
    assert 40 < ranks[0]["acc_sharded"] < 100  # a real vote, not a trivial one


def test_each_rank_keeps_only_its_bank_shard(two_ranks):
    _, ranks = two_ranks
    assert [r["sharded"]["bank_shape"] for r in ranks] == [(301, DIM), (300, DIM)]  # 601 rows, W = 2
    assert [r["gathered"]["bank_shape"] for r in ranks] == [(601, DIM), (601, DIM)]
    assert all(r["sharded"]["bank_dtype"] == torch.float32 for r in ranks)  # CPU default
    assert knn.default_bank_dtype(torch.device("cuda", 0)) == torch.bfloat16
    assert [r["bf16"]["bank_shape"] for r in ranks] == [(301, DIM), (300, DIM)]
    assert all(r["bf16"]["bank_dtype"] == torch.bfloat16 for r in ranks)
    assert [r["bf16"]["bank_bytes"] for r in ranks] == [301 * DIM * 2, 300 * DIM * 2]
    assert [r["gathered"]["bank_bytes"] for r in ranks] == [601 * DIM * 4] * 2


def test_bf16_bank_equals_gathered_search_over_the_bf16_rounded_bank(two_ranks):
    data, ranks = two_ranks
    with torch.no_grad():
        bank_feats, val_feats = _backbone()(data["bank_x"]), _backbone()(data["val_x"])
    rounded = F.normalize(bank_feats, dim=1).bfloat16().float()  # what a bf16 bank holds
    order = torch.cat([rounded[0::2], rounded[1::2]])
    labels = torch.cat([data["bank_y"][0::2], data["bank_y"][1::2]])
    for rank, r in enumerate(ranks):
        expected = reference.knn_predict(F.normalize(val_feats[rank::2], dim=1), order, labels, CLASSES, 40, T)
        assert torch.equal(r["bf16"]["preds"], expected)
    assert abs(ranks[0]["acc_bf16"] - ranks[0]["acc_sharded"]) < 2.0


@pytest.mark.parametrize("k", [60, 1000])
def test_uneven_shards_empty_rank_and_k_beyond_a_shard(two_ranks, k):
    data, ranks = two_ranks
    _assert_tie_free(data["val_x2"], data["bank_x2"], data["bank_y2"], k)
    r0, r1 = ranks
    assert r0[f"uneven_sharded_{k}"]["bank_shape"] == (37, DIM) and len(r0[f"uneven_sharded_{k}"]["preds"]) == 0
    assert r1[f"uneven_sharded_{k}"]["bank_shape"] == (363, DIM)
    assert torch.equal(r1[f"uneven_sharded_{k}"]["preds"], r1[f"uneven_gathered_{k}"]["preds"])
    assert torch.equal(r1[f"uneven_sharded_{k}"]["preds"], _reference(data["val_x2"], data["bank_x2"], data["bank_y2"], k))
    assert r0[f"uneven_acc_sharded_{k}"] == r1[f"uneven_acc_sharded_{k}"] == r1[f"uneven_acc_gathered_{k}"]
    assert len(r0[f"uneven_calls_{k}"]) == len(r1[f"uneven_calls_{k}"]) == _expected_collectives([0, 150], 48)


def test_a_rank_without_bank_rows(two_ranks):
    data, ranks = two_ranks
    assert ranks[0]["no_bank"]["bank_shape"] == (0, 0) and ranks[1]["no_bank"]["bank_shape"] == (400, DIM)
    for r, rows in zip(ranks, (slice(0, 20), slice(20, 150))):
        assert torch.equal(r["no_bank"]["preds"], _reference(data["val_x2"][rows], data["bank_x2"], data["bank_y2"], 60))
    assert ranks[0]["no_bank_acc"] == ranks[1]["no_bank_acc"] == ranks[1]["uneven_acc_sharded_60"]


def test_collectives_per_pass_do_not_grow_with_the_bank(two_ranks):
    _, ranks = two_ranks
    for r in ranks:
        small, large = r["count_sharded_300"], r["count_sharded_1200"]
        assert len(small) == len(large) == _expected_collectives([75, 75], 32)  # 2 + 2 x 5 steps
        assert [name for name, _ in small] == [name for name, _ in large]
        assert max(b for _, b in small) == max(b for _, b in large)  # the largest payload: queries, not bank
        assert {name for name, _ in small} <= {"all_gather_single", "all_gather_into_tensor", "all_to_all_single",
                                               "all_reduce"}
        # Negative control: the gathered search's largest payload is the bank and grows with it.
        assert max(b for _, b in r["count_gathered_1200"]) > 3 * max(b for _, b in r["count_gathered_300"])


def test_sharded_bytes_per_rank_formula_matches_the_tensors(two_ranks):
    """The bench's bank-size formula, ceil(M / W) x D x bytes, against what ranks really held."""
    _, ranks = two_ranks
    assert max(r["sharded"]["bank_bytes"] for r in ranks) == math.ceil(601 / 2) * DIM * 4


def test_ties_go_to_the_lower_bank_position_on_two_ranks_and_one(two_ranks):
    """Copies of one feature must get bit-identical similarities in every block and on every
    rank for the rule to be what separates them: true of MKL for matmuls of >= 16 x 16, which
    the sharded search guarantees by padding (knn._MIN_MATMUL)."""
    _, ranks = two_ranks
    queries, bank, labels = _tie_data()
    differs = 0
    for k in (5, 15, 25):
        expected = _rule_reference(queries, bank, labels, k)
        got = torch.empty(len(queries), dtype=torch.long)
        got[0::2], got[1::2] = ranks[0]["ties"][k], ranks[1]["ties"][k]
        assert torch.equal(got, expected), k
        for qps, block in ((1, 7), (64, 1000)):  # one process, other step and block sizes: the same
            assert torch.equal(knn.knn_predict_sharded(queries, bank, labels, CLASSES, k, T, queries_per_step=qps,
                                                       bank_block=block), expected)
        differs += (expected != _rule_reference(queries, bank, labels, k, lowest_first=False)).sum().item()
    assert differs > 0  # the rule decides some predictions: the test can fail


def test_one_process_no_collectives_equals_gathered():
    assert not dist.is_initialized()
    bank_x, bank_y = _clusters(500, IN_DIM, seed=11)
    val_x, val_y = _clusters(130, IN_DIM, seed=12)
    with torch.no_grad():
        _assert_tie_free(_backbone()(val_x), _backbone()(bank_x), bank_y, k=200)
    spy, counter = Spy(), CollectiveCounter()
    with spy.installed(), counter.installed():
        for k in (200, 600):  # k > M too
            acc = knn.knn_accuracy(_backbone(), _loader(bank_x, bank_y), _loader(val_x, val_y), CLASSES,
                                   torch.device("cpu"), k=k, T=T, queries_per_step=50, bank_block=64)
            sharded = spy.last()
            ref = reference.knn_accuracy_gathered(_backbone(), _loader(bank_x, bank_y), _loader(val_x, val_y), CLASSES,
                                            torch.device("cpu"), k=k, T=T)
            assert acc == ref and torch.equal(sharded["preds"], spy.last()["preds"])
            assert sharded["bank_shape"] == (500, DIM)
    assert counter.calls == []


def test_bank_subset_is_seeded_and_independent_of_world_size(two_ranks):
    data, ranks = two_ranks
    full = TensorDataset(data["bank_x3"])
    subset = bank_subset(full, 500, seed=3)
    assert ranks[0]["subset"] == ranks[1]["subset"] == list(subset.indices)  # 2 ranks == 1 process
    assert sorted(ranks[0]["subset_shard"] + ranks[1]["subset_shard"]) == list(subset.indices)
    assert list(bank_subset(full, 500, seed=3).indices) == list(subset.indices)  # across calls
    assert len(subset) == 500 and len(set(subset.indices)) == 500
    assert list(subset.indices) == sorted(subset.indices) and subset.indices[-1] < 1200
    assert list(bank_subset(full, 500, seed=4).indices) != list(subset.indices)
    assert set(subset.indices) < set(bank_subset(full, 700, seed=3).indices)  # nested in n
    assert list(bank_subset(full, 1200, seed=3).indices) == list(range(1200))
    assert list(bank_subset(full, 10**9, seed=3).indices) == list(range(1200))
    # Pinned: a change of algorithm would silently change every resumed run's monitor.
    assert list(bank_subset(list(range(100)), 10, seed=0).indices) == [0, 3, 11, 12, 18, 37, 41, 65, 87, 99]
    assert torch.equal(subset[0][0], data["bank_x3"][subset.indices[0]])


@pytest.mark.parametrize("T", [0.005, 0.01])
def test_a_small_temperature_does_not_overflow_the_votes(T):
    """exp(1 / T) exceeds the fp32 maximum below T = 0.0113: unshifted weights become inf and the
    argmax falls to the lowest tied class. One query; class 0 has three keys at cosine 0.95, 0.96
    and 0.97, class 1 one at 0.999: by a float64 computation class 1 wins."""
    cosines = torch.tensor([0.95, 0.96, 0.97, 0.999], dtype=torch.float64)
    labels = torch.tensor([0, 0, 0, 1])
    query = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    bank = torch.stack([cosines, (1 - cosines**2).sqrt()], dim=1)  # unit rows: query . row = cosine
    votes = torch.zeros(1, 2, dtype=torch.float64).scatter_add_(1, labels[None], ((query @ bank.T) / T).exp())
    assert votes.isfinite().all() and votes.argmax().item() == 1
    assert not (torch.tensor(1.0) / T).exp().isfinite()  # the case the shift must handle
    preds = knn.knn_predict_sharded(query.float(), bank.float(), labels, num_classes=2, k=4, T=T)
    assert preds.tolist() == [1]


def test_feature_extraction_copies_without_waiting_in_the_networks_layout_under_autocast(monkeypatch):
    """Per batch: images and labels go to the device with non_blocking copies (a blocking one
    waits for the GPU to finish the previous batch), in the network's memory format (CUDA:
    channels_last), and the backbone runs under the run's autocast."""
    import ddp_utils.runtime.device as device_mod

    copies, seen = [], []
    to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        if isinstance(args[0] if args else kwargs.get("device"), (torch.device, str)):  # a copy to a device
            copies.append(kwargs.get("non_blocking", False))
        return to(self, *args, **kwargs)

    class Recorder(nn.Module):
        def forward(self, x):
            seen.append((x.is_contiguous(memory_format=torch.channels_last), torch.is_autocast_enabled("cpu")))
            return nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)

    monkeypatch.setattr(device_mod, "memory_format", lambda device: torch.channels_last)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    x, y = torch.randn(10, 3, 4, 4), torch.arange(10)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    feats, labels = knn.extract_features(Recorder(), loader, torch.device("cpu"), amp="bf16")
    monkeypatch.setattr(torch.Tensor, "to", to)
    assert len(seen) == 3 and all(seen_cl and autocast for seen_cl, autocast in seen)
    assert copies == [True] * 6  # images and labels of every batch
    assert feats.dtype == torch.float32 and torch.equal(labels, y)
    torch.testing.assert_close(feats, F.normalize(x.mean(dim=(2, 3)), dim=1), rtol=0, atol=1e-2)  # bf16
