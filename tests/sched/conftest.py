"""Plans several test files of tests/sched read (made once per session), and their GPU
check that a planner option changes no bit."""
import pytest
import torch

import tinysn as sn


@pytest.fixture(scope="session")
def resnet50_995_apart():
    """ResNet-50 at batch 995 under 12 GiB with 60 GiB of host memory (its largest batch
    with every ReLU planned apart, the net the tests that read this were
    written on; fused, its plan at this batch meets none of their cases), planned
    otherwise by default: (net, plan)."""
    net = sn.models.resnet50(batch=995)
    return net, sn.plan(net, "12GiB", "all", host_memory="60GiB", fuse_relu=False)


@pytest.fixture
def trains_alike_on_the_gpu(tmp_path, monkeypatch):
    """check(net, cuda_graph, flag): four steps of `net` (batch 4, 32x32 images) under
    policy "all" on the GPU, with the Runtime option `flag` False and True: the same conv
    algorithms, losses and parameters. The rankings are the test's own (a private cache):
    a test beside it in another process that times the same shapes would otherwise rewrite
    them between the two Runtimes."""
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path))

    def check(net, cuda_graph, flag):
        gen = torch.Generator().manual_seed(1)
        images = torch.randn(4, 3, 32, 32, generator=gen)
        labels = torch.randint(0, 10, (4,), generator=gen)
        runs = []
        for on in (False, True):
            rt = sn.Runtime(net, memory="1GiB", policy="all", device="cuda", momentum=0.9,
                            cuda_graph=cuda_graph, **{flag: on})
            losses = [rt.step(images, labels) for _ in range(4)]
            assert rt.stats.peak_bytes == rt.plan.peak_bytes
            runs.append((losses, rt.params(), rt.plan.conv_algos))
            rt.close()
        (l0, p0, a0), (l1, p1, a1) = runs
        assert a0 == a1 and l0 == l1
        assert all(torch.equal(p0[k], p1[k]) for k in p0)
    return check
