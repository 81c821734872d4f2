"""Dynamic conv workspaces: the fastest algorithm whose workspace fits in the free memory."""
import pytest
import torch

import tinysn as sn
from tinysn.kernels import conv
from tinysn.sched import workspace


def conv_net():
    net = sn.Net(input_shape=(3, 12, 12), classes=4, batch=2)
    h = net.relu(net.conv(net.data(), 8, kernel=3, padding=1, name="c1"))
    h = net.conv(h, 8, kernel=3, stride=2, padding=1, name="c2")
    net.softmax_loss(net.fc(h, 4, name="fc"))
    return net


@pytest.fixture
def im2col_fastest():
    """Rankings as if timings said im2col beats implicit GEMM for c2's forward."""
    net = conv_net()
    geometry = workspace.conv_geometry(net["c2"])
    rankings = {(*geometry, "forward"): ["im2col", "implicit"]}
    return net, conv.algos(*geometry, "forward")["im2col"], rankings


def test_roomy_cap_takes_the_faster_workspace_algorithm(im2col_fastest):
    net, ws, rankings = im2col_fastest
    assert ws > 0
    p = sn.plan(net, "64MiB", "all", rankings=rankings)
    assert p.conv_algos["c2"]["forward"] == "im2col"
    assert sn.plan(net, "64MiB", "all").conv_algos["c2"]["forward"] == "implicit"   # default


def test_tight_cap_falls_back_to_what_fits(im2col_fastest):
    net, ws, rankings = im2col_fastest
    pinned = sn.plan(net, "64MiB", "all", conv_algos={})
    assert pinned.conv_algos["c2"]["forward"] == "implicit"
    tight = sn.plan(net, pinned.required_bytes, "all", rankings=rankings)
    step = next(s for s in tight.steps if s.layer == "c2" and s.phase == "forward")
    assert step.algos["forward"] == "implicit"       # no room for im2col's workspace there


def test_pinned_algorithms_hold_under_every_policy():
    net = conv_net()
    for policy in sn.POLICIES:
        p = sn.plan(net, "64MiB", policy, conv_algos={"forward": "im2col"})
        assert p.conv_algos["c1"]["forward"] == "im2col", policy


def test_unknown_phase_in_pinned_algorithms_is_an_error():
    with pytest.raises(ValueError, match="phases"):
        sn.plan(conv_net(), "64MiB", "all", conv_algos={"sideways": "im2col"})


def test_rankings_from_recorded_times_order_each_phase_fastest_first():
    """A run's recorded conv times give back its rankings, so a plan made again from them
    takes the algorithms the run took (bench/predict.py)."""
    net = conv_net()
    geometry = workspace.conv_geometry(net["c2"])
    times = {(*geometry, "forward"): {"implicit": 3e-6, "im2col": 1e-6},
             (*geometry, "backward_data"): {"implicit": 1e-6, "transposed": 2e-6,
                                            "zero_insert": 5e-6}}
    rankings = workspace.rankings_of(times)
    assert rankings == {(*geometry, "forward"): ["im2col", "implicit"],
                        (*geometry, "backward_data"): ["implicit", "transposed", "zero_insert"]}
    roomy = sn.plan(net, "64MiB", "all", rankings=rankings)
    assert roomy.conv_algos["c2"]["forward"] == "im2col"


def pool_net():
    net = sn.Net(input_shape=(3, 12, 12), classes=4, batch=2)
    h = net.relu(net.conv(net.data(), 8, kernel=3, padding=1, name="c1"))
    h = net.pool(h, kernel=3, stride=2, padding=1, mode="max", name="mp")
    net.softmax_loss(net.fc(h, 4, name="fc"))
    return net


@pytest.mark.parametrize("policy", ["baseline", "liveness", "offload", "recompute", "all"])
def test_max_pool_backward_gets_its_spare_workspace_under_all_only(policy):
    """Without argmaxes stored by the forward, policy "all" gives the max pool's backward
    its argmax workspace (one byte per window) where the pool has room; the other policies
    plan fixed workspaces only."""
    from tinysn.kernels import pool
    from tinysn.ops import SPARE
    from tinysn.sched.plan import Launch
    net = pool_net()
    p = sn.plan(net, "64MiB", policy, store_argmaxes=False)
    step = next(s for s in p.steps if s.layer == "mp" and s.phase == "backward")
    launch = next(op for op in step.ops if isinstance(op, Launch))
    if policy != "all":
        assert launch.algos is None and launch.workspace is None
        return
    assert launch.algos == {"backward": SPARE}
    need = pool.argmax_workspace_bytes((2, 8, 12, 12), mode="max", kernel=3, stride=2,
                                       padding=1)
    assert need == 2 * 8 * 6 * 6 and p.tensors[launch.workspace].nbytes == need


@pytest.mark.parametrize("policy", ["baseline", "all"])
def test_max_pool_stores_its_argmaxes_where_the_net_fits_unmoved(policy):
    """Where the net fits its cap unmoved the max pool's forward writes one byte per window
    that its backward reads in place of x and of a workspace: x (the ReLU's output) then
    dies after the pool's forward pass, and the peak is lower (but under "baseline", which
    frees nothing)."""
    from tinysn.sched.plan import Free, Launch
    net = pool_net()
    p = sn.plan(net, "64MiB", policy)
    mp = p.net["mp"]
    assert mp.attrs["saves_argmax"]
    saved = p.tensors[p.program.saved[mp]]
    assert saved.dtype == torch.uint8 and saved.nbytes == 2 * 8 * 6 * 6
    x = p.program.act[mp.inputs[0]]
    backward = next(lp for lp in p.program.passes if lp.layer is mp and lp.phase == "backward")
    assert saved.id in backward.reads and x not in backward.reads
    forward = next(s for s in p.steps if s.layer == "mp" and s.phase == "forward")
    assert (Free(x) in forward.ops) == (policy != "baseline")     # baseline frees nothing
    step = next(s for s in p.steps if s.layer == "mp" and s.phase == "backward")
    launch = next(op for op in step.ops if isinstance(op, Launch))
    assert launch.algos is None and launch.workspace is None
    apart = sn.plan(net, "64MiB", policy, store_argmaxes=False)
    assert not apart.net["mp"].attrs.get("saves_argmax") and not apart.program.saved
    if policy != "baseline":
        assert p.peak_bytes < apart.peak_bytes


def test_a_process_keeps_the_rankings_it_planned_with(tmp_path, monkeypatch):
    """Another process that times the same shapes rewrites the rankings file; this process's
    next Runtime still gets the orders its first one planned with, so the two choose alike."""
    net = conv_net()
    keys = workspace.net_keys(net)

    def time_all(todo, scratch, rep_ms, progress):     # no GPU: orders made up
        measured = {k: [f"first-{k[-1]}", "second"] for k in keys}
        return measured, {k: {a: 1.0 for a in v} for k, v in measured.items()}
    monkeypatch.setattr(workspace, "_KEPT", {})
    monkeypatch.setattr(workspace, "rankings_path",
                        lambda device, kind="conv-rankings": str(tmp_path / f"{kind}.json"))
    monkeypatch.setattr(workspace, "_compile_all", lambda *a: None)
    monkeypatch.setattr(workspace, "_time_all", time_all)
    scratch = torch.zeros(8, dtype=torch.uint8)
    first = workspace.measure_rankings(net, scratch, progress=False)
    assert sorted(first) == sorted(keys)
    other = {k: list(reversed(v)) for k, v in first.items()}
    workspace.save_rankings(workspace.rankings_path(None), other)   # the other process
    assert workspace.load_rankings(workspace.rankings_path(None)) == other
    assert workspace.measure_rankings(net, scratch, progress=False) == first


def twin_convs():
    """Two convs of one geometry, c1 with a bias and c2 without."""
    net = sn.Net(input_shape=(4, 6, 6), classes=3, batch=2)
    h = net.relu(net.conv(net.data(), 4, kernel=3, padding=1, name="c1"))
    h = net.conv(h, 4, kernel=3, padding=1, bias=False, name="c2")
    net.softmax_loss(net.fc(h, 3, name="fc"))
    return net


def test_a_weight_gradient_is_ranked_with_a_bias_gradient_where_its_conv_has_one(
        tmp_path, monkeypatch):
    """A conv with a bias computes the bias gradient in its weight-gradient pass and one
    without does not, so the two are timed apart (with db, without) and each conv plans by
    its own ranking, though the geometry is the same."""
    from tinysn.kernels import _common
    net = twin_convs()
    g = workspace.conv_geometry(net["c1"])
    assert workspace.conv_geometry(net["c2"]) == g
    assert workspace.net_keys(net) == [(*g, "forward"), (*g, "backward_data"),
                                       (*g, workspace.BIAS_PHASE), (*g, "backward_weight")]
    with_db = []
    real = conv.backward_weight

    def recording(x, dy, dw, db, **kw):
        with_db.append(db is not None)
        return real(x, dy, dw, db, **kw)
    monkeypatch.setattr(conv, "backward_weight", recording)
    monkeypatch.setattr(_common, "bench_ms", lambda fn, rep_ms=20: fn() or 1.0)
    monkeypatch.setattr(workspace, "_KEPT", {})
    monkeypatch.setattr(workspace, "rankings_path",
                        lambda device, kind="conv-rankings": tmp_path / f"{kind}.json")
    measured = workspace.measure_rankings(net, torch.zeros(1 << 20, dtype=torch.uint8),
                                          progress=False)
    assert set(measured) == set(workspace.net_keys(net))
    algos = len(conv.algos(*g, "backward_weight"))
    assert sorted(with_db) == [False] * 2 * algos + [True] * 2 * algos   # compiled, timed
    rankings = {(*g, workspace.BIAS_PHASE): ["onepass", "splitk"],
                (*g, "backward_weight"): ["splitk", "onepass"]}
    p = sn.plan(net, "64MiB", "all", rankings=rankings)
    assert p.conv_algos["c1"]["backward_weight"] == "onepass"
    assert p.conv_algos["c2"]["backward_weight"] == "splitk"


def test_rankings_path_follows_the_kernels_source(monkeypatch, tmp_path):
    """Rankings are kept per version of the conv kernels: an edit of their source (a tile
    list, an algorithm offered) names another file, the same source the same file."""
    source = tmp_path / "conv.py"
    source.write_text(open(workspace._KERNEL_SOURCES[0]).read())
    monkeypatch.setattr(workspace, "_KERNEL_SOURCES", [str(source)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    before = workspace.rankings_path(None)
    assert workspace.rankings_path(None) == before
    assert workspace.rankings_path(None, "conv-times").name == before.name
    source.write_text(source.read_text() + "\n# a tile list edited\n")
    assert workspace.rankings_path(None) != before
