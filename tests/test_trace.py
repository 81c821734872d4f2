"""The Chrome trace of a step: every kernel and copy on its stream, bytes in use as a counter."""
import json

import pytest

import tinysn as sn
from tinysn import cli, trace
from tinysn.sched.plan import Launch, Offload, Prefetch
from tinysn.testing import every_layer_net
from tinysn.units import format_bytes


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


def test_write_names_the_step_and_its_figures(traced, tmp_path):
    path = tmp_path / "t.json"
    trace.write(traced.recorder, path, model="every_layer_net")
    written = json.loads(path.read_text())
    meta = written["otherData"]
    assert {k: meta[k] for k in ("model", "batch", "policy", "cap_bytes", "device")} == {
        "model": "every_layer_net", "batch": traced.net.batch, "policy": "offload",
        "cap_bytes": traced.plan.capacity, "device": "cpu"}
    assert meta["step_ms"] == trace.summary(written["traceEvents"])["step_ms"] > 0
    assert set(meta["busy"]) == {"compute", "to host", "to device"}


def _span(tid, ts, dur, cat="forward"):
    return {"name": "x", "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur}


def test_busy_fractions_by_hand():
    """A 20 us step: compute runs 0-10 and 15-20 (15 us); to host copies 2-6 and 4-8
    overlap (6 us), then after a gap 12-14 (8 us in all); to device runs 1-11 with 3-5
    inside it (10 us); the counter event is no span."""
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": n}}
             for n, tid in trace.THREADS.items()]
    events = names + [_span(0, 0, 10), _span(0, 15, 5, "backward"),
                      _span(1, 2, 4, "offload"), _span(1, 4, 4, "offload"),
                      _span(1, 12, 2, "evict"), _span(2, 1, 10, "prefetch"),
                      _span(2, 3, 2, "prefetch"),
                      {"name": "pool bytes in use", "ph": "C", "pid": 0, "ts": 30,
                       "args": {"bytes": 5}}]
    figures = trace.summary(events)
    assert figures["step_ms"] == pytest.approx(0.020)
    assert figures["busy"] == pytest.approx({"compute": 0.75, "to host": 0.4,
                                             "to device": 0.5})


@pytest.fixture(scope="module")
def squeezed(tmp_path_factory):
    """A trace file of one step of every layer type under policy all at the smallest cap
    it plans under, where the cache must move tensors both ways."""
    cap = cli.smallest_cap(every_layer_net, 2, "all")
    net = every_layer_net(batch=2)
    rt = sn.Runtime(net, cap, "all", device="cpu")
    assert rt.plan.bytes_to_host > 0 and rt.plan.bytes_to_device > 0
    rt.recorder = trace.Recorder()
    images, labels = sn.data.synthetic(net)
    rt.step(images, labels)
    path = tmp_path_factory.mktemp("squeezed") / "t.json"
    trace.write(rt.recorder, path, model="every_layer_net")
    return path


def test_plot_draws_a_png_of_a_cpu_trace_with_copies(squeezed, tmp_path):
    pytest.importorskip("matplotlib")
    recorded = trace.read(squeezed)
    png = tmp_path / "t.png"
    figures = trace.plot(recorded, png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert figures["step_ms"] == pytest.approx(recorded["otherData"]["step_ms"])
    assert figures["busy"]["to host"] > 0 and figures["busy"]["to device"] > 0


def test_plot_titles_the_step_and_draws_every_span_and_the_cap(squeezed, tmp_path):
    """In the SVG (text kept as text): the title's model, batch, cap and busy shares, a
    legend entry per category present, the bytes-in-use line and the cap line's labels."""
    matplotlib = pytest.importorskip("matplotlib")
    recorded = trace.read(squeezed)
    svg = tmp_path / "t.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        figures = trace.plot(recorded, svg)
    text = svg.read_text()
    meta = recorded["otherData"]
    share = f"to host {figures['busy']['to host']:.1%}"
    cap = f"cap {format_bytes(meta['cap_bytes'])}"
    for expected in ("every_layer_net batch 2 policy all", cap, share, "pool bytes in use"):
        assert expected in text, expected
    assert text.count(cap) == 2                     # the title and the dashed line's label
    categories = {e["cat"] for e in recorded["traceEvents"] if e["ph"] == "X"}
    assert {"forward", "backward", "prefetch"} <= categories
    for category in categories:
        assert f">{category}<" in text, category


def test_trace_command_prints_the_figures_and_draws(squeezed, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    status = cli.main(["trace", str(squeezed), "--plot", str(png)])
    out, err = capsys.readouterr()
    assert status == 0, err
    busy = json.loads(squeezed.read_text())["otherData"]["busy"]
    assert f"to device {busy['to device']:.1%}" in out and png.stat().st_size > 0


BAD_FILES = [
    (b"\x89PNG\r\n\x1a\n\x00", "is not a trace file: it is not JSON"),
    (b'{"events": []}', "is not a trace file: no traceEvents list"),
    (b'{"traceEvents": [1, 2]}', "its traceEvents are not all objects"),
    (b'{"traceEvents": []}', "holds no kernel or copy spans"),
    (b'[{"name": "thread_name", "ph": "M", "tid": 0, "args": {"name": "compute"}}]',
     "holds no kernel or copy spans"),
    (b'[{"name": "k", "ph": "X", "tid": 0, "ts": 1}]', "span without a numeric ts and dur"),
]


@pytest.mark.parametrize("content,problem", BAD_FILES, ids=range(len(BAD_FILES)))
def test_bad_trace_file_is_one_line_before_any_drawing(content, problem, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=problem) as err:
        trace.read(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    status = cli.main(["trace", str(path), "--plot", str(tmp_path / "t.png")])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and problem in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


class _Stream:
    """A stand-in CUDA stream that logs what it is made to wait for and the marks taken."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "waits for stream", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "waits for event", event))


def test_gpu_copy_start_is_marked_after_what_the_copy_waits_for(monkeypatch):
    """A copy out waits for the compute stream and its plan events, a prefetch for its
    events only (as tensor._copy does), and only then is its start marked."""
    log = []
    rec = trace.Recorder()
    rec._cuda = True
    rec._streams = {name: _Stream(name, log) for name in trace.THREADS}
    monkeypatch.setattr(rec, "_mark", lambda stream: log.append((stream, "mark")))

    class Rt:
        def events_of(self, op):
            return [f"event {w}" for w in op.waits]

    rec.before(Offload(tensor=0, host_offset=0, slot=0, waits=[3]), Rt())
    rec.before(Prefetch(tensor=0, offset=0, slot=1, waits=[4]), Rt())
    assert log == [("to host", "waits for stream", "compute"),
                   ("to host", "waits for event", "event 3"), ("to host", "mark"),
                   ("to device", "waits for event", "event 4"), ("to device", "mark")]


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
    kernels = [e for e in spans if e["tid"] == 0]
    copies_out = iter(e for e in spans if e["tid"] == 1)
    launched = 0
    for op in (op for s in rt.plan.steps for op in s.ops):   # a copy out starts after the
        launched += isinstance(op, Launch)                   # kernels before it, not with them
        if isinstance(op, Offload):
            before = kernels[launched - 1]
            assert next(copies_out)["ts"] >= before["ts"] + before["dur"] - 1.0
