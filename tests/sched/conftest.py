"""Plans several test files of tests/sched read: made once per session."""
import pytest

import tinysn as sn


@pytest.fixture(scope="session")
def resnet50_995():
    """ResNet-50 at batch 995 under 12 GiB with 60 GiB of host memory (its largest batch),
    planned by default: (net, plan)."""
    net = sn.models.resnet50(batch=995)
    return net, sn.plan(net, "12GiB", "all", host_memory="60GiB")
