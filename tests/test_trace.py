"""The Chrome trace of a step: every kernel and copy on its stream, bytes in use as a counter."""
import json

import pytest

import tinysn as sn
from tinysn import trace
from tinysn.sched.plan import Launch, Offload, Prefetch
from tinysn.testing import every_layer_net


@pytest.fixture(scope="module")
def traced():
    """Two steps of every layer type under policy offload (copies both ways), recorded."""
    net = every_layer_net()
    rt = sn.Runtime(net, "64MiB", "offload", device="cpu")
    rt.recorder = trace.Recorder()
    images, labels = sn.data.synthetic(net)
    rt.step(images, labels)
    rt.step(images, labels)
    return rt


def _ops(rt, kinds):
    return [(s, op) for s in rt.plan.steps for op in s.ops if isinstance(op, kinds)]


def test_every_kernel_and_copy_of_one_step_on_its_stream(traced, tmp_path):
    path = tmp_path / "t.json"
    count = trace.write(traced.recorder, path)
    events = json.loads(path.read_text())["traceEvents"]
    assert len(events) == count
    spans = [e for e in events if e["ph"] == "X"]
    kernels = _ops(traced, (Launch,))
    assert [e["name"] for e in spans if e["tid"] == 0] == [
        f"{s.layer} {s.phase}" for s, _ in kernels]                  # one step, in order
    to_host = [traced.tensors[op.tensor].name for _, op in _ops(traced, (Offload,))]
    to_device = [traced.tensors[op.tensor].name for _, op in _ops(traced, (Prefetch,))]
    assert to_host and to_device
    assert [e["name"] for e in spans if e["tid"] == 1] == to_host
    assert [e["name"] for e in spans if e["tid"] == 2] == to_device
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {0: "compute", 1: "to host", 2: "to device"}


def test_compute_spans_are_timed_and_do_not_overlap(traced):
    spans = [e for e in traced.recorder.events() if e["ph"] == "X" and e["tid"] == 0]
    assert spans[0]["ts"] >= 0
    for a, b in zip(spans, spans[1:]):
        assert a["dur"] >= 0 and a["ts"] + a["dur"] <= b["ts"]
    assert sum(e["dur"] for e in spans) > 0


def test_counter_track_is_the_pool_bytes_in_use(traced):
    counter = [e for e in traced.recorder.events() if e["ph"] == "C"]
    assert [e["args"]["bytes"] for e in counter] == [
        r["bytes_in_use"] for r in traced.stats.trace]
    assert max(e["args"]["bytes"] for e in counter) == traced.plan.peak_bytes


def test_nothing_recorded_is_a_clear_error():
    with pytest.raises(ValueError, match="nothing recorded"):
        trace.Recorder().events()


@pytest.mark.gpu
def test_gpu_trace_times_kernels_and_copies_with_cuda_events(tmp_path):
    """On the GPU: CUDA-event times, copies on their own streams overlapping the compute
    stream's span, the same kernel list as the plan."""
    net = every_layer_net(batch=8)
    rt = sn.Runtime(net, "64MiB", "offload", device="cuda")
    rt.recorder = trace.Recorder()
    images, labels = sn.data.synthetic(net)
    for _ in range(2):
        rt.step(images, labels)
    events = rt.recorder.events()
    spans = [e for e in events if e["ph"] == "X"]
    assert sum(e["tid"] == 0 for e in spans) == len(_ops(rt, (Launch,)))
    assert sum(e["tid"] in (1, 2) for e in spans) == len(_ops(rt, (Offload, Prefetch)))
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans if e["tid"] == 0)
    assert all(e["ts"] <= end for e in spans if e["tid"] != 0)
