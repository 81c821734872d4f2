"""Data-parallel training (tinysn/distributed.py): two gloo ranks on 127.0.0.1 against a
float64 torch reference, the plan's extended gradient liveness, and the input checks."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import tinysn as sn
from tinysn import distributed
from tinysn.sched import liveness

WORLD, LOCAL_BATCH, STEPS = 2, 2, 2
LR, MOMENTUM, WD = 0.1, 0.9, 0.01


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


def global_batch(net, step):
    """The concatenated batch of all ranks at iteration `step` (the same on every rank)."""
    gen = torch.Generator().manual_seed(100 + step)
    images = torch.randn((WORLD * net.batch, *net.input_shape), generator=gen)
    labels = torch.randint(0, net.classes, (WORLD * net.batch,), generator=gen)
    return images, labels


def _train(net, policy, rank):
    """STEPS iterations of rank `rank` (seeded by its rank: the broadcast must undo that)."""
    rt = sn.Runtime(net, "4MiB", policy, device="cpu", lr=LR, momentum=MOMENTUM,
                    weight_decay=WD, seed=rank, precision="ieee", conv_algos={},
                    process_group=dist.group.WORLD)
    initial, losses = rt.params(), []
    for step in range(STEPS):
        images, labels = distributed.shard(*global_batch(net, step), rank, WORLD)
        losses.append(rt.step(images, labels))
    return {"initial": initial, "final": rt.params(), "losses": losses,
            "peak": rt.stats.peak_bytes, "planned": rt.plan.peak_bytes}


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
        try:                                   # rank 1 builds a larger local batch
            sn.Runtime(conv_net(batch=LOCAL_BATCH + rank), "4MiB", device="cpu",
                       process_group=group)
        except ValueError as err:
            results["mismatch"] = str(err)
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


# -- two GPUs: NCCL, eager and graphed -------------------------------------------------
def _gpu_net():
    return sn.models.resnet(blocks=[1, 1, 1, 1], batch=4, classes=10, input_shape=(3, 32, 32))


def _gpu_worker(rank, port, out_dir):
    """One NCCL rank: each policy eager and graphed side by side, five steps each (two
    eager warm-ups, the capture, two replays); saves losses and parameters."""
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    group, _, _ = distributed.from_env("cuda")
    try:
        results = {}
        for policy in ("baseline", "offload", "all"):
            runs = [sn.Runtime(_gpu_net(), "4GiB", policy, device="cuda", lr=0.05,
                               momentum=0.9, seed=rank, conv_algos={}, cuda_graph=graph,
                               process_group=group) for graph in (False, True)]
            losses = [[], []]
            for step in range(5):
                images, labels = distributed.shard(*global_batch(_gpu_net(), step), rank, WORLD)
                for i, rt in enumerate(runs):
                    losses[i].append(rt.step(images.cuda(), labels.cuda()))
            results[policy] = {"losses": losses, "params": [rt.params() for rt in runs],
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


def test_program_defers_each_update_by_the_lag():
    net = bn_net()
    single, parallel = liveness.Program(net), liveness.Program(net, data_parallel=True)
    last = len(parallel.passes) - 1
    for step in parallel.passes:
        if step.phase == "backward" and step.layer.params:
            at = min(step.index + liveness.UPDATE_LAG, last)
            assert step.layer in single.updates[step.index]
            assert step.layer in parallel.updates[at]
            for suffix in step.layer.params:
                tid = parallel.pgrad[f"{step.layer.name}.{suffix}"]
                assert parallel.last_use(tid) == at
                assert single.last_use(tid) == step.index


@pytest.mark.parametrize("policy", [p for p in sn.POLICIES if p != "baseline"])
def test_plan_keeps_gradients_until_their_update(policy):
    net = bn_net()
    plan = sn.plan(net, "4MiB", policy, momentum=MOMENTUM, data_parallel=True)
    program = plan.program
    rows = {r["tensor"]: r for r in plan.placements()}
    for at, layers in program.updates.items():
        for layer in layers:
            for suffix in layer.params:
                row = rows[f"{layer.name}.{suffix}.grad"]
                assert row["last"] >= _launch_index(plan, at), row
    single = sn.plan(net, "4MiB", policy, momentum=MOMENTUM)
    assert plan.peak_bytes >= single.peak_bytes


def test_bad_process_group_raises_before_planning():
    with pytest.raises(ValueError, match="not initialized"):
        sn.Runtime(conv_net(), "4MiB", "all", device="cpu", process_group=object())
    with pytest.raises(ValueError, match="data_parallel must be a bool"):
        sn.plan(conv_net(), "4MiB", "all", data_parallel=1)


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
