"""Plans several test files of tests/sched read: made once per session."""
import pytest

import tinysn as sn


@pytest.fixture(scope="session")
def resnet50_995_apart():
    """ResNet-50 at batch 995 under 12 GiB with 60 GiB of host memory (its largest batch
    with every ReLU planned apart, the net the tests that read this were
    written on; fused, its plan at this batch meets none of their cases), planned
    otherwise by default: (net, plan)."""
    net = sn.models.resnet50(batch=995)
    return net, sn.plan(net, "12GiB", "all", host_memory="60GiB", fuse_relu=False)
