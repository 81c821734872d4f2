"""Every device byte inside the cap: explicit conv rankings, the batch from the host, tuning
that allocates nothing, impossible caps refused in one line, and (on the GPU) the whole
process's peak measured against `memory`."""
import math
import os

import pytest
import torch
import triton
import triton.language as tl

import tinysn as sn
from tinysn import cache, inputs
from tinysn.kernels import conv
from tinysn.kernels._common import HostRestore
from tinysn.pool import Arena
from tinysn.pool.arena import available_bytes
from tinysn.sched import workspace
from tinysn.testing import block_net

GPU = torch.cuda.is_available()


def small_resnet(batch=16):
    return sn.models.resnet(blocks=[1, 1, 1, 1], batch=batch, classes=10, input_shape=(3, 64, 64))


def batch_for(net, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((net.batch, *net.input_shape), generator=gen),
            torch.randint(0, net.classes, (net.batch,), generator=gen))


# -- rankings: explicit arguments of the plan -----------------------------------------------
def reversed_rankings(net):
    """Every conv phase's default order, reversed: workspace algorithms first."""
    return {key: workspace.ranking(key[:4], key[4])[::-1] for key in workspace.net_keys(net)}


def test_default_rankings_are_the_fixed_order_and_a_plan_is_a_function_of_its_arguments():
    net = small_resnet()
    default = {key: workspace.ranking(key[:4], key[4]) for key in workspace.net_keys(net)}
    for key, order in default.items():
        sizes = conv.algos(*key[:4], key[4])
        assert [sizes[a] for a in order] == sorted(sizes.values()), key
    implicit = sn.plan(net, "1GiB", "all")
    explicit = sn.plan(net, "1GiB", "all", rankings=default)
    assert explicit.conv_algos == implicit.conv_algos
    assert [s.ops for s in explicit.steps] == [s.ops for s in implicit.steps]
    other = sn.plan(net, "1GiB", "all", rankings=reversed_rankings(net))
    assert other.conv_algos != implicit.conv_algos
    assert sn.plan(net, "1GiB", "all").conv_algos == implicit.conv_algos   # nothing remembered


def test_rankings_file_round_trip_merges(tmp_path):
    net = small_resnet()
    rankings = reversed_rankings(net)
    keys = sorted(rankings, key=str)
    path = tmp_path / "sub" / "r.json"
    workspace.save_rankings(path, {k: rankings[k] for k in keys[:3]})
    workspace.save_rankings(path, {k: rankings[k] for k in keys[3:]})
    assert workspace.load_rankings(path) == rankings
    assert workspace.load_rankings(tmp_path / "missing.json") == {}


def test_cache_dir_follows_the_environment_and_clear_removes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"
    (tmp_path / "c" / "conv-rankings").mkdir(parents=True)
    (tmp_path / "c" / "conv-rankings" / "x.json").write_text("{}")
    cache.clear()
    assert not (tmp_path / "c").exists()
    cache.clear()                                   # nothing there: no error
    monkeypatch.delenv("TINYSN_CACHE_DIR")
    assert cache.cache_dir() == cache.Path.home() / ".cache" / "tinysn"


def test_measure_rankings_times_inside_the_scratch_and_keeps_them(tmp_path, monkeypatch):
    """The timing loop on the CPU interpreter (the clock faked: im2col and splitk "win"):
    every algorithm launches on views of the scratch, the order comes back fastest first,
    each algorithm's seconds per image are kept beside it (the step-time model's conv
    times) and a second call reads the files instead of timing."""
    from tinysn.kernels import _common

    launched = []

    def fake_bench(fn, rep_ms=20):
        fn()
        launched.append(1)
        return 1.0 if len(launched) % 2 == 0 else 2.0
    monkeypatch.setattr(_common, "bench_ms", fake_bench)
    monkeypatch.setattr(workspace, "rankings_path",
                        lambda device, kind="conv-rankings": tmp_path / f"{kind}.json")
    net = sn.Net(input_shape=(2, 6, 6), classes=3, batch=2)
    net.softmax_loss(net.fc(net.conv(net.data(), 4, kernel=3, padding=1, name="c"), 3))
    scratch = Arena("1MiB")
    scratch.buffer.fill_(7)
    rankings = workspace.measure_rankings(net, scratch.buffer, progress=False)
    g = workspace.conv_geometry(net["c"])
    phases = ("forward", "backward_data", workspace.BIAS_PHASE)     # c has a bias
    assert set(rankings) == {(*g, ph) for ph in phases}
    assert len(launched) == sum(len(conv.algos(*g, workspace.kernel_phase(ph)))
                                for ph in phases)
    for ph in phases:
        assert sorted(rankings[(*g, ph)]) == sorted(conv.algos(*g, workspace.kernel_phase(ph)))
    assert rankings[(*g, "forward")] == ["im2col", "implicit"]       # the second timed won
    times = workspace.load_rankings(tmp_path / "conv-times.json")
    assert times[(*g, "forward")] == {"implicit": 2.0 / 1e3 / 2, "im2col": 1.0 / 1e3 / 2}
    assert set(times) == set(rankings)
    assert workspace.cached_rankings(net, "cpu", "conv-times") == times
    assert not bool((scratch.buffer == 7).all()), "nothing was written in the scratch"
    count = len(launched)
    assert workspace.measure_rankings(net, scratch.buffer, progress=False) == rankings
    assert len(launched) == count
    (tmp_path / "conv-times.json").unlink()             # rankings kept without their times:
    assert workspace.cached_rankings(net, "cpu") is None        # not cached, timed again
    workspace.measure_rankings(net, scratch.buffer, progress=False)
    assert len(launched) == 2 * count                  # (the fake clock's winners swap)
    assert set(workspace.cached_rankings(net, "cpu", "conv-times")) == set(times)


def test_timing_geometry_halves_the_batch_until_it_fits():
    net = small_resnet(batch=64)
    g = workspace.net_keys(net)[0][:4]               # the stem: 3 -> 64 channels at 64x64
    assert workspace.timing_geometry(g, 1 << 40) == g               # roomy: the full batch
    small = workspace.timing_geometry(g, 8 << 20)
    assert small[1:] == g[1:] and 1 <= small[0][0] < g[0][0]
    assert small[0][1:] == g[0][1:]
    bigger = workspace.timing_geometry(g, 32 << 20)
    assert small[0][0] < bigger[0][0] <= g[0][0]
    assert workspace.timing_geometry(g, 1)[0][0] == 1               # never below one image


# -- the arena: scratch over another arena's bytes, impossible sizes ------------------------
def test_arena_over_a_buffer_allocates_nothing_and_aliases_it():
    pool = Arena("16KiB")
    scratch = Arena(8192, buffer=pool.buffer[4096:])
    block = scratch.alloc(1024)
    scratch.view(block, (256,)).fill_(2.0)
    assert scratch.buffer.data_ptr() == pool.buffer.data_ptr() + 4096
    assert torch.equal(pool.buffer[4096:5120].view(torch.float32), torch.full((256,), 2.0))
    with pytest.raises(ValueError, match="holds 12,288 bytes"):
        Arena("16KiB", buffer=pool.buffer[4096:])
    with pytest.raises(ValueError, match="uint8"):
        Arena(1024, buffer=torch.zeros(1024))


def test_pinned_requests_count_as_torch_rounds_them():
    from tinysn.pool.arena import pinned_bytes

    assert [pinned_bytes(n) for n in (1, 1024, 1025, 60 << 30)] == [1, 1024, 2048, 64 << 30]


def test_impossible_caps_fail_in_one_line_before_anything_is_allocated():
    too_much = f"{available_bytes('cpu') // 2**30 + 64}GiB"
    with pytest.raises(sn.OutOfMemory) as err:
        Arena(too_much)
    assert "\n" not in str(err.value) and "RAM available" in str(err.value)
    net = block_net(batch=2, p=0.0)
    for kwargs in ({"memory": too_much}, {"memory": "64MiB", "host_memory": too_much}):
        with pytest.raises(sn.OutOfMemory) as err:
            sn.Runtime(net, policy="all", device="cpu", **kwargs)
        message = str(err.value)
        assert "\n" not in message and "more than this machine has" in message
        assert ("host_memory=" in message) == ("host_memory" in kwargs)


def test_cli_train_with_an_impossible_cap_prints_one_line(capsys):
    from tinysn.cli import main

    assert main(["train", "--memory", "10TiB", "--steps", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "more than this machine has" in err


def test_largest_bisects_to_the_last_k_that_fits():
    from bench.memory import largest

    calls = []

    def fits(k):
        calls.append(k)
        return k <= 37
    assert largest(fits) == 37 and largest(fits, start=64) == 37
    assert largest(lambda k: False) == 0 and largest(lambda k: True, limit=100) == 100
    assert len(calls) < 30


def test_a_given_largest_batch_is_checked_against_the_planner():
    from bench.memory import checked_largest, parse_batches

    make = lambda batch: sn.models.lenet(batch=batch)   # noqa: E731
    best = sn.max_batch(make, "4MiB", "all")
    assert checked_largest(make, best, "4MiB") == best
    for wrong in (best - 1, best + 1):
        with pytest.raises(SystemExit, match="not the largest"):
            checked_largest(make, wrong, "4MiB")
    assert parse_batches("resnet50=897,vgg16=320") == {"resnet50": 897, "vgg16": 320}
    for bad in ("resnet50", "resnet50=0", "nonet=3"):
        with pytest.raises(SystemExit, match="--batches"):
            parse_batches(bad)


def test_merging_keeps_a_models_pytorch_batch_where_the_run_measures_none(tmp_path, monkeypatch):
    """memory.py --merge replaces a model's row with the run's, but keeps the PyTorch largest
    batch an earlier --pytorch run measured (PyTorch's does not depend on tinysn's planner),
    and the other models' rows whole."""
    import json
    from bench import memory
    out = tmp_path / "memory.json"
    earlier = {"lenet": {"max_batch_all": 1, "pytorch": {"largest": 7}}, "vgg16": {"x": 1}}
    out.write_text(json.dumps({"memory": "4MiB", "models": earlier}))
    best = sn.max_batch(lambda batch: sn.models.lenet(batch=batch), "4MiB", "all")
    monkeypatch.setattr("sys.argv", ["memory.py", "--memory", "4MiB", "--models", "lenet",
                                     "--batches", f"lenet={best}", "--merge", "--out", str(out)])
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: False)
    memory.main()
    models = json.loads(out.read_text())["models"]
    assert models["lenet"]["max_batch_all"] == best
    assert models["lenet"]["pytorch"] == {"largest": 7} and models["vgg16"] == {"x": 1}

# -- the batch ------------------------------------------------------------------------------
def test_batch_checks_catch_every_non_finite_value_and_accept_huge_finite_ones():
    net = block_net(batch=2, p=0.0)
    rt = sn.Runtime(net, "64MiB", "all", device="cpu")
    images, labels = batch_for(net)
    before = {k: v.clone() for k, v in rt.params().items()}
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = images.clone()
        broken.view(-1)[5] = bad
        with pytest.raises(ValueError, match="NaN or infinite"):
            rt.step(broken, labels)
    assert all(torch.equal(v, rt.params()[k]) for k, v in before.items())
    assert rt.stats.iterations == 0
    huge = torch.full_like(images, 3e38)       # finite, though a float32 sum would overflow
    inputs.check_batch(net, huge, labels)
    with pytest.raises(ValueError, match=rf"\[0, {net.classes}\), got values in \[-1, "):
        rt.step(images, labels - labels.min() - 1)
    assert rt.stats.process_peak_bytes is None         # no device memory on the CPU


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_a_plan_from_measured_rankings_may_take_a_larger_grid_cap(tmp_path, monkeypatch):
    """With no cached rankings the Runtime plans once to check the fit, times the rankings
    inside its buffer and plans again into it: the second plan may take a larger pool than
    the first (here the first is made for half the cap), never more than `memory`."""
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path))
    net = small_resnet()
    memory = 2 * tight_cap(net)
    real, calls = sn.runtime.plan_mod.plan, []

    def plan(net, memory, *args, **kwargs):
        calls.append(memory)
        return real(net, memory // 2 if len(calls) == 1 else memory, *args, **kwargs)
    monkeypatch.setattr(sn.runtime.plan_mod, "plan", plan)
    rt = sn.Runtime(net, memory, "all", device="cuda", momentum=0.9)
    assert len(calls) == 2 and rt.plan.capacity > memory // 2
    images, labels = batch_for(net)
    assert math.isfinite(rt.step(images, labels))
    assert rt.stats.peak_bytes == rt.plan.peak_bytes
    rt.close()


def test_values_counted_into_a_flag_name_the_images_or_the_labels():
    """check_values with a flag (the Runtime's pool float on a GPU; here the interpreter):
    a good batch passes, with nothing counted; a NaN names the images, a label out of range
    the labels with their range, and with both wrong the images come first."""
    images, labels = torch.randn(2, 3, 5, 5), torch.tensor([0, 3])
    flag = torch.full((1,), 9.0)
    inputs.check_values(images, labels, 4, flag)
    assert flag.item() == 0
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\), got values in \[1, 4\]"):
        inputs.check_values(images, labels + 1, 4, flag)
    images[1, 2, 4, 4] = float("inf")
    for wrong in (labels, labels - 1):
        with pytest.raises(ValueError, match="NaN or infinite"):
            inputs.check_values(images, wrong, 4, flag)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_checking_a_batch_on_the_device_allocates_nothing():
    """Runtime.step checks the batch's values where it copied it, in the pool, counting into
    a float of the pool (the loss's): not one device byte is allocated (torch's aminmax
    allocated two scalars, 10-15 KB over the cap per run; a float64 sum a float64 copy of
    the batch, 40 MB for AlexNet's batch of 32), for the images nor for the labels."""
    images = torch.randn(32, 3, 227, 227, device="cuda")
    labels = torch.randint(0, 1000, (32,), device="cuda")
    flag = torch.zeros(1, device="cuda")
    inputs.check_values(images, labels, 1000, flag)     # compiled before the count
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    inputs.check_values(images, labels, 1000, flag)
    assert torch.cuda.max_memory_allocated() == before
    images[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        inputs.check_values(images, labels, 1000, flag)
    assert torch.cuda.max_memory_allocated() == before


# -- autotuning keeps in-place arguments through tuning, from host memory -------------------
@triton.jit
def _accumulate(dst, src, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(dst + offs, mask=m) + tl.load(src + offs, mask=m), mask=m)


def test_host_restore_puts_in_place_arguments_back_after_tuning(device):
    """Through triton's own autotuner (on the GPU when there is one): many timed launches of
    an accumulating kernel, then the real one; the output holds one accumulation."""
    runs = []

    def fake_bench(kernel_call, quantiles):
        for _ in range(3):
            kernel_call()
        runs.append(1)
        return [float(len(runs))] * len(quantiles)

    configs = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]
    tuner = triton.autotune(configs, key=["n"], pre_hook=HostRestore(["dst"]),
                            do_bench=fake_bench)(_accumulate)
    dst = torch.arange(40, dtype=torch.float32, device=device)
    src = torch.ones(40, device=device)
    want = dst + src
    tuner[lambda meta: (triton.cdiv(40, meta["BLOCK"]),)](dst, src, 40)
    assert len(runs) == 2                     # both configs were timed (6 launches)
    assert torch.equal(dst, want)
    assert torch.equal(src, torch.ones(40, device=device))


# -- on the GPU: the whole process inside the cap ------------------------------------------
def tight_cap(net, policy="all"):
    """The cap at which `net` just plans: its required bytes at a roomy cap, plus 2%."""
    need = sn.plan(net, "4GiB", policy, momentum=0.9).required_bytes
    for factor in (1.02, 1.05, 1.1, 1.25, 1.5):
        try:
            sn.plan(net, int(need * factor), policy, momentum=0.9)
            return int(need * factor)
        except sn.OutOfMemory:
            continue
    return 2 * need


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("pinned", [False, True])
def test_process_peak_stays_within_the_cap(tmp_path, monkeypatch, cuda_graph, pinned):
    """Construction (conv rankings timed in the pool: a fresh cache), autotuning, capture
    and steps fed from the host: max_memory_allocated <= memory + PROCESS_SLACK_BYTES."""
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path))
    net = small_resnet()
    memory = tight_cap(net)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    # lr 0.01: at 0.05 (momentum 0.9) this net diverges on two random-label batches under
    # every policy and cap alike (measured on the H200), which says nothing about the cap
    rt = sn.Runtime(net, memory, "all", device="cuda", lr=0.01, momentum=0.9,
                    cuda_graph=cuda_graph)
    assert os.listdir(tmp_path / "conv-rankings"), "rankings were timed and kept"
    assert rt.rankings and rt.plan.capacity <= memory       # "all": a grid cap (plan.py)
    losses = []
    for i in range(sn.runtime.GRAPH_WARMUP + 3):
        images, labels = batch_for(net, seed=i % 2)
        if pinned:
            images, labels = images.pin_memory(), labels.pin_memory()
        losses.append(rt.step(images, labels))
    torch.cuda.synchronize()
    peak = rt.stats.process_peak_bytes - before
    print(f"memory {memory:,} process peak {peak:,} (+{peak - memory:,})")
    assert peak <= memory + sn.runtime.PROCESS_SLACK_BYTES
    assert rt.stats.peak_bytes == rt.plan.peak_bytes
    assert losses[-1] < losses[0] or losses[-2] < losses[1]
    if cuda_graph:
        assert rt.replay.graph is not None


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_graph_replays_fed_from_the_host_match_eager_bitwise():
    net = lambda: small_resnet(batch=8)  # noqa: E731
    runs = [sn.Runtime(net(), "1GiB", "all", device="cuda", lr=0.05, momentum=0.9,
                       conv_algos={}, cuda_graph=graph) for graph in (False, True)]
    for i in range(6):
        images, labels = batch_for(runs[0].net, seed=i)
        if i % 2:
            images = images.pin_memory()
        eager, graphed = (rt.step(images, labels) for rt in runs)
        assert graphed == eager, i
    for name, value in runs[1].params().items():
        assert torch.equal(value, runs[0].params()[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_graphed_vgg_with_dropout_matches_eager_bitwise():
    """VGG16 at 32x32 (two dropout layers, p 0.5) under "recompute": replays draw the masks
    eager steps draw (the device counter advances inside the graph), step after step with
    new batches; a load_state_dict that changes the seed recaptures and still matches."""
    from tinysn.models import vgg16
    runs = [sn.Runtime(vgg16(batch=8, classes=10, input_shape=(3, 32, 32)), "2GiB",
                       "recompute", device="cuda", lr=0.01, momentum=0.9, conv_algos={},
                       cuda_graph=graph) for graph in (False, True)]
    for i in range(8):
        if i == 5:
            for rt in runs:
                rt.load_state_dict({**runs[0].state_dict(), "seed": torch.tensor(11)})
        images, labels = batch_for(runs[0].net, seed=i)
        eager, graphed = (rt.step(images, labels) for rt in runs)
        assert graphed == eager, i
    assert runs[1].replay.graph is not None
    for rt in runs:
        assert int(rt.view(rt.program.iteration)) == rt.stats.iterations == 8
        assert rt.stats.peak_bytes == rt.plan.peak_bytes
    for name, value in runs[1].params().items():
        assert torch.equal(value, runs[0].params()[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_bench_ms_allocates_nothing_and_rankings_come_back_from_disk(tmp_path, monkeypatch):
    from tinysn.kernels._common import bench_ms

    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    ms = bench_ms(lambda: x.mul_(1.0))
    assert ms > 0 and torch.cuda.max_memory_allocated() == held
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path))
    net = small_resnet(batch=4)
    assert workspace.cached_rankings(net, "cuda") is None
    pool = Arena("2GiB", "cuda")
    measured = workspace.measure_rankings(net, pool.buffer, progress=False)
    assert set(measured) == set(workspace.net_keys(net))
    assert workspace.cached_rankings(net, "cuda") == measured


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_a_cap_beyond_the_gpu_fails_in_one_line():
    free = available_bytes("cuda")
    with pytest.raises(sn.OutOfMemory, match="GPU memory free") as err:
        sn.Runtime(block_net(batch=2, p=0.0), free + (1 << 30), "all", device="cuda")
    assert "\n" not in str(err.value)
