"""Data-parallel training (tinysn/distributed.py): two gloo ranks on 127.0.0.1 against a
float64 torch reference, gradient buckets, the plan's extended gradient liveness, and the
input checks."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import given, strategies as st

import tinysn as sn
import tinysn.testing as snt
from tinysn import distributed
from tinysn.sched import liveness

WORLD, LOCAL_BATCH, STEPS = 2, 2, 2
LR, MOMENTUM, WD = 0.1, 0.9, 0.01
SMALL_BUCKET = 1000     # deep_net's buckets under it: [fc], [c5, c4], [c3, c2], [c1]
ONE_BUCKET = "1GiB"     # every gradient in one bucket


def conv_net(batch=LOCAL_BATCH):
    """conv, relu, fc: no batch norm, so every rank's loss is a plain mean over its shard."""
    net = sn.Net(input_shape=(2, 6, 6), classes=3, batch=batch)
    h = net.relu(net.conv(net.data(), 4, kernel=3, padding=1, name="c1"))
    net.softmax_loss(net.fc(h, 3, name="fc"))
    return net


def bn_net(batch=LOCAL_BATCH):
    """conv, bn, relu, fc: batch norm normalises with each rank's own batch statistics."""
    net = sn.Net(input_shape=(2, 6, 6), classes=3, batch=batch)
    h = net.relu(net.bn(net.conv(net.data(), 4, kernel=3, padding=1, name="c1"), name="bn"))
    net.softmax_loss(net.fc(h, 3, name="fc"))
    return net


def deep_net(batch=LOCAL_BATCH):
    """Five 3x3 convs (592 gradient bytes each from c2 on, 304 for c1) and an fc (1,740):
    SMALL_BUCKET groups them into several buckets of two layers and two of one."""
    net = sn.Net(input_shape=(2, 6, 6), classes=3, batch=batch)
    h = net.data()
    for i in range(1, 6):
        h = net.relu(net.conv(h, 4, kernel=3, padding=1, name=f"c{i}"))
    net.softmax_loss(net.fc(h, 3, name="fc"))
    return net


def global_batch(net, step):
    """The concatenated batch of all ranks at iteration `step` (the same on every rank)."""
    gen = torch.Generator().manual_seed(100 + step)
    images = torch.randn((WORLD * net.batch, *net.input_shape), generator=gen)
    labels = torch.randint(0, net.classes, (WORLD * net.batch,), generator=gen)
    return images, labels


def _train(net, policy, rank, bucket_bytes=liveness.BUCKET_BYTES):
    """STEPS iterations of rank `rank` (seeded by its rank: the broadcast must undo that)."""
    rt = sn.Runtime(net, "4MiB", policy, device="cpu", lr=LR, momentum=MOMENTUM,
                    weight_decay=WD, seed=rank, precision="ieee", conv_algos={},
                    process_group=dist.group.WORLD, bucket_bytes=bucket_bytes)
    initial, losses = rt.params(), []
    for step in range(STEPS):
        images, labels = distributed.shard(*global_batch(net, step), rank, WORLD)
        losses.append(rt.step(images, labels))
    return {"initial": initial, "final": rt.params(), "losses": losses,
            "peak": rt.stats.peak_bytes, "planned": rt.plan.peak_bytes,
            "buckets": [[layer.name for layer in b] for b in rt.program.buckets]}


def _worker(rank, port, out_dir):
    """One rank, set up as torchrun would (distributed.from_env): trains every case and
    saves what it measured for the parent to check."""
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    group, got_rank, world = distributed.from_env("cpu")
    assert (got_rank, world, dist.get_backend(group)) == (rank, WORLD, "gloo")
    try:
        results = {("conv", policy): _train(conv_net(), policy, rank) for policy in sn.POLICIES}
        results[("conv", "again")] = _train(conv_net(), "all", rank)
        results[("bn", "all")] = _train(bn_net(), "all", rank)
        for policy in sn.POLICIES:
            results[("small", policy)] = _train(deep_net(), policy, rank, SMALL_BUCKET)
        results[("one", "all")] = _train(deep_net(), "all", rank, ONE_BUCKET)
        coalescing, distributed.COALESCING_BACKENDS = distributed.COALESCING_BACKENDS, ()
        try:                                   # one call per tensor inside each bucket
            results[("per tensor", "all")] = _train(deep_net(), "all", rank, SMALL_BUCKET)
        finally:
            distributed.COALESCING_BACKENDS = coalescing
        try:                                   # rank 1 builds a larger local batch
            sn.Runtime(conv_net(batch=LOCAL_BATCH + rank), "4MiB", device="cpu",
                       process_group=group)
        except ValueError as err:
            results["mismatch"] = str(err)
        try:                                   # rank 1 asks for other buckets
            sn.Runtime(conv_net(), "4MiB", device="cpu", process_group=group,
                       bucket_bytes=SMALL_BUCKET + rank)
        except ValueError as err:
            results["other buckets"] = str(err)
        try:                                   # rank 1's cap is too small
            sn.Runtime(conv_net(), "4MiB" if rank == 0 else "8KiB", device="cpu",
                       process_group=group)
        except sn.OutOfMemory as err:
            results["too_small"] = str(err)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.close(group)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the two gloo ranks measured (one spawn for every test here)."""
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(distributed.free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def reference(net, per_rank_bn: bool):
    """Float64 torch training from rank 0's initial parameters: the loss is the mean over
    the concatenated batch; with `per_rank_bn` it is the mean of the ranks' losses, each
    computed with that rank's batch statistics and running buffers (DDP without
    SyncBatchNorm). Returns (parameters, each rank's running buffers, mean losses)."""
    model = net.to_torch(seed=0).double()
    buffers = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(WORLD)]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        images, labels = global_batch(net, step)
        opt.zero_grad()
        if per_rank_bn:          # each rank's forward updates its own buffers in place
            loss = 0
            for rank in range(WORLD):
                x, y = distributed.shard(images, labels, rank, WORLD)
                logits = torch.func.functional_call(model, buffers[rank], (x.double(),))
                loss = loss + F.cross_entropy(logits, y) / WORLD
        else:
            loss = model.loss(images.double(), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {k: v.detach() for k, v in model.named_parameters()}
    return params, buffers, losses


def _close(ours, theirs, what):
    torch.testing.assert_close(ours.double(), theirs, rtol=2e-4, atol=2e-5,
                               msg=lambda m: f"{what}: {m}")


def test_ranks_start_from_rank0_parameters(ranks):
    expected = conv_net().init_params(0)
    for rank in range(WORLD):            # rank 1 was seeded 1: the broadcast replaced that
        for name, value in ranks[rank][("conv", "baseline")]["initial"].items():
            assert torch.equal(value, expected[name]), f"rank {rank} {name}"


@pytest.mark.parametrize("policy", sn.POLICIES)
def test_two_ranks_equal_single_process_on_concatenated_batch(ranks, policy):
    params, _, losses = reference(conv_net(), per_rank_bn=False)
    for rank in range(WORLD):
        run = ranks[rank][("conv", policy)]
        assert run["peak"] == run["planned"], f"rank {rank}: peak != plan"
        for name, value in run["final"].items():
            _close(value, params[name], f"rank {rank} {name}")
    for step in range(STEPS):
        mean = sum(ranks[r][("conv", policy)]["losses"][step] for r in range(WORLD)) / WORLD
        assert mean == pytest.approx(losses[step], rel=1e-5), f"step {step}"


def test_ranks_agree_bitwise_across_policies_and_runs(ranks):
    for rank in range(WORLD):
        first = ranks[rank][("conv", "baseline")]["final"]
        for key in [*(("conv", p) for p in sn.POLICIES), ("conv", "again")]:
            for name, value in ranks[rank][key]["final"].items():
                assert torch.equal(value, first[name]), f"rank {rank} {key} {name}"
        for name, value in ranks[0][("conv", "all")]["final"].items():
            assert torch.equal(value, ranks[rank][("conv", "all")]["final"][name]), name


def test_ranks_with_different_nets_refuse_together(ranks):
    for rank in range(WORLD):
        assert "build different networks" in ranks[rank].get("mismatch", ""), rank


def test_a_cap_too_small_on_one_rank_stops_every_rank(ranks):
    assert "another rank's plan does not fit" in ranks[0].get("too_small", "")
    assert "plan does not fit" in ranks[1].get("too_small", "")


def test_batch_norm_keeps_per_rank_statistics_as_ddp(ranks):
    params, buffers, _ = reference(bn_net(), per_rank_bn=True)
    for rank in range(WORLD):
        final = ranks[rank][("bn", "all")]["final"]
        for name, value in params.items():
            _close(final[name], value, f"rank {rank} {name}")
        for name, value in buffers[rank].items():
            _close(final[name], value, f"rank {rank} {name}")
    assert not torch.equal(ranks[0][("bn", "all")]["final"]["bn.running_mean"],
                           ranks[1][("bn", "all")]["final"]["bn.running_mean"])


@pytest.mark.parametrize("key", [*(("small", p) for p in sn.POLICIES), ("one", "all"),
                                 ("per tensor", "all")], ids=" ".join)
def test_buckets_equal_single_process_on_concatenated_batch(ranks, key):
    """Several two-layer buckets (every policy; coalesced, and one call per tensor) and a
    single bucket all train as one process on the concatenated batch, with peak == plan."""
    expected = ([["fc"], ["c5", "c4"], ["c3", "c2"], ["c1"]] if key[0] != "one"
                else [["fc", "c5", "c4", "c3", "c2", "c1"]])
    params, _, losses = reference(deep_net(), per_rank_bn=False)
    for rank in range(WORLD):
        run = ranks[rank][key]
        assert run["buckets"] == expected, run["buckets"]
        assert run["peak"] == run["planned"], f"rank {rank}: peak != plan"
        for name, value in run["final"].items():
            _close(value, params[name], f"rank {rank} {key} {name}")
            assert torch.equal(value, ranks[0][("small", "baseline")]["final"][name]), name
    for step in range(STEPS):
        mean = sum(ranks[r][key]["losses"][step] for r in range(WORLD)) / WORLD
        assert mean == pytest.approx(losses[step], rel=1e-5), f"step {step}"


def test_ranks_with_other_buckets_refuse_together(ranks):
    for rank in range(WORLD):
        assert "same bucket_bytes" in ranks[rank].get("other buckets", ""), rank


# -- two GPUs: NCCL, eager and graphed -------------------------------------------------
def _gpu_net():
    return sn.models.resnet(blocks=[1, 1, 1, 1], batch=4, classes=10, input_shape=(3, 32, 32))


def _gpu_worker(rank, port, out_dir):
    """One NCCL rank: each policy eager and graphed side by side, five steps each (two
    eager warm-ups, the capture, two replays), the gradients in several 4 MiB buckets
    (coalesced NCCL all-reduces); saves losses, parameters and the buckets."""
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    group, _, _ = distributed.from_env("cuda")
    try:
        results = {}
        for policy in ("baseline", "offload", "all"):
            runs = [sn.Runtime(_gpu_net(), "4GiB", policy, device="cuda", lr=0.05,
                               momentum=0.9, seed=rank, conv_algos={}, cuda_graph=graph,
                               process_group=group, bucket_bytes="4MiB")
                    for graph in (False, True)]
            losses = [[], []]
            for step in range(5):
                images, labels = distributed.shard(*global_batch(_gpu_net(), step), rank, WORLD)
                for i, rt in enumerate(runs):
                    losses[i].append(rt.step(images.cuda(), labels.cuda()))
            results[policy] = {"losses": losses, "params": [rt.params() for rt in runs],
                               "buckets": len(runs[0].program.buckets),
                               "peak_equals_plan": [rt.stats.peak_bytes == rt.plan.peak_bytes
                                                    for rt in runs]}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.close(group)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_ranks_agree_and_graph_replays_match_eager(tmp_path):
    """On two GPUs: graphed steps (the all-reduces captured) equal eager ones bit for bit,
    every rank ends with the same parameters, and peak == plan."""
    mp.spawn(_gpu_worker, args=(distributed.free_port(), str(tmp_path)), nprocs=WORLD,
             join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for policy, run in ranks[0].items():
        for rank in range(WORLD):
            mine = ranks[rank][policy]
            assert all(mine["peak_equals_plan"]), (policy, rank)
            assert mine["buckets"] > 2, (policy, rank)
            assert mine["losses"][0] == mine["losses"][1], (policy, rank)
            for name, value in mine["params"][1].items():
                assert torch.equal(value, mine["params"][0][name]), (policy, rank, name)
                if not name.endswith(("running_mean", "running_var")):
                    assert torch.equal(value, run["params"][0][name]), (policy, rank, name)


# -- single process: the plan and the checks --------------------------------------------
def _launch_index(plan, logical):
    """Executed step index of the Launch of layer pass `logical`."""
    return next(s.index for s in plan.steps for op in s.ops
                if type(op).__name__ == "Launch" and op.key == logical)


def test_group_buckets_closes_each_bucket_at_the_threshold():
    sizes = [("a", 5), ("b", 3), ("c", 4), ("d", 10), ("e", 1), ("f", 1)]
    assert liveness.group_buckets(sizes, 8) == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert liveness.group_buckets(sizes, 1) == [[name] for name, _ in sizes]
    assert liveness.group_buckets(sizes, 1 << 30) == [["a", "b", "c", "d", "e", "f"]]
    assert liveness.group_buckets(sizes, 23) == [["a", "b", "c", "d", "e"], ["f"]]
    assert liveness.group_buckets([], 8) == []


def test_program_starts_each_bucket_after_its_last_layer_and_updates_it_later():
    net = deep_net()
    single = liveness.Program(net)
    parallel = liveness.Program(net, data_parallel=True, bucket_bytes=SMALL_BUCKET)
    backward = {lp.layer: lp for lp in parallel.passes if lp.phase == "backward"}
    last = len(parallel.passes) - 1
    assert [len(b) for b in parallel.buckets] == [1, 2, 2, 1]
    assert single.buckets == [] and single.reduces == {}
    for bucket in parallel.buckets:
        start = backward[bucket[-1]].index
        at = min(start + liveness.UPDATE_LAG, last)
        assert parallel.reduces[start] == bucket and bucket in parallel.updates[at]
        for layer in bucket:
            assert single.updates[backward[layer].index] == [(layer,)]
            for suffix in layer.params:
                tid = parallel.pgrad[f"{layer.name}.{suffix}"]
                assert tid in parallel.passes[start].reads + parallel.passes[start].writes
                assert parallel.last_use(tid) == at
                assert single.last_use(tid) == backward[layer].index


@pytest.mark.parametrize("policy", sn.POLICIES)
def test_plan_keeps_gradients_until_their_update(policy):
    net = deep_net()
    plan = sn.plan(net, "4MiB", policy, momentum=MOMENTUM, data_parallel=True,
                   bucket_bytes=SMALL_BUCKET)
    snt.check_plan(plan)
    rows = {r["tensor"]: r for r in plan.placements()}
    for at, buckets in plan.program.updates.items():
        for layer in (layer for bucket in buckets for layer in bucket):
            for suffix in layer.params:
                row = rows[f"{layer.name}.{suffix}.grad"]   # baseline: kept throughout
                assert row["ends"] == "kept" or row["last"] >= _launch_index(plan, at), row
    single = sn.plan(net, "4MiB", policy, momentum=MOMENTUM)
    assert plan.peak_bytes >= single.peak_bytes


@snt.settings(10)
@given(net=snt.nets(), policy=snt.policies(), bucket_bytes=st.integers(1, 4096),
       data=st.data())
def test_every_data_parallel_plan_is_a_correct_schedule(net, policy, bucket_bytes, data):
    """Random nets, policies, bucket sizes and caps down to the smallest: every gradient of
    a bucket is on the device when its all-reduce starts and when its updates run."""
    options = {"momentum": MOMENTUM, "data_parallel": True, "bucket_bytes": bucket_bytes}
    cap = data.draw(snt.caps(net, policy, **options))
    snt.check_plan(sn.plan(net, cap, policy, **options))


def test_bad_process_group_raises_before_planning():
    with pytest.raises(ValueError, match="not initialized"):
        sn.Runtime(conv_net(), "4MiB", "all", device="cpu", process_group=object())
    with pytest.raises(ValueError, match="data_parallel must be a bool"):
        sn.plan(conv_net(), "4MiB", "all", data_parallel=1)
    for bad in (0, "lots", 1.5, True):
        with pytest.raises(ValueError, match="bucket_bytes must be a positive number"):
            sn.Runtime(conv_net(), "4MiB", "all", device="cpu", bucket_bytes=bad)
        with pytest.raises(ValueError, match="bucket_bytes must be a positive number"):
            sn.plan(conv_net(), "4MiB", "all", data_parallel=True, bucket_bytes=bad)


def test_shard_and_environment():
    images, labels = torch.arange(12.).view(6, 2), torch.arange(6)
    x, y = distributed.shard(images, labels, 1, 3)
    assert torch.equal(y, torch.tensor([2, 3])) and torch.equal(x, images[2:4])
    with pytest.raises(ValueError, match="does not split evenly"):
        distributed.shard(images, labels, 0, 4)
    if "WORLD_SIZE" not in os.environ:
        assert distributed.from_env("cpu") == (None, 0, 1)


def test_bench_scaling_per_side_and_its_arguments():
    from bench import ddp
    runs = {"1": {"tinysn": {"images_per_s": 100.0}, "pytorch": {"images_per_s": 200.0}},
            "2": {"tinysn": {"images_per_s": 190.0}, "pytorch": {"error": "failed"}}}
    assert ddp.scaling(runs, 2) == {"tinysn": pytest.approx(1.9), "pytorch": None}
    assert ddp.scaling({"1": {"error": "failed"}}, 2) == {"tinysn": None, "pytorch": None}
    for bad in (["--configs", "b32,nope"], ["--gpus", "1"], ["--warmup", "1"]):
        with pytest.raises(SystemExit):
            ddp.parse_args(bad)
