"""The runtime against a float64 torch model of the same graph, and its input checks."""
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import tinysn as sn
from tinysn import distributed
from tinysn.kernels._common import INTERPRET
from tinysn.testing import block_net, every_layer_net, smallest_cap
from tinysn.trace import Recorder


def batch_for(net, seed=1):
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn((net.batch, *net.input_shape), generator=gen)
    labels = torch.randint(0, net.classes, (net.batch,), generator=gen)
    return images, labels


def stem_net(batch):
    """ResNet's stem (conv, batch norm, ReLU, max pool 3x3/2) and VGG's conv, ReLU, max pool
    2x2/2: where the net fits unmoved both pools store their argmaxes and take the ReLU's
    mask from their bytes."""
    net = sn.Net(input_shape=(3, 12, 12), classes=4, batch=batch)
    h = net.relu(net.bn(net.conv(net.data(), 8, kernel=3, padding=1, bias=False)))
    h = net.pool(h, "max", 3, stride=2, padding=1, name="stem_pool")
    h = net.pool(net.relu(net.conv(h, 8, kernel=3, padding=1)), "max", 2, name="pool2")
    net.softmax_loss(net.fc(h, 4))
    return net


@pytest.mark.parametrize("make,policy", [(every_layer_net, "baseline"),
                                         (every_layer_net, "offload"),
                                         (lambda batch: block_net(batch, p=0.0), "recompute"),
                                         (stem_net, "all")])
def test_three_sgd_steps_match_torch_float64(make, policy):
    net = make(batch=3)
    lr, momentum, wd = 0.05, 0.9, 1e-3
    rt = sn.Runtime(net, "64MiB", policy, device="cpu", lr=lr, momentum=momentum,
                    weight_decay=wd, seed=3, precision="ieee")
    ref = net.to_torch(params=rt.params()).double()
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    if make is stem_net:
        pools = [layer for layer in rt.plan.net.layers if layer.op == "pool"]
        assert all(p.attrs["saves_argmax"] and p.attrs["x_is_relu_output"] for p in pools)
    for i in range(3):
        images, labels = batch_for(net, seed=10 + i)
        loss = rt.step(images, labels)
        opt.zero_grad()
        ref_loss = ref.loss(images.double(), labels)
        ref_loss.backward()
        opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-4, abs=1e-5), f"step {i}"
    if policy == "recompute":
        assert rt.plan.recomputed_steps > 0       # batch norms were rebuilt, not re-updated
    ours, theirs = rt.params(), ref.state_dict()
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        torch.testing.assert_close(value.double(), theirs[name], rtol=2e-4, atol=2e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_bad_input_raises_before_any_change():
    net = every_layer_net(batch=2)
    rt = sn.Runtime(net, "64MiB", "liveness", device="cpu", seed=0)
    before = rt.params()
    images, labels = batch_for(net)
    bad = [
        (images[:1], labels),                        # wrong batch
        (images.double(), labels),                   # wrong dtype
        (images, labels.int()),                      # wrong label dtype
        (images, labels + net.classes),              # label out of range
        (images, -labels - 1),                       # negative label
        (images[:, :2], labels),                     # wrong channels
        (images * float("nan"), labels),             # NaN input
    ]
    for x, y in bad:
        with pytest.raises(ValueError):
            rt.step(x, y)
    state = rt.state_dict()
    for name, value in (("lr", float("nan")), ("lr", -0.1), ("momentum", float("inf")),
                        ("weight_decay", "0")):     # a schedule's slip: named at the step
        setattr(rt, name, value)
        with pytest.raises(ValueError, match=f"{name} must be a finite non-negative number"):
            rt.step(images, labels)
        rt.lr, rt.momentum, rt.weight_decay = 0.01, 0.0, 0.0
    after = rt.params()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    for key, value in rt.state_dict().items():     # batch-norm running statistics too
        assert not isinstance(value, torch.Tensor) or torch.equal(value, state[key]), key
    assert rt.stats.iterations == 0


def test_training_steps_after_the_first_skip_the_tensor_checks(monkeypatch):
    """The first training step checks every launch's tensors; the steps after it repeat
    the same launches on the same views, inside `checked_before` (the checks return at
    once), with the same results as steps that check; a kernel called directly between
    steps still refuses bad tensors."""
    from tinysn.kernels import _common, sgd
    seen = []
    real = sgd.update_many

    def spy(*args, **kwargs):
        seen.append(_common._CHECKED_BEFORE[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(sgd, "update_many", spy)
    net = block_net(batch=2, p=0.3)
    rt, plain = (sn.Runtime(net, "64MiB", "all", device="cpu", conv_algos={}, lr=0.1,
                            momentum=0.9) for _ in range(2))
    batches = [batch_for(net, seed=s) for s in range(3)]
    losses = []
    for i, batch in enumerate(batches):
        seen.clear()
        losses.append(rt.step(*batch))
        assert seen and all(flag == (i > 0) for flag in seen), i
        assert not _common._CHECKED_BEFORE[0]
        with pytest.raises(ValueError, match="grad"):
            sgd.update(torch.zeros(3), torch.zeros(4), None, lr=0.1, momentum=0.0,
                       weight_decay=0.0)
    for batch, loss in zip(batches, losses):
        plain._walked = False                # every step of this one checks
        assert plain.step(*batch) == loss
    assert all(torch.equal(v, plain.params()[k]) for k, v in rt.params().items())


def test_a_learning_rate_set_between_steps_is_the_next_steps():
    """`rt.lr` may change before any step (a schedule); the updates read it from the pool
    (written there at the step's start), so a rate of 0 leaves the parameters as they were
    (no momentum, no weight decay) and the next rate moves them again, bit for bit as a
    Runtime built with that rate moves the same parameters."""
    net = block_net(batch=2, p=0.0)
    rt, fresh = (sn.Runtime(net, "64MiB", "all", device="cpu", conv_algos={}, lr=0.1)
                 for _ in range(2))
    batches = [batch_for(net, seed=s) for s in range(3)]
    def learned(run):     # the parameters alone (params() has the running statistics too)
        return {k: v for k, v in run.params().items() if k.endswith(("weight", "bias"))}
    rt.step(*batches[0])
    moved = learned(rt)
    rt.lr = 0.0
    rt.step(*batches[1])
    assert all(torch.equal(v, moved[k]) for k, v in learned(rt).items())
    rt.lr = 0.05
    fresh.load_state_dict(rt.state_dict())
    fresh.lr = 0.05
    assert rt.step(*batches[2]) == fresh.step(*batches[2])
    assert all(torch.equal(v, learned(fresh)[k]) for k, v in learned(rt).items())
    assert not any(torch.equal(v, moved[k]) for k, v in learned(rt).items())


@pytest.mark.parametrize("bad", ["nan", "label"])
def test_a_batch_checked_in_the_step_changes_no_state_when_bad(bad):
    """On one GPU the batch is counted by the step's first kernels and the count read with
    the loss (forced here on the CPU): a bad batch raises after its step, which skipped
    every write of training state (parameters, momentum, batch-norm running statistics,
    the dropout counter), so the steps after it equal a run's that never saw it, bitwise."""
    refuses_bad_batches_without_a_trace("cpu", False, [bad], force=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_a_bad_batch_on_the_gpu_changes_no_state(cuda_graph):
    """The same on the GPU, where the check is in the step by default, eager and replayed
    (the bad batches come after the capture)."""
    refuses_bad_batches_without_a_trace("cuda", cuda_graph, ["nan", "label"])


def refuses_bad_batches_without_a_trace(device, cuda_graph, bad, force=False):
    """Two Runtimes train on the same good batches; one is also handed the `bad` batches
    (NaN images, out-of-range labels) after three good steps: each raises, naming the
    problem, and after them both runs' losses and whole states stay bitwise equal."""
    net = block_net(batch=2, p=0.3)
    runs = [sn.Runtime(net, "64MiB", "all", device=device, conv_algos={}, seed=0, lr=0.1,
                       momentum=0.9, weight_decay=1e-3, cuda_graph=cuda_graph)
            for _ in range(2)]
    if force:
        runs[0]._check_on_device(True)
    assert runs[0].gate is not None
    good = [batch_for(net, seed=s) for s in range(1, 6)]
    for batch in good[:3]:
        assert runs[0].step(*batch) == runs[1].step(*batch)
    images, labels = good[0]
    refused = {"nan": ((images * float("nan"), labels), "NaN"),
               "label": ((images, labels + net.classes), "labels must lie")}
    for kind in bad:
        batch, message = refused[kind]
        with pytest.raises(ValueError, match=message):
            runs[0].step(*batch)
    assert runs[0].stats.iterations == 3
    for batch in good[3:]:
        assert runs[0].step(*batch) == runs[1].step(*batch)
    gated, plain = (rt.state_dict() for rt in runs)
    assert gated.keys() == plain.keys()
    for key, value in gated.items():
        assert not isinstance(value, torch.Tensor) or torch.equal(value, plain[key]), key
    for rt in runs:
        rt.close()


def test_bad_runtime_arguments():
    net = every_layer_net()
    with pytest.raises(ValueError, match="policy"):
        sn.Runtime(net, "64MiB", "fastest", device="cpu")
    with pytest.raises(ValueError, match="lr"):
        sn.Runtime(net, "64MiB", "liveness", device="cpu", lr=-1)
    with pytest.raises(ValueError):
        sn.Runtime(net, "lots", "liveness", device="cpu")
    with pytest.raises(ValueError, match="device"):
        sn.Runtime(net, "64MiB", "liveness", device="tpu")


def test_bn_over_one_value_per_channel_is_refused_when_built_but_plans():
    """Training-mode batch norm of a single value has no variance (PyTorch refuses it at
    run time); the Runtime says so when it is built, a dry run still plans the net."""
    net = sn.Net(input_shape=(2, 1, 1), classes=2, batch=1)
    net.softmax_loss(net.fc(net.bn(net.data()), 2))
    assert sn.plan(net, "1MiB", "liveness").peak_bytes > 0
    with pytest.raises(ValueError, match="more than one value per channel"):
        sn.Runtime(net, "1MiB", "liveness", device="cpu")
    wide = sn.Net(input_shape=(2, 1, 1), classes=2, batch=2)
    wide.softmax_loss(wide.fc(wide.bn(wide.data()), 2))
    sn.Runtime(wide, "1MiB", "liveness", device="cpu").close()


def test_cap_too_small_fails_before_any_kernel_names_step():
    net = every_layer_net()
    need = sn.plan(net, "64MiB", "liveness").peak_bytes
    with pytest.raises(sn.OutOfMemory, match=r"step \d+ \(.*layer") as err:
        sn.Runtime(net, need // 2, "liveness", device="cpu")
    assert isinstance(err.value, MemoryError)


def test_measured_peak_and_trace_equal_the_plan():
    net = every_layer_net()
    rt = sn.Runtime(net, "64MiB", "offload", device="cpu")
    images, labels = batch_for(net)
    rt.step(images, labels)
    assert rt.stats.peak_bytes == rt.plan.peak_bytes
    assert [r["bytes_in_use"] for r in rt.stats.trace] == [s.bytes_in_use for s in rt.plan.steps]
    assert [r["live_tensors"] for r in rt.stats.trace] == [s.live_tensors for s in rt.plan.steps]
    assert rt.stats.bytes_to_host == rt.plan.bytes_to_host > 0


def test_predict_leaves_pool_as_it_was_and_training_continues():
    net = every_layer_net()
    rt = sn.Runtime(net, "64MiB", "recompute", device="cpu", precision="ieee")
    images, labels = batch_for(net)
    rt.step(images, labels)
    in_use = rt.arena.allocator.in_use
    logits = rt.predict(images)
    assert logits.shape == (net.batch, net.classes) and torch.isfinite(logits).all()
    assert rt.arena.allocator.in_use == in_use
    rt.step(images, labels)             # the plan's offsets still hold after predict
    assert rt.stats.peak_bytes == rt.plan.peak_bytes


def test_recomputation_with_dropout_and_bn_is_bitwise_equal_to_baseline():
    net = block_net(batch=2, p=0.3)
    gen = torch.Generator().manual_seed(5)
    images = torch.randn((net.batch, *net.input_shape), generator=gen)
    labels = torch.randint(0, net.classes, (net.batch,), generator=gen)
    results = {}
    for policy in ("baseline", "recompute"):
        rt = sn.Runtime(net, "64MiB", policy, device="cpu", lr=0.1, momentum=0.9, seed=7,
                        conv_algos={})
        losses = [rt.step(images, labels) for _ in range(2)]
        results[policy] = (losses, rt.params(), rt.plan.recomputed_steps)
    assert results["recompute"][2] > 0
    assert results["recompute"][0] == results["baseline"][0]
    for name, value in results["baseline"][1].items():
        assert torch.equal(value, results["recompute"][1][name]), name


def test_cuda_graph_request_checked_before_anything_runs():
    with pytest.raises(ValueError, match="cuda_graph must be a bool"):
        sn.Runtime(block_net(batch=2, p=0.0), "64MiB", cuda_graph=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            sn.Runtime(block_net(batch=2, p=0.0), "64MiB", cuda_graph=True)
    rt = sn.Runtime(block_net(batch=2, p=0.0), "64MiB", device="cpu")
    assert rt.cuda_graph is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_match_eager_bitwise():
    """A captured-and-replayed step computes what the eager walk computes, bit for bit: under
    "baseline", under "offload" at a cap that moves tensors every step (copy streams inside
    the graph) and under "all" there (it recomputes instead), with a new batch every step
    (static buffers refreshed) and a new lr every step (a schedule: the updates read it from
    the pool, so one capture serves every step); the captured pass checks peak == plan and
    the byte counters go on counting."""

    def net():
        return sn.models.resnet(blocks=[1, 1, 1, 1], batch=8, classes=10,
                                input_shape=(3, 32, 32))
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn((8, 3, 32, 32), generator=gen).cuda(),
                torch.randint(0, 10, (8,), generator=gen).cuda()) for _ in range(7)]
    for policy in ("baseline", "offload", "all"):
        memory = "4GiB" if policy == "baseline" else smallest_cap(net(), policy, momentum=0.9,
                                                                       conv_algos={})
        runs = [sn.Runtime(net(), memory, policy, device="cuda", lr=0.05, momentum=0.9,
                           conv_algos={}, cuda_graph=graph) for graph in (False, True)]
        for i, (images, labels) in enumerate(batches):
            for rt in runs:
                rt.lr = 0.05 * (1 - i / len(batches))
            eager, graphed = (rt.step(images, labels) for rt in runs)
            assert graphed == eager, (policy, i)
        eager_rt, graph_rt = runs
        assert graph_rt.replay.captures == 1
        assert graph_rt.stats.peak_bytes == graph_rt.plan.peak_bytes
        assert graph_rt.stats.bytes_to_host == eager_rt.stats.bytes_to_host
        if policy == "offload":
            assert graph_rt.plan.bytes_to_host > 0 and graph_rt.stats.bytes_to_device > 0
        if policy == "all":
            assert graph_rt.plan.recomputed_steps > 0
        for name, value in graph_rt.params().items():
            assert torch.equal(value, eager_rt.params()[name]), (policy, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_staged_batch_trains_bitwise_as_one_copied_at_the_step_start():
    """Where the plan leaves room (sched/staging.py) each batch crosses into its staging span
    while the last step's backward pass runs, and the step returns at its loss: eager and
    replayed, that trains bit for bit as a run at a cap with no room (the batch copied at
    the step's start, the host waiting for the whole step). The staged runs are fed from one
    pinned buffer overwritten as soon as each step returns (a loader reusing its buffer:
    the copy must be over by then) and once from the GPU."""
    def net():
        return sn.models.resnet(blocks=[1, 1, 1, 1], batch=8, classes=10,
                                input_shape=(3, 32, 32))
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn((8, 3, 32, 32), generator=gen),
                torch.randint(0, 10, (8,), generator=gen)) for _ in range(6)]
    tight = smallest_cap(net(), "liveness", momentum=0.9, conv_algos={})
    runs = [sn.Runtime(net(), memory, "liveness", device="cuda", lr=0.05, momentum=0.9,
                       conv_algos={}, cuda_graph=graph)
            for memory, graph in ((tight, False), ("1GiB", False), ("1GiB", True))]
    assert runs[0]._staging is None and runs[1]._staging is not None
    images, labels = (t.clone().pin_memory() for t in batches[0])
    for i in range(len(batches)):
        fed = [(images.cuda(), labels.cuda()) if i == 4 else (images, labels)] * 2
        losses = [runs[0].step(*batches[i])] + [rt.step(*b) for rt, b in zip(runs[1:], fed)]
        if i + 1 < len(batches):
            images.copy_(batches[i + 1][0])
            labels.copy_(batches[i + 1][1])
        assert losses[1] == losses[0] and losses[2] == losses[0], i
    for rt in runs[1:]:
        assert rt.stats.peak_bytes == rt.plan.peak_bytes
        for name, value in rt.params().items():
            assert torch.equal(value, runs[0].params()[name]), name


def test_dropout_masks_come_from_a_device_counter_each_training_step_advances():
    """The counter the dropout kernels read is planned in the pool (peak == plan), starts at
    0 and moves by one per training step, never per predict. With lr 0 and one batch, a loss
    changes only with the masks: each step draws new ones, and setting the counter back
    (load_state_dict) draws the first step's masks again."""
    net = block_net(batch=2, p=0.5)
    rt = sn.Runtime(net, "64MiB", "recompute", device="cpu", lr=0.0, seed=3, conv_algos={})
    counter = rt.view(rt.program.iteration)
    state = rt.state_dict()
    images, labels = batch_for(net)
    losses = []
    for i in range(3):
        assert int(counter) == i
        losses.append(rt.step(images, labels))
        rt.predict(images)
    assert int(counter) == rt.stats.iterations == 3
    assert len(set(losses)) == 3
    assert rt.stats.peak_bytes == rt.plan.peak_bytes and rt.plan.recomputed_steps > 0
    rt.load_state_dict(state)
    assert int(counter) == 0 and rt.step(images, labels) == losses[0]


def test_close_gives_the_pool_back_at_once_and_refuses_later_calls():
    """close frees the pool while the Runtime is still referenced (here by the name of the
    `with` block), and every later call says so in one line."""
    net = block_net(batch=2, p=0.0)
    images = torch.randn(2, *net.input_shape)
    labels = torch.zeros(2, dtype=torch.long)
    with sn.Runtime(net, "64MiB", "all", device="cpu") as rt:
        rt.step(images, labels)
        pool, host = weakref.ref(rt.arena.buffer), weakref.ref(rt.host.buffer)
    gc.disable()
    try:
        assert pool() is None and host() is None
    finally:
        gc.enable()
    for call in (lambda: rt.step(images, labels), lambda: rt.predict(images), rt.params,
                 rt.state_dict, lambda: rt.load_params({})):
        with pytest.raises(RuntimeError, match="this Runtime was closed"):
            call()
    rt.close()                                             # twice: nothing happens


def assert_freed_with_last_reference(make, use) -> None:
    """The Runtime `make()` returns, once `use(rt)` has run, is freed with its pool (and its
    allocator's books) and its host arena as soon as its last reference goes, with the cyclic garbage collector off
    (so no reference cycle may run through it). A storage is freed when no tensor or view
    uses it any more, and its weak reference dies then. Triton's interpreter leaves a
    reference cycle per launch that holds its arguments' storages (GridExecutor's recursive
    `_to_cpu`), so under it that garbage is collected first; what the Runtime still reaches
    survives the collection."""
    gc.collect()
    gc.disable()
    try:
        rt = make()
        use(rt)
        if INTERPRET:
            gc.collect()
        refs = {"the Runtime": weakref.ref(rt),
                "the pool": weakref.ref(rt.arena.buffer.untyped_storage()),
                "the pool's allocator": weakref.ref(rt.arena.allocator),
                "the host arena": weakref.ref(rt.host.buffer.untyped_storage())}
        del rt
        alive = [name for name, ref in refs.items() if ref() is not None]
        assert not alive, f"still alive after the last reference went: {alive}"
    finally:
        gc.enable()


def train_infer_and_save(rt) -> None:
    """Two steps (the second one recorded), a prediction, an evaluation and a state_dict."""
    images, labels = batch_for(rt.net)
    rt.step(images, labels)
    rt.recorder = Recorder()
    rt.step(images, labels)
    rt.predict(images)
    rt.evaluate([(images, labels)])
    rt.state_dict()


@pytest.mark.parametrize("policy", ["offload", "all"])
def test_a_runtime_is_freed_with_its_last_reference(policy):
    """A loop that makes one Runtime after another holds one pool at a time: nothing a
    Runtime holds (its dispatch table, kernel launchers, recorder) refers back to it."""
    net = block_net(batch=2, p=0.3)
    assert_freed_with_last_reference(
        lambda: sn.Runtime(net, "64MiB", policy, device="cpu", momentum=0.9),
        train_infer_and_save)


def test_a_data_parallel_runtime_is_freed_with_its_last_reference():
    """The same for one rank of a gloo group of one (its gradient all-reduces and updates)."""
    net = block_net(batch=2, p=0.0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{distributed.free_port()}",
                            rank=0, world_size=1)
    try:
        assert_freed_with_last_reference(
            lambda: sn.Runtime(net, "64MiB", "offload", device="cpu", momentum=0.9,
                               process_group=dist.group.WORLD, bucket_bytes=1000),
            train_infer_and_save)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graph_replaying_runtime_is_freed_with_its_last_reference():
    """The same on the GPU, after enough steps that the step is captured and replayed."""
    net = block_net(batch=2, p=0.3)

    def replay(rt):
        images, labels = batch_for(rt.net)
        for _ in range(sn.runtime.GRAPH_WARMUP + 2):
            rt.step(images, labels)
        assert rt.replay.graph is not None
        rt.predict(images)
    assert_freed_with_last_reference(
        lambda: sn.Runtime(net, "64MiB", "offload", device="cuda", momentum=0.9,
                           cuda_graph=True), replay)


def test_each_step_records_its_wall_time():
    """stats.step_seconds is the last step's time, measured inside the call (so no more
    than the call took) and measured afresh each step."""
    import time
    net = block_net(batch=2)
    rt = sn.Runtime(net, "64MiB", "liveness", device="cpu", conv_algos={})
    images, labels = batch_for(net)
    assert rt.stats.step_seconds == 0.0
    seen = []
    for _ in range(2):
        started = time.perf_counter()
        rt.step(images, labels)
        took = time.perf_counter() - started
        assert 0 < rt.stats.step_seconds <= took
        seen.append(rt.stats.step_seconds)
    assert seen[0] != seen[1]
    rt.close()


def test_the_runtime_plans_with_the_h200_model_and_its_measured_conv_times(monkeypatch):
    """The plan's step-time model is the H200's (eager here); where the conv rankings were
    timed on the GPU (policy "all" there), their per-image times come with it."""
    from tinysn.sched import timing, workspace
    net = block_net(batch=2)
    rt = sn.Runtime(net, "64MiB", "all", device="cpu", conv_algos={})
    assert rt.plan.device_model == timing.DeviceModel.h200()
    table = {("a key",): {"implicit": 1e-6}}
    monkeypatch.setattr(workspace, "cached_rankings",
                        lambda net, device, kind="conv-rankings":
                        table if kind == "conv-times" else None)
    graphed = rt._device_model(dynamic=True, cuda_graph=True)
    assert graphed == timing.DeviceModel.h200(graphed=True, conv_times=table)
    assert rt._device_model(dynamic=False, cuda_graph=False).conv_times is None
    rt.close()
