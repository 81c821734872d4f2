"""Conv kernels (every algorithm of every phase) against torch float64 references.

CPU runs go through Triton's interpreter with tiny shapes; the @pytest.mark.gpu variants run
the same checks on CUDA with precision "ieee" and "tf32".
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import conv
from tinysn.kernels._common import config_count, pinned

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

ALL_ALGOS = {"forward": ("implicit", "im2col", "nhwc", "splitk"),
             "backward_data": ("implicit", "flipped", "transposed", "zero_insert",
                               "flipped_nhwc", "flipped_splitk"),
             "backward_weight": ("onepass", "splitk", "nhwc", "tma")}
# "flipped" and the channels-last algorithms run only some convs (conv._applies); asked for
# elsewhere, they raise ValueError before any write. conv.algos() offers a subset of what
# applies (see test_algos_and_workspaces).


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def _rand(shape, gen, device):
    """Random values in a contiguous view into the middle of a NaN-filled buffer: a kernel that
    reads outside its input and lets that value reach a result produces a NaN there."""
    t = torch.randn(shape, generator=gen, dtype=torch.float64).float()
    pad = t.numel() + 64
    buf = torch.full((t.numel() + 2 * pad,), float("nan"))
    buf[pad:pad + t.numel()] = t.flatten()
    return buf.to(device)[pad:pad + t.numel()].view(shape)


def _nan(shape, device):
    return torch.full(shape, float("nan"), device=device)


def _workspace(nbytes, device):
    """A poisoned workspace (0xFF bytes read as float32 are NaN), 4 spare bytes at the end."""
    return torch.full((nbytes + 4,), 255, dtype=torch.uint8, device=device)


def _close(got, ref, red_len, precision, what):
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN in output (unwritten element?)"
    if precision == "ieee":
        tol = 1e-5 * math.sqrt(max(red_len, 1))
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    else:
        err = (got - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err < 2e-3, f"{what}: relative error {err:.2e}"


SPLIT_ALGOS = ("splitk", "flipped_splitk")    # the forward kernel over reduction chunks


def _check(case, device="cpu", precision="ieee", seed=0, bias=True, accumulate=False,
           dx_none=False, db_none=False, split=True):
    """Run every algorithm of every phase, and backward(), on one conv; compare with float64.
    split=False leaves out SPLIT_ALGOS, whose GEMM is the "implicit" forward's."""
    n, c, h, w, k, r, s, stride, padding = case
    gen = torch.Generator().manual_seed(seed)
    x = _rand((n, c, h, w), gen, device)
    wt = _rand((k, c, r, s), gen, device)
    b = _rand((k,), gen, device) if bias else None
    shp = conv.out_shape(x.shape, wt.shape, stride, padding)
    dy = _rand(shp, gen, device)
    before = _rand(x.shape, gen, device)
    xd, wd, dyd = x.double().cpu(), wt.double().cpu(), dy.double().cpu()
    bd = b.double().cpu() if bias else None

    y_ref = F.conv2d(xd, wd, bd, stride, padding)
    dx_ref = torch.nn.grad.conv2d_input(x.shape, wd, dyd, stride, padding)
    dw_ref = torch.nn.grad.conv2d_weight(xd, wt.shape, dyd, stride, padding)
    db_ref = dyd.sum((0, 2, 3))
    if accumulate:
        dx_ref = dx_ref + before.double().cpu()
    red_fwd = c * r * s
    red_data = k * r * s
    red_wgt = shp[0] * shp[2] * shp[3]

    # forward
    offered = conv.algos(x.shape, wt.shape, stride, padding, "forward")
    assert list(offered)[0] == "implicit" and set(offered) <= set(ALL_ALGOS["forward"])
    for algo in [a for a in ALL_ALGOS["forward"] if split or a not in SPLIT_ALGOS]:
        need = conv.workspace_bytes(x.shape, wt.shape, stride, padding, "forward", algo)
        assert offered.get(algo, need) == need
        y = _nan(shp, device)
        if not conv._applies(algo, x.shape, wt.shape, stride, padding, "forward"):
            with pytest.raises(ValueError, match=f"'{algo}' needs stride 1"):
                conv.forward(x, wt, b, y, stride=stride, padding=padding, algo=algo,
                             workspace=_workspace(need, device))
            assert torch.isnan(y).all()
            continue
        conv.forward(x, wt, b, y, stride=stride, padding=padding, algo=algo,
                     workspace=_workspace(need, device), precision=precision)
        _close(y, y_ref, red_fwd, precision, f"forward/{algo}")
        # the fused ReLU: the same bits as a ReLU after the conv
        fused = _nan(shp, device)
        conv.forward(x, wt, b, fused, stride=stride, padding=padding, algo=algo,
                     workspace=_workspace(need, device), precision=precision, relu=True)
        assert torch.equal(fused, torch.where(y < 0, 0.0, y)), f"forward/{algo}/relu"

    # backward_data
    offered = conv.algos(x.shape, wt.shape, stride, padding, "backward_data")
    for algo in [a for a in ALL_ALGOS["backward_data"] if split or a not in SPLIT_ALGOS]:
        need = conv.workspace_bytes(x.shape, wt.shape, stride, padding, "backward_data", algo)
        assert offered.get(algo, need) == need
        dx = before.clone() if accumulate else _nan(x.shape, device)
        if not conv._applies(algo, x.shape, wt.shape, stride, padding, "backward_data"):
            with pytest.raises(ValueError, match=f"'{algo}' needs stride 1"):
                conv.backward_data(dy, wt, dx, stride=stride, padding=padding, algo=algo,
                                   workspace=_workspace(need, device))
            continue
        conv.backward_data(dy, wt, dx, stride=stride, padding=padding, algo=algo,
                           workspace=_workspace(need, device), accumulate=accumulate,
                           precision=precision)
        _close(dx, dx_ref, red_data, precision, f"backward_data/{algo}/acc={accumulate}")
        # a ReLU's backward fused into the store (x standing for that ReLU's output): the
        # same bits as the ReLU's backward after it
        masked = before.clone() if accumulate else _nan(x.shape, device)
        conv.backward_data(dy, wt, masked, stride=stride, padding=padding, algo=algo,
                           workspace=_workspace(need, device), accumulate=accumulate,
                           precision=precision, relu_output=x)
        assert torch.equal(masked, torch.where(x <= 0, 0.0, dx)), f"backward_data/{algo}/relu"

    # backward_weight
    offered = conv.algos(x.shape, wt.shape, stride, padding, "backward_weight")
    assert {"onepass", "splitk"} <= set(offered) <= set(ALL_ALGOS["backward_weight"])
    assert all(conv._applies(a, x.shape, wt.shape, stride, padding, "backward_weight")
               for a in offered)
    for algo in ALL_ALGOS["backward_weight"]:
        need = conv.workspace_bytes(x.shape, wt.shape, stride, padding, "backward_weight", algo)
        assert offered.get(algo, need) == need
        dw = _nan(wt.shape, device)
        db = None if db_none else _nan((k,), device)
        if not conv._applies(algo, x.shape, wt.shape, stride, padding, "backward_weight"):
            with pytest.raises(ValueError, match=f"'{algo}' needs stride 1"):
                conv.backward_weight(x, dy, dw, db, stride=stride, padding=padding, algo=algo,
                                     workspace=_workspace(need, device))
            assert torch.isnan(dw).all() and (db is None or torch.isnan(db).all())
            continue
        conv.backward_weight(x, dy, dw, db, stride=stride, padding=padding, algo=algo,
                             workspace=_workspace(need, device), precision=precision)
        _close(dw, dw_ref, red_wgt, precision, f"backward_weight/{algo}")
        if db is not None:
            _close(db, db_ref, red_wgt, precision, "db")

    # backward (both phases through one workspace); the algorithm pair rotates with the seed
    algo_data = ALL_ALGOS["backward_data"][seed % 6]
    if not conv._applies(algo_data, x.shape, wt.shape, stride, padding, "backward_data"):
        algo_data = "implicit"
    algo_weight = ALL_ALGOS["backward_weight"][(seed // 3) % 4]
    if not conv._applies(algo_weight, x.shape, wt.shape, stride, padding, "backward_weight"):
        algo_weight = "onepass"
    need = conv.backward_workspace_bytes(x.shape, wt.shape, stride, padding, algo_data,
                                         algo_weight, not dx_none, True)
    dx = None if dx_none else (before.clone() if accumulate else _nan(x.shape, device))
    dw = _nan(wt.shape, device)
    db = None if db_none else _nan((k,), device)
    conv.backward(x, wt, dy, dx, dw, db, stride=stride, padding=padding, algo_data=algo_data,
                  algo_weight=algo_weight, workspace=_workspace(need, device),
                  accumulate=accumulate, precision=precision)
    if dx is not None:
        _close(dx, dx_ref, red_data, precision, f"backward/{algo_data}")
    _close(dw, dw_ref, red_wgt, precision, f"backward/{algo_weight}")
    if db is not None:
        _close(db, db_ref, red_wgt, precision, "backward/db")


@st.composite
def conv_cases(draw, max_n=2, max_c=5, max_hw=7, max_rs=7):
    """(N, C, H, W, K, R, S, stride, padding) with the kernel no larger than the padded input."""
    n = draw(st.integers(1, max_n))
    c = draw(st.integers(1, max_c))
    k = draw(st.integers(1, max_c))
    r = draw(st.integers(1, max_rs))
    s = draw(st.integers(1, max_rs))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    h = draw(st.integers(max(1, r - 2 * ph), max(max_hw, r)))
    w = draw(st.integers(max(1, s - 2 * pw), max(max_hw, s)))
    stride = (sh, sw) if draw(st.booleans()) or sh != sw else sh     # ints and pairs
    padding = (ph, pw) if draw(st.booleans()) or ph != pw else ph
    return n, c, h, w, k, r, s, stride, padding


# edge cases: (N, C, H, W, K, R, S, stride, padding)
EDGE_CASES = [
    (2, 3, 1, 1, 4, 1, 1, 1, 0),            # 1x1 image, 1x1 conv (the GEMM fast path)
    (1, 2, 1, 1, 3, 3, 3, 1, 1),            # 1x1 image, 3x3 kernel: only the centre tap
    (2, 2, 3, 4, 3, 5, 6, 1, 1),            # kernel as large as the padded input: P = Q = 1
    (1, 1, 5, 5, 1, 3, 3, 2, 1),            # single channel in and out, strided
    (1, 3, 7, 7, 4, 1, 7, 1, (0, 3)),       # Inception 1x7
    (1, 3, 7, 7, 4, 7, 1, 1, (3, 0)),       # Inception 7x1
    (2, 3, 7, 6, 5, 1, 1, 2, 0),            # 1x1 stride 2: dx classes with no taps
    (2, 20, 5, 5, 18, 1, 1, 1, 0),          # 1x1 fast path: several M, N and K tiles
    (2, 3, 9, 9, 4, 3, 3, 1, 1),            # several split-K chunks
    (1, 2, 4, 5, 3, 1, 1, 3, 2),            # padding larger than the kernel
    (1, 2, 8, 8, 3, 3, 3, 3, 0),            # uncovered rows/cols of x: zero gradient there
    (2, 3, 9, 7, 2, 7, 7, (2, 3), (3, 2)),  # 7x7 with asymmetric stride and padding
    (2, 8, 5, 6, 12, 3, 3, 1, 1),           # channels-last ("nhwc", "flipped_nhwc")
    (1, 4, 7, 9, 8, 1, 7, 1, (0, 3)),       # channels-last 1x7, patches wider than Q
    (3, 8, 6, 8, 12, 3, 3, 1, 1),           # channels-last, Q % 4 == 0: TMA epilogue loads
    (2, 8, 6, 8, 12, 3, 3, 1, 1),           # channels-last weight gradient (Q % 4 == 0)
    (1, 4, 9, 12, 8, 5, 5, 1, (2, 0)),      # ... 5x5, patches taller than P, no side padding
    (3, 5, 7, 7, 6, 3, 3, 1, 1),            # "tma" weight gradient: rows widened 7 -> 8
    (2, 6, 3, 8, 5, 1, 1, 1, 0),            # ... a 1x1 read in place (no copies)
    (1, 64, 4, 4, 8, 3, 3, 1, 1),           # split-K forward: 2 chunks of C*R*S
    (1, 8, 4, 4, 64, 3, 3, 1, 1),           # split-K data gradient: 2 chunks of K*R*S
]


# --------------------------------------------------------------------------------------------
# CPU (interpreter)
# --------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(case=conv_cases(), seed=st.integers(0, 2**16), bias=st.booleans(),
       accumulate=st.booleans(), dx_none=st.booleans(), db_none=st.booleans())
def test_conv_random_shapes(case, seed, bias, accumulate, dx_none, db_none):
    # the split-K algorithms left out: these reductions (C*R*S <= 245) never split, and
    # the edge cases run them in one chunk and in two
    _check(case, "cpu", "ieee", seed, bias, accumulate, dx_none, db_none, split=False)


@pytest.mark.parametrize("case", EDGE_CASES)
def test_conv_edge_cases(case):
    i = EDGE_CASES.index(case)
    _check(case, "cpu", "ieee", seed=i, bias=i % 2 == 0, accumulate=i % 3 == 1,
           dx_none=i % 4 == 3, db_none=i % 5 == 2)


# each GPU config of every conv kernel: a 3x3 with several pixel tiles of the largest tile
# and several reduction blocks, a strided 7x7 (the data gradient's residue classes), a 1x1 on
# the GEMM fast path
CONFIG_CASES = [
    (2, 12, 12, 12, 20, 3, 3, 1, 1),
    (1, 3, 9, 9, 5, 7, 7, 2, 3),
    (2, 40, 6, 6, 36, 1, 1, 1, 0),
]


@pytest.mark.parametrize("index", range(config_count(conv)))
def test_conv_every_config(index):
    """Every config of every conv autotuner on three cases; the split-K algorithms run the
    forward kernel under the same configs as "implicit" and "flipped" (left out: CI time)."""
    with pinned(conv, index):
        for j, case in enumerate(CONFIG_CASES):
            _check(case, "cpu", "ieee", seed=index, bias=j != 1, accumulate=(index + j) % 2 == 1,
                   split=False)


def test_splitk_really_splits_and_is_deterministic():
    case = (2, 3, 9, 9, 4, 3, 3, 1, 1)
    assert conv.splitk_splits((2, 3, 9, 9), (4, 3, 3, 3), 1, 1) > 1
    gen = torch.Generator().manual_seed(3)
    x, w, dy = _rand((2, 3, 9, 9), gen, "cpu"), _rand((4, 3, 3, 3), gen, "cpu"), \
        _rand((2, 4, 9, 9), gen, "cpu")
    need = conv.workspace_bytes(x.shape, w.shape, 1, 1, "backward_weight", "splitk")
    outs = []
    for _ in range(2):
        dw, db = _nan(w.shape, "cpu"), _nan((4,), "cpu")
        conv.backward_weight(x, dy, dw, db, stride=1, padding=1, algo="splitk",
                             workspace=torch.zeros(need // 4, dtype=torch.float32),
                             precision="ieee")
        outs.append((dw, db))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert conv._TUNED      # the second launch took the direct path (autotuner's pick cached)
    _check(case, "cpu", "ieee", seed=5)



def test_splitk_forward_cuts_small_grids_only():
    """ResNet-50's 7- and 14-pixel layers at batch 32 (49-98 tiles of [128, 128]) are offered
    the split-K forward, in chunks of whole 64s of at least 256; larger grids are not."""
    def splits(c, hw, k, r, stride=1):
        return conv.forward_splits((32, c, hw, hw), (k, c, r, r), stride, r // 2)
    assert splits(512, 7, 512, 3) == 5            # 52 tiles, 4,608 long
    assert splits(1024, 14, 256, 1) == 2          # 98 tiles
    assert splits(256, 28, 256, 3, stride=2) == 2
    assert splits(2048, 7, 512, 1) == 5
    assert splits(64, 56, 64, 3) == 1             # 784 tiles
    assert splits(512, 7, 2048, 1) == 1           # 208 tiles
    assert splits(64, 7, 64, 1) == 1              # too short to cut
    xs, ws = (32, 512, 7, 7), (512, 512, 3, 3)
    f = conv.algos(xs, ws, 1, 1, "forward")
    assert f["splitk"] == 4 * 5 * 32 * 512 * 7 * 7
    assert "splitk" not in conv.algos((32, 64, 56, 56), (64, 64, 3, 3), 1, 1, "forward")


def test_splitk_forward_sums_its_chunks_in_order():
    """Each chunk is the plain kernel over its slice of the reduction (a chunk computed alone
    through "implicit" on those input channels gives its partial to the bit), and the sum
    adds them in chunk order, then the bias and the ReLU."""
    gen = torch.Generator().manual_seed(11)
    x, w, b = _rand((2, 512, 3, 3), gen, "cpu"), _rand((8, 512, 1, 1), gen, "cpu"), \
        _rand((8,), gen, "cpu")
    assert conv.forward_splits(x.shape, w.shape, 1, 0) == 2
    need = conv.workspace_bytes(x.shape, w.shape, 1, 0, "forward", "splitk")
    y = _nan((2, 8, 3, 3), "cpu")
    conv.forward(x, w, b, y, stride=1, padding=0, algo="splitk", precision="ieee",
                 workspace=_workspace(need, "cpu"), relu=True)
    parts = []
    for half in (slice(0, 256), slice(256, 512)):
        part = _nan((2, 8, 3, 3), "cpu")
        conv.forward(x[:, half].contiguous(), w[:, half].contiguous(), None, part, stride=1,
                     padding=0, precision="ieee")
        parts.append(part)
    expected = torch.relu(parts[0] + parts[1] + b[None, :, None, None])
    assert torch.equal(y, expected)


def test_flipped_splitk_data_gradient_splits_the_flipped_conv():
    """The split-K data gradient runs the flipped conv's split-K forward: offered on the same
    small grids (stride 1), summed in order, then the old dx added and the ReLU mask."""
    assert conv.data_splits((32, 512, 7, 7), (512, 512, 3, 3), 1, 1) == 5
    assert conv.data_splits((32, 256, 14, 14), (1024, 256, 1, 1), 1, 0) == 2
    assert "flipped_splitk" not in conv.algos((32, 64, 56, 56), (64, 64, 3, 3), 1, 1,
                                              "backward_data")
    assert "flipped_splitk" not in conv.algos((32, 256, 28, 28), (256, 256, 3, 3), 2, 1,
                                              "backward_data")     # strided: no flip
    gen = torch.Generator().manual_seed(12)
    x = _rand((2, 8, 3, 3), gen, "cpu")
    w, dy, old = _rand((512, 8, 1, 1), gen, "cpu"), _rand((2, 512, 3, 3), gen, "cpu"), \
        _rand((2, 8, 3, 3), gen, "cpu")
    assert conv.data_splits(x.shape, w.shape, 1, 0) == 2
    need = conv.workspace_bytes(x.shape, w.shape, 1, 0, "backward_data", "flipped_splitk")
    dx = old.clone()
    conv.backward_data(dy, w, dx, stride=1, padding=0, algo="flipped_splitk",
                       workspace=_workspace(need, "cpu"), accumulate=True, precision="ieee",
                       relu_output=x)
    parts = []
    for half in (slice(0, 256), slice(256, 512)):
        part = _nan(x.shape, "cpu")
        conv.backward_data(dy[:, half].contiguous(), w[half].contiguous(), part, stride=1,
                           padding=0, algo="flipped", precision="ieee",
                           workspace=_workspace(4 * 256 * 8, "cpu"))
        parts.append(part)
    assert torch.equal(dx, torch.where(x <= 0, 0.0, parts[0] + parts[1] + old))


def test_launch_counts_are_the_kernels_each_algorithm_runs(monkeypatch, conv_phase):
    """conv.LAUNCHES, which the step-time model charges the host per call (eager), names every
    (phase, algorithm) and counts the Triton launches one call without a bias makes (the
    kernels stubbed: only the calls are counted)."""
    from triton.runtime import interpreter
    calls = []
    monkeypatch.setattr(interpreter.InterpretedFunction, "run",
                        lambda self, *args, **kwargs: calls.append(self.fn.__name__))
    assert set(conv.LAUNCHES) == {(p, a) for p in conv.PHASES for a in ALL_ALGOS[p]}
    x, w, dy = torch.zeros(2, 8, 8, 8), torch.zeros(12, 8, 3, 3), torch.zeros(2, 12, 8, 8)
    for (phase, algo), launches in conv.LAUNCHES.items():
        calls.clear()
        conv_phase(phase, algo, x, w, dy)
        assert len(calls) == launches, (phase, algo, calls)


@pytest.mark.parametrize("total,splits", [(5, 1), (7, 37), (130, 70)])
def test_splitk_reduce_adds_the_chunks_in_order(total, splits):
    """The split-K sum is the plain loop's, bit for bit: chunks added in order, whatever
    number of them it loads ahead (a remainder past the last chunk included)."""
    gen = torch.Generator().manual_seed(total)
    # magnitudes over 12 decades: another order of the adds would round differently
    chunks = torch.randn(splits, total, generator=gen) * \
        10.0 ** torch.randint(-6, 6, (splits, total), generator=gen)
    out = torch.full((total,), float("nan"))
    conv._launch_splitk_reduce(chunks.flatten(), out, total, splits)
    expected = torch.zeros(total)
    for chunk in chunks:
        expected = expected + chunk
    assert torch.equal(out, expected)
    if splits > 1:      # the values make the order show
        reverse = torch.zeros(total)
        for chunk in chunks.flip(0):
            reverse = reverse + chunk
        assert not torch.equal(reverse, expected)

def test_algos_and_workspaces():
    xs, ws = (32, 64, 56, 56), (64, 64, 3, 3)
    assert conv.out_shape(xs, ws, 1, 1) == (32, 64, 56, 56)
    assert conv.out_shape((1, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3)) == (1, 64, 112, 112)
    assert conv.out_shape((1, 3, 17, 17), (4, 3, 1, 7), 1, (0, 3)) == (1, 4, 17, 17)
    f = conv.algos(xs, ws, 1, 1, "forward")
    # "nhwc": a channels-last copy of x and of the weight
    assert f == {"implicit": 0, "im2col": 4 * 32 * 64 * 9 * 56 * 56,
                 "nhwc": 4 * (32 * 64 * 56 * 56 + 64 * 64 * 9)}
    assert conv.algos(xs, ws, 1, 1, "backward_data") == {
        "implicit": 0, "flipped": 4 * 64 * 64 * 9, "transposed": 4 * 64 * 64 * 9,
        "flipped_nhwc": 4 * (32 * 64 * 56 * 56 + 64 * 64 * 9)}
    # channels-last needs stride 1 and channel counts divisible by 4
    assert "nhwc" not in conv.algos((32, 3, 56, 56), (64, 3, 3, 3), 1, 1, "forward")
    assert "flipped_nhwc" not in conv.algos((32, 64, 56, 56), (66, 64, 3, 3), 1, 1,
                                            "backward_data")
    # "flipped" needs stride 1 and padding below the kernel size
    assert list(conv.algos(xs, ws, 1, 3, "backward_data")) == ["implicit", "transposed"]
    assert list(conv.algos(xs, ws, (1, 2), 1, "backward_data")) == [
        "implicit", "transposed", "zero_insert"]
    d2 = conv.algos(xs, ws, 2, 1, "backward_data")
    assert list(d2) == ["implicit", "transposed", "zero_insert"]
    assert d2["zero_insert"] == 4 * 32 * 64 * 58 * 58
    assert d2["transposed"] == 4 * 64 * 64 * 9
    wg = conv.algos(xs, ws, 1, 1, "backward_weight")
    assert list(wg)[0] == "splitk" and wg["onepass"] == 0
    # "splitk": a partial dW per chunk, then a partial db per chunk
    assert wg["splitk"] == 4 * conv.splitk_splits(xs, ws, 1, 1) * 64 * (64 * 9 + 1)
    # "nhwc": x channels-last, then the split-K chunks; it needs Q divisible by 4 too, and
    # is offered only on outputs larger than 112x112 (it applies to 56x56)
    big = (32, 64, 224, 224)
    wb = conv.algos(big, ws, 1, 1, "backward_weight")
    assert wb["nhwc"] == 4 * 32 * 64 * 224 * 224 + \
        4 * conv.splitk_splits(big, ws, 1, 1) * 64 * 64 * 9
    assert "nhwc" not in wg and conv._applies("nhwc", xs, ws, (1, 1), 1, "backward_weight")
    assert "nhwc" not in conv.algos((32, 64, 112, 112), ws, 1, 1, "backward_weight")
    assert not conv._applies("nhwc", (32, 64, 14, 14), ws, (1, 1), 1, "backward_weight")
    assert not conv._applies("nhwc", big, ws, (2, 2), 1, "backward_weight")
    # "tma": x shifted by each kernel column, then the split-K chunks; rows of 14 pixels are
    # widened to 16 and dY is widened too; a 1x1 over rows of 56 reads x and dY in place
    assert wg["tma"] == 4 * (3 * 32 * 64 * 56 * 56 + conv.tma_splits(xs, ws) * 64 * 64 * 9)
    w14 = conv.algos((32, 64, 14, 14), ws, 1, 1, "backward_weight")["tma"]
    assert w14 == 4 * (3 * 32 * 64 * 14 * 16 + 32 * 64 * 14 * 16 +
                       conv.tma_splits((32, 64, 14, 14), ws) * 64 * 64 * 9)
    one = (64, 64, 1, 1)
    assert conv.algos(xs, one, 1, 0, "backward_weight")["tma"] == \
        4 * conv.tma_splits(xs, one) * 64 * 64
    assert "tma" not in conv.algos(xs, ws, 2, 1, "backward_weight")       # stride 2
    assert "tma" not in conv.algos(xs, ws, 1, 0, "backward_weight")       # output 54x54
    # the channels-last forward and data gradient: offered from 28x28 output pixels up
    small = (32, 64, 14, 14)
    assert "nhwc" in conv.algos((32, 64, 28, 28), ws, 1, 1, "forward")
    assert "nhwc" not in conv.algos(small, ws, 1, 1, "forward")
    assert "flipped_nhwc" not in conv.algos(small, ws, 1, 1, "backward_data")
    assert conv._applies("nhwc", small, ws, (1, 1), 1)
    assert conv._applies("flipped_nhwc", small, ws, (1, 1), 1, "backward_data")
    # a conv with many output tiles gains nothing from split-K
    assert list(conv.algos((32, 512, 7, 7), (2048, 512, 3, 3), 1, 1,
                           "backward_weight"))[0] == "onepass"
    assert conv.backward_workspace_bytes(xs, ws, 2, 1, "zero_insert", "splitk") == max(
        d2["zero_insert"], conv.workspace_bytes(xs, ws, 2, 1, "backward_weight", "splitk"))


def test_transposed_matches_implicit():
    """"transposed": workspace = one float per weight, wT's layout is [R, S, C, K], and dx
    agrees with "implicit" (strided and padded; plain and accumulate, which under the
    interpreter run the nested and the flat loop; K = 20 runs two k-chunks, the second
    masked, under the interpreter's BLOCK_K = 16)."""
    gen = torch.Generator().manual_seed(7)
    for xs, ws, stride, padding, acc in [((2, 5, 9, 8), (20, 5, 3, 3), (2, 1), 1, False),
                                         ((2, 5, 9, 8), (20, 5, 3, 3), (2, 1), 1, True),
                                         ((1, 3, 7, 7), (4, 3, 5, 3), 1, (2, 3), True),
                                         ((1, 3, 7, 7), (20, 3, 5, 3), 1, (2, 3), False)]:
        need = conv.workspace_bytes(xs, ws, stride, padding, "backward_data", "transposed")
        assert need == 4 * math.prod(ws)
        assert conv.backward_workspace_bytes(xs, ws, stride, padding, "transposed", "onepass") \
            == need
        w, before = _rand(ws, gen, "cpu"), _rand(xs, gen, "cpu")
        dy = _rand(conv.out_shape(xs, ws, stride, padding), gen, "cpu")
        outs = {}
        for algo in ("implicit", "transposed"):
            dx = before.clone() if acc else _nan(xs, "cpu")
            wsp = _workspace(need, "cpu")
            conv.backward_data(dy, w, dx, stride=stride, padding=padding, algo=algo,
                               workspace=wsp, accumulate=acc, precision="ieee")
            outs[algo] = dx
        _close(outs["transposed"], outs["implicit"], ws[0] * ws[2] * ws[3], "ieee",
               f"transposed vs implicit {xs} {ws} {stride} {padding}")
        # the workspace now holds wT[r, s, c, k] = w[k, c, r, s]
        wt = wsp[:need].view(torch.float32).view(ws[2], ws[3], ws[1], ws[0])
        assert torch.equal(wt, w.permute(2, 3, 1, 0))


def test_flipped_matches_implicit():
    """"flipped": workspace = one float per weight holding wF[c, k, r, s] = w[k, c, R-1-r,
    S-1-s], and dx agrees with "implicit" (3x3, asymmetric kernel and padding, 1x1 on the GEMM
    path; plain and accumulate). Stride 2 and padding >= kernel are refused before any write."""
    gen = torch.Generator().manual_seed(8)
    for xs, ws, padding, acc in [((2, 5, 9, 8), (20, 5, 3, 3), 1, False),
                                 ((1, 3, 7, 7), (4, 3, 5, 3), (2, 0), True),
                                 ((2, 6, 4, 4), (7, 6, 1, 1), 0, True)]:
        need = conv.workspace_bytes(xs, ws, 1, padding, "backward_data", "flipped")
        assert need == 4 * math.prod(ws)
        w, before = _rand(ws, gen, "cpu"), _rand(xs, gen, "cpu")
        dy = _rand(conv.out_shape(xs, ws, 1, padding), gen, "cpu")
        outs = {}
        for algo in ("implicit", "flipped"):
            dx = before.clone() if acc else _nan(xs, "cpu")
            wsp = _workspace(need, "cpu")
            conv.backward_data(dy, w, dx, stride=1, padding=padding, algo=algo,
                               workspace=wsp, accumulate=acc, precision="ieee")
            outs[algo] = dx
        _close(outs["flipped"], outs["implicit"], ws[0] * ws[2] * ws[3], "ieee",
               f"flipped vs implicit {xs} {ws} {padding}")
        wf = wsp[:need].view(torch.float32).view(ws[1], ws[0], ws[2], ws[3])
        assert torch.equal(wf, w.transpose(0, 1).flip(2, 3))
    x, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    for stride, padding in ((2, 1), (1, 3)):
        dy = torch.randn(conv.out_shape(x.shape, w.shape, stride, padding))
        dx = torch.full(x.shape, 7.0)
        wsp = _workspace(4 * w.numel(), "cpu")
        with pytest.raises(ValueError, match="'flipped' needs stride 1"):
            conv.backward_data(dy, w, dx, stride=stride, padding=padding, algo="flipped",
                               workspace=wsp)
        with pytest.raises(ValueError, match="'flipped' needs stride 1"):
            conv.backward(x, w, dy, dx, None, None, stride=stride, padding=padding,
                          algo_data="flipped", workspace=wsp)
        assert bool((dx == 7.0).all())


def test_nhwc_tiles_share_images_where_one_image_would_overhang():
    """A channels-last forward tile is one image's patch where that covers whole rows (224:
    4 rows of 32 per 128 pixels, as tall as the tile), else the same patch of several images
    (28: 4 rows of 8 images, where 32 rows of one would run 4 past the image), and never more
    images than the batch needs (one image of 28 rows: one 32-row patch)."""
    def patch(n, p, block_m=128):
        tw = conv._tile_w(p)
        return (*conv._patch(block_m, tw, conv._tile_h_cap(n, p, tw)), tw)
    assert patch(32, 224) == (4, 1, 32) and patch(32, 224, 256) == (8, 1, 32)
    assert patch(32, 112) == (8, 1, 16)
    assert patch(32, 56) == (8, 2, 8)
    assert patch(32, 28) == (4, 8, 4) and patch(32, 28, 64) == (4, 4, 4)
    assert patch(32, 14) == (2, 32, 2)
    assert patch(1, 28) == (32, 1, 4)


def test_nhwc_workspace_holds_channels_last_copies():
    """"nhwc" leaves x as [N, H, W, C] in the workspace, then the weight as [K, R, S, C];
    "flipped_nhwc" dY as [N, P, Q, K], then the flipped weight as [C, R, S, K] (W[k, c, R-1-r,
    S-1-s]); both results agree with "implicit" (the data gradient accumulating)."""
    gen = torch.Generator().manual_seed(9)
    xs, ws, padding = (2, 8, 5, 6), (12, 8, 3, 2), (1, 0)
    x, w, before = _rand(xs, gen, "cpu"), _rand(ws, gen, "cpu"), _rand(xs, gen, "cpu")
    shp = conv.out_shape(xs, ws, 1, padding)
    dy = _rand(shp, gen, "cpu")
    n, c, h, wd = xs
    k, _, r, s = ws
    need = conv.workspace_bytes(xs, ws, 1, padding, "forward", "nhwc")
    wsp = _workspace(need, "cpu")
    y, y_ref = _nan(shp, "cpu"), _nan(shp, "cpu")
    conv.forward(x, w, None, y, stride=1, padding=padding, algo="nhwc", workspace=wsp,
                 precision="ieee")
    conv.forward(x, w, None, y_ref, stride=1, padding=padding, precision="ieee")
    _close(y, y_ref, c * r * s, "ieee", "nhwc vs implicit")
    held = wsp[:need].view(torch.float32)
    assert torch.equal(held[:x.numel()].view(n, h, wd, c), x.permute(0, 2, 3, 1))
    assert torch.equal(held[x.numel():].view(k, r, s, c), w.permute(0, 2, 3, 1))

    need = conv.workspace_bytes(xs, ws, 1, padding, "backward_data", "flipped_nhwc")
    wsp = _workspace(need, "cpu")
    dx, dx_ref = before.clone(), before.clone()
    conv.backward_data(dy, w, dx, stride=1, padding=padding, algo="flipped_nhwc", workspace=wsp,
                       accumulate=True, precision="ieee")
    conv.backward_data(dy, w, dx_ref, stride=1, padding=padding, accumulate=True,
                       precision="ieee")
    _close(dx, dx_ref, k * r * s, "ieee", "flipped_nhwc vs implicit")
    held = wsp[:need].view(torch.float32)
    assert torch.equal(held[:dy.numel()].view(n, shp[2], shp[3], k), dy.permute(0, 2, 3, 1))
    assert torch.equal(held[dy.numel():].view(c, r, s, k),
                       w.flip(2, 3).permute(1, 2, 3, 0))


def _weight_in_workspace(algo, xs, ws, seed):
    """Run the weight gradient `algo` of a 3x3 pad-1 conv on random x [xs] and dY into a
    poisoned workspace; check dW against "splitk"'s. Returns x, dY, dW and the workspace's
    used floats."""
    gen = torch.Generator().manual_seed(seed)
    x = _rand(xs, gen, "cpu")
    dy = _rand(conv.out_shape(xs, ws, 1, 1), gen, "cpu")
    need = conv.workspace_bytes(xs, ws, 1, 1, "backward_weight", algo)
    wsp = _workspace(need, "cpu")
    dw, dw_ref = _nan(ws, "cpu"), _nan(ws, "cpu")
    conv.backward_weight(x, dy, dw, None, stride=1, padding=1, algo=algo, workspace=wsp,
                         precision="ieee")
    conv.backward_weight(x, dy, dw_ref, None, stride=1, padding=1, algo="splitk",
                         workspace=_workspace(need, "cpu"), precision="ieee")
    _close(dw, dw_ref, dy.numel() // ws[0], "ieee", f"{algo} vs splitk")
    return x, dy, dw, wsp[:need].view(torch.float32)


def test_tma_weight_gradient_workspace_holds_shifted_copies_and_the_chunks():
    """The "tma" weight gradient leaves x shifted by each kernel column (rows widened to a
    multiple of 4 pixels, zeros outside the image) in the workspace, then dY widened where
    its rows are not a multiple of 4, then its split-K chunks [splits, K, C, R, S], which sum
    (in order) to dW, equal to "splitk"'s within rounding."""
    xs, ws = (2, 8, 5, 6), (12, 8, 3, 3)
    splits = conv.tma_splits(xs, ws)
    assert splits > 1
    x, dy, dw, held = _weight_in_workspace("tma", xs, ws, seed=5)
    wide = torch.zeros(2, 8, 5, 8 + 2)          # x widened to 8 columns, one zero each side
    wide[..., 1:7] = x
    copies = held[:3 * 2 * 8 * 5 * 8].view(3, 2, 8, 5, 8)
    for s in range(3):
        assert torch.equal(copies[s], wide[..., s:s + 8] * (torch.arange(8) < 6)), s
    dy_wide = held[3 * 2 * 8 * 5 * 8:][:2 * 12 * 5 * 8].view(2, 12, 5, 8)
    assert torch.equal(dy_wide[..., :6], dy) and not dy_wide[..., 6:].any()
    chunks = held[3 * 2 * 8 * 5 * 8 + 2 * 12 * 5 * 8:].view(splits, *ws)
    assert torch.equal(sum(chunks[i] for i in range(splits)), dw)


def test_nhwc_weight_gradient_workspace_holds_x_channels_last_and_the_chunks():
    """The "nhwc" weight gradient leaves x as [N, H, W, C] in the workspace, then its split-K
    chunks [splits, K, C, R, S], which sum (in order) to dW, equal to "splitk"'s."""
    xs, ws = (2, 8, 5, 8), (12, 8, 3, 3)
    splits = conv.splitk_splits(xs, ws, 1, 1)
    assert splits > 1
    x, dy, dw, held = _weight_in_workspace("nhwc", xs, ws, seed=4)
    assert torch.equal(held[:x.numel()].view(2, 5, 8, 8), x.permute(0, 2, 3, 1))
    chunks = held[x.numel():].view(splits, *ws)
    assert torch.equal(sum(chunks[i] for i in range(splits)), dw)


def test_bad_input_raises():
    x = torch.randn(1, 3, 5, 5)
    w = torch.randn(4, 3, 3, 3)
    y = torch.empty(1, 4, 5, 5)
    dy = torch.randn(1, 4, 5, 5)
    kw = dict(stride=1, padding=1)
    with pytest.raises(ValueError, match="larger than the padded input"):
        conv.out_shape((1, 3, 2, 2), (4, 3, 5, 5), 1, 1)
    with pytest.raises(ValueError, match="larger than the padded input"):
        conv.forward(torch.randn(1, 3, 2, 2), torch.randn(4, 3, 5, 5), None, y,
                     stride=1, padding=1)
    with pytest.raises(ValueError, match="input channels"):
        conv.forward(x, torch.randn(4, 2, 3, 3), None, y, **kw)
    with pytest.raises(ValueError, match="shape"):
        conv.forward(x, w, None, torch.empty(1, 4, 4, 4), **kw)
    with pytest.raises(ValueError, match="shape"):
        conv.forward(x, w, torch.randn(5), y, **kw)
    with pytest.raises(ValueError, match="float32"):
        conv.forward(x.double(), w, None, y, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        conv.forward(x.transpose(2, 3), w, None, y, **kw)
    with pytest.raises(ValueError, match="4-D"):
        conv.forward(x[0], w, None, y, **kw)
    with pytest.raises(ValueError, match="stride"):
        conv.forward(x, w, None, y, stride=0, padding=1)
    with pytest.raises(ValueError, match="stride"):
        conv.forward(x, w, None, y, stride=(1, 1, 1), padding=1)
    with pytest.raises(ValueError, match="padding"):
        conv.forward(x, w, None, y, stride=1, padding=-1)
    with pytest.raises(ValueError, match="algo"):
        conv.forward(x, w, None, y, algo="fft", **kw)
    with pytest.raises(ValueError, match="precision"):
        conv.forward(x, w, None, y, precision="fp16", **kw)
    y.fill_(7.0)
    with pytest.raises(ValueError, match="relu must be a bool"):
        conv.forward(x, w, None, y, relu=1, **kw)
    assert (y == 7.0).all()
    dx = torch.full((1, 3, 5, 5), 7.0)
    with pytest.raises(ValueError, match="relu_output"):
        conv.backward_data(dy, w, dx, relu_output=torch.randn(1, 3, 4, 4), **kw)
    with pytest.raises(ValueError, match="x_is_relu_output must be a bool"):
        conv.backward(x, w, dy, dx, None, None, x_is_relu_output=None, **kw)
    assert (dx == 7.0).all()
    with pytest.raises(ValueError, match="phase"):
        conv.algos(x.shape, w.shape, 1, 1, "sideways")
    need = conv.workspace_bytes(x.shape, w.shape, 1, 1, "forward", "im2col")
    with pytest.raises(ValueError, match="workspace too small"):
        conv.forward(x, w, None, y, algo="im2col", workspace=torch.empty(need - 4,
                                                                          dtype=torch.uint8), **kw)
    with pytest.raises(ValueError, match="needs a workspace"):
        conv.forward(x, w, None, y, algo="im2col", **kw)
    with pytest.raises(ValueError, match="workspace must be"):
        conv.forward(x, w, None, y, algo="im2col", workspace=torch.empty(need, dtype=torch.int32),
                     **kw)
    buf = torch.randn(200)
    with pytest.raises(ValueError, match="overlaps"):
        conv.forward(buf[:75].view(1, 3, 5, 5), w, None, buf[50:150].view(1, 4, 5, 5), **kw)
    need = conv.workspace_bytes(x.shape, w.shape, 2, 1, "backward_data", "zero_insert")
    with pytest.raises(ValueError, match="workspace too small"):
        conv.backward_data(torch.randn(1, 4, 3, 3), w, torch.empty(1, 3, 5, 5), stride=2,
                           padding=1, algo="zero_insert",
                           workspace=torch.empty(need // 4 - 1, dtype=torch.float32))
    with pytest.raises(ValueError, match="shape"):
        conv.backward_data(torch.randn(1, 4, 4, 4), w, torch.empty(1, 3, 5, 5), **kw)
    with pytest.raises(ValueError, match="accumulate"):
        conv.backward_data(dy, w, torch.empty(1, 3, 5, 5), accumulate=1, **kw)
    with pytest.raises(ValueError, match="needs a workspace"):
        conv.backward_data(dy, w, torch.empty(1, 3, 5, 5), algo="transposed", **kw)
    need = conv.workspace_bytes(x.shape, w.shape, 1, 1, "backward_weight", "splitk")
    with pytest.raises(ValueError, match="workspace too small"):
        conv.backward_weight(x, dy, torch.empty(4, 3, 3, 3), None, algo="splitk",
                             workspace=torch.empty(need - 1, dtype=torch.uint8), **kw)
    with pytest.raises(ValueError, match="shape"):
        conv.backward_weight(x, dy, torch.empty(4, 3, 3, 3), torch.empty(3), **kw)
    x4, w4 = torch.randn(1, 4, 8, 8), torch.randn(4, 4, 3, 3)
    dy_odd = torch.randn(257)[1:].view(1, 4, 8, 8)         # 4 bytes past a 16-byte boundary
    need = conv.workspace_bytes(x4.shape, w4.shape, 1, 1, "backward_weight", "nhwc")
    dw4, db4 = torch.full((4, 4, 3, 3), 7.0), torch.full((4,), 7.0)
    with pytest.raises(ValueError, match="'nhwc' needs dy 16-byte aligned"):
        conv.backward_weight(x4, dy_odd, dw4, db4, algo="nhwc",
                             workspace=torch.empty(need, dtype=torch.uint8), **kw)
    assert bool((dw4 == 7.0).all() and (db4 == 7.0).all())
    x_odd = torch.randn(257)[1:].view(1, 4, 8, 8)          # "tma" reads a 1x1's x in place
    need = conv.workspace_bytes(x4.shape, (4, 4, 1, 1), 1, 0, "backward_weight", "tma")
    dw1 = torch.full((4, 4, 1, 1), 7.0)
    with pytest.raises(ValueError, match="'tma' needs x 16-byte aligned"):
        conv.backward_weight(x_odd, x4, dw1, db4, algo="tma", stride=1, padding=0,
                             workspace=torch.empty(need, dtype=torch.uint8))
    assert bool((dw1 == 7.0).all() and (db4 == 7.0).all())
    with pytest.raises(ValueError, match="shape"):
        conv.backward(x, w, dy, torch.empty(1, 3, 4, 5), None, None, **kw)
    with pytest.raises(ValueError, match="input channels"):
        conv.backward(x, torch.randn(4, 2, 3, 3), dy, None, torch.empty(4, 2, 3, 3), None, **kw)
    with pytest.raises(ValueError, match="32-bit"):      # checked before any tensor is touched
        conv._geometry((1, 2 ** 16, 1, 1), (2 ** 15, 2 ** 16, 1, 1), 1, 0)
    with pytest.raises(ValueError, match="pair of ints"):
        conv.out_shape(x.shape, w.shape, {1: 1}, 1)


def test_backward_skips_missing_gradients():
    gen = torch.Generator().manual_seed(1)
    x, w, dy = _rand((1, 2, 5, 5), gen, "cpu"), _rand((3, 2, 3, 3), gen, "cpu"), \
        _rand((1, 3, 5, 5), gen, "cpu")
    conv.backward(x, w, dy, None, None, None, stride=1, padding=1)       # nothing to do
    db = _nan((3,), "cpu")
    conv.backward(x, w, dy, None, None, db, stride=1, padding=1, precision="ieee")
    _close(db, dy.double().sum((0, 2, 3)), 25, "ieee", "db only")
    db = _nan((3,), "cpu")
    conv.backward_weight(x, dy, None, db, stride=1, padding=1)
    _close(db, dy.double().sum((0, 2, 3)), 25, "ieee", "db only (backward_weight)")



@pytest.mark.parametrize("tile", [0, 8, 64, conv.INTERP_TILE])
@pytest.mark.parametrize("programs", [1, 4, 10 ** 6])
def test_bias_grad_tile_layouts(tile, programs, monkeypatch):
    """The bias gradient in every tile layout: the GPU's (tile 0: one channel and image per
    step), small tiles (several programs, loops over images and pixels with masked tails) and
    the interpreter's; K, N and P*Q are not powers of two. With the weight gradient it sums
    image groups into dW's room first (as many groups as the program target and the room
    allow: one, some, one per image), then adds the groups."""
    monkeypatch.setattr(conv, "_BIAS_TILE", tile)
    monkeypatch.setattr(conv, "_BIAS_PROGRAMS", programs)
    gen = torch.Generator().manual_seed(tile)
    for n, k, p in ((3, 5, 3), (5, 3, 7), (6, 3, 2), (1, 1, 1), (7, 2, 4)):
        x, dy = _rand((n, 2, p, p), gen, "cpu"), _rand((n, k, p, p), gen, "cpu")
        db_ref = dy.double().sum((0, 2, 3))
        db = _nan((k,), "cpu")
        conv.backward_weight(x, dy, None, db, stride=1, padding=0)
        _close(db, db_ref, n * p * p, "ieee", f"db tile {tile}")
        dw, db = _nan((k, 2, 1, 1), "cpu"), _nan((k,), "cpu")
        ws = _workspace(conv.workspace_bytes(x.shape, dw.shape, 1, 0, "backward_weight",
                                             "tma"), "cpu")
        conv.backward_weight(x, dy, dw, db, stride=1, padding=0, algo="tma", workspace=ws,
                             precision="ieee")         # "tma": db is the bias kernel's
        _close(db, db_ref, n * p * p, "ieee", f"db tile {tile}, {programs} programs")
        _close(dw, torch.nn.grad.conv2d_weight(x.double(), dw.shape, dy.double()), n * p * p,
               "ieee", "dw after the partial sums")
        groups = conv.bias_groups(n, k, p * p, dw.numel())
        assert groups == {1: 1, 10 ** 6: min(n, 2)}.get(programs, groups)   # room: 2 per channel
        assert conv.bias_grad_launches(n, k, p * p, dw.numel()) == 1 + (groups > 1)


@pytest.mark.parametrize("algo", ["onepass", "splitk"])
def test_weight_gemm_sums_the_bias_gradient(algo, monkeypatch):
    """With "onepass" or "splitk" the weight gradient's GEMM sums db from the dY tiles it
    loads: no bias kernel runs, "splitk" adds one fixed-order sum of its chunks' partials
    (which sit after its chunks in the workspace, also where there are more chunks than dW
    has columns), dW and db agree with torch, and the launches are bias_launches'."""
    ran = []
    real_run = conv.run
    monkeypatch.setattr(conv, "run", lambda kernel, *a, **kw: (ran.append(kernel),
                                                                real_run(kernel, *a, **kw)))
    gen = torch.Generator().manual_seed(len(algo))
    for xs, ws, padding in (((3, 4, 9, 9), (8, 4, 3, 3), 1), ((4, 1, 16, 16), (2, 1, 1, 1), 0)):
        x, dy = _rand(xs, gen, "cpu"), _rand(conv.out_shape(xs, ws, 1, padding), gen, "cpu")
        dw, db = _nan(ws, "cpu"), _nan((ws[0],), "cpu")
        need = conv.workspace_bytes(xs, ws, 1, padding, "backward_weight", algo)
        ran.clear()
        conv.backward_weight(x, dy, dw, db, stride=1, padding=padding, algo=algo,
                             workspace=_workspace(need, "cpu"), precision="ieee")
        pixels = xs[0] * dy.shape[2] * dy.shape[3]
        _close(db, dy.double().sum((0, 2, 3)), pixels, "ieee", f"{algo} db")
        _close(dw, torch.nn.grad.conv2d_weight(x.double(), ws, dy.double(), padding=padding),
               pixels, "ieee", f"{algo} dw")
        assert conv._bias_grad_kernel not in ran
        launches = conv.bias_launches(None, algo, xs, ws, 1, padding, has_dx=False)
        assert ran.count(conv._splitk_reduce_kernel) == launches + (algo == "splitk")
        assert launches == (algo == "splitk")
    assert conv.splitk_splits(xs, ws, 1, padding) > ws[1] * ws[2] * ws[3]


@pytest.mark.parametrize("programs", [1, 3, 10 ** 6])
def test_flipped_nhwc_sums_the_bias_gradient_as_it_copies_dy(programs, monkeypatch):
    """conv.backward with "flipped_nhwc", dW and db: db is summed by the copy of dY to
    channels-last (no bias kernel runs), in as many image-and-pixel groups as the program
    target and dW's room allow (one, some, as many as fit), their partial sums in dW's room
    before dW is written; every gradient agrees with torch, and the launches with
    nhwc_bias_launches."""
    monkeypatch.setattr(conv, "_BIAS_PROGRAMS", programs)
    ran = []
    real_run = conv.run
    monkeypatch.setattr(conv, "run", lambda kernel, *a, **kw: (ran.append(kernel),
                                                                real_run(kernel, *a, **kw)))
    gen = torch.Generator().manual_seed(programs)
    for xs, ws, padding in (((3, 4, 9, 9), (8, 4, 3, 3), 1), ((2, 3, 5, 6), (4, 3, 1, 1), 0)):
        x, w = _rand(xs, gen, "cpu"), _rand(ws, gen, "cpu")
        dy = _rand(conv.out_shape(xs, ws, 1, padding), gen, "cpu")
        dx, dw, db = _nan(xs, "cpu"), _nan(ws, "cpu"), _nan((ws[0],), "cpu")
        need = conv.backward_workspace_bytes(xs, ws, 1, padding, "flipped_nhwc", "onepass",
                                             True, True)
        ran.clear()
        conv.backward(x, w, dy, dx, dw, db, stride=1, padding=padding,
                      algo_data="flipped_nhwc", algo_weight="onepass",
                      workspace=_workspace(need, "cpu"), precision="ieee")
        pq = dy.shape[2] * dy.shape[3]
        _close(db, dy.double().sum((0, 2, 3)), xs[0] * pq, "ieee", "db")
        _close(dw, torch.nn.grad.conv2d_weight(x.double(), ws, dy.double(), padding=padding),
               xs[0] * pq, "ieee", "dw after the partial sums")
        _close(dx, torch.nn.grad.conv2d_input(xs, w.double(), dy.double(), padding=padding),
               ws[0] * ws[2] * ws[3], "ieee", "dx")
        assert conv._bias_grad_kernel not in ran
        groups = conv._nhwc_tiles(dy.shape, dw.numel())[4]
        assert (groups > 1) == (programs > 1)
        reduces = ran.count(conv._splitk_reduce_kernel)
        assert reduces == conv.nhwc_bias_launches(dy.shape, dw.numel()) == int(groups > 1)


# --------------------------------------------------------------------------------------------
# channels-last activations (sched/channels_last.py): same bits as the NCHW runs
# --------------------------------------------------------------------------------------------

def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


# (N, C, H, W, K, kernel, padding), stride 1
CL_CASES = [
    (2, 8, 8, 8, 8, 3, 1),      # patch rows of 8: the data gradient's mask through TMA boxes
    (1, 4, 3, 32, 8, 3, 1),     # rows of 32: the mask loaded per element
    (2, 8, 6, 6, 4, 3, 0),      # unpadded: "tma" does not apply
]
CL_GPU_CASES = [(8, 64, 28, 28, 64, 3, 1), (2, 64, 56, 56, 128, 3, 1),
                (2, 64, 112, 112, 64, 3, 1)]


def _check_channels_last(case, device, precision="ieee"):
    """Every pass that accepts a channels-last x or y gives the NCHW run's bits: the
    forward's store ("implicit", "nhwc", ReLU fused), the "nhwc" forward reading x in
    place, and the backward with x a channels-last ReLU output (its mask in the data
    gradient's store; the weight gradient's "nhwc" in place, "tma" through its copies)."""
    n, c, h, w, k, r, pad = case
    gen = torch.Generator().manual_seed(sum(case))
    x = torch.relu(_rand((n, c, h, w), gen, device))
    wt, b = _rand((k, c, r, r), gen, device), _rand((k,), gen, device)
    p, q = h + 2 * pad - r + 1, w + 2 * pad - r + 1
    dy = _rand((n, k, p, q), gen, device)
    kw = dict(stride=1, padding=pad, precision=precision)
    for algo in ("implicit", "nhwc"):
        ws = _workspace(conv.workspace_bytes(x.shape, wt.shape, 1, pad, "forward", algo), device)
        ref = _nan((n, k, p, q), device)
        conv.forward(x, wt, b, ref, algo=algo, workspace=ws, relu=True, **kw)
        for x_in in ([x, _cl(x)] if algo == "nhwc" else [x]):
            y = _cl(_nan((n, k, p, q), device))
            conv.forward(x_in, wt, b, y, algo=algo, workspace=ws, relu=True, **kw)
            assert conv.is_channels_last(y) and torch.equal(y, ref), (algo, x_in.stride())
    for algo_weight in ("nhwc", "tma"):
        if not conv._applies(algo_weight, x.shape, wt.shape, 1, pad, "backward_weight"):
            continue
        assert conv.reads_channels_last("backward_weight", algo_weight, x.shape, wt.shape)
        ws = _workspace(conv.backward_workspace_bytes(x.shape, wt.shape, 1, pad, "flipped_nhwc",
                                                      algo_weight), device)
        for accumulate in (False, True):    # (on rows of 32: the mask loaded per element)
            outs = []
            for x_in in (x, _cl(x)):
                dx = _rand(x.shape, torch.Generator().manual_seed(7), device) if accumulate \
                    else _nan(x.shape, device)
                grads = dx, _nan(wt.shape, device), _nan((k,), device)
                conv.backward(x_in, wt, dy, *grads, algo_data="flipped_nhwc",
                              algo_weight=algo_weight, workspace=ws, accumulate=accumulate,
                              x_is_relu_output=True, **kw)
                outs.append(grads)
            for name, got, ref in zip(("dx", "dw", "db"), outs[1], outs[0]):
                assert torch.equal(got, ref), (algo_weight, accumulate, name)
            assert (outs[1][0][x == 0] == 0).all()      # the mask was read where x is 0


@pytest.mark.parametrize("case", CL_CASES)
def test_channels_last_same_bits(case):
    _check_channels_last(case, "cpu")


def test_channels_last_refused_where_unsupported():
    """A channels-last x or y an algorithm cannot read or write: one line naming it,
    before any write."""
    gen = torch.Generator().manual_seed(0)
    x, w = _cl(_rand((1, 4, 6, 6), gen, "cpu")), _rand((4, 4, 3, 3), gen, "cpu")
    dy = _rand((1, 4, 6, 6), gen, "cpu")
    kw = dict(stride=1, padding=1)
    y = _nan((1, 4, 6, 6), "cpu")
    with pytest.raises(ValueError, match="channels-last x needs forward algo"):
        conv.forward(x, w, None, y, algo="implicit", **kw)
    ws = _workspace(conv.workspace_bytes(x.shape, w.shape, 1, 1, "forward", "im2col"), "cpu")
    with pytest.raises(ValueError, match="channels-last y needs forward algo"):
        conv.forward(x.contiguous(), w, None, _cl(y), algo="im2col", workspace=ws, **kw)
    dx, dw = _nan(x.shape, "cpu"), _nan(w.shape, "cpu")
    with pytest.raises(ValueError, match="channels-last x needs backward_weight algo"):
        conv.backward(x, w, dy, dx, dw, None, algo_weight="onepass", **kw)
    with pytest.raises(ValueError, match="channels-last x needs backward_data algo"):
        conv.backward(x, w, dy, dx, dw, None, x_is_relu_output=True, **kw)
    with pytest.raises(ValueError, match="channels-last relu_output needs backward_data"):
        conv.backward_data(dy, w, dx, relu_output=x, **kw)
    assert y.isnan().all() and dx.isnan().all() and dw.isnan().all()


# --------------------------------------------------------------------------------------------
# GPU (device machine)
# --------------------------------------------------------------------------------------------

GPU_CASES = EDGE_CASES + [
    (2, 35, 15, 15, 40, 3, 3, 1, 1),        # several tiles of everything, 3x3
    (3, 3, 23, 23, 33, 7, 7, 2, 3),         # ResNet stem, small
    (2, 64, 9, 9, 48, 1, 1, 1, 0),          # 1x1 fast path
    (2, 17, 12, 11, 19, 1, 7, 1, (0, 3)),   # 1x7
    (4, 40, 13, 13, 24, 3, 3, 2, 1),        # strided 3x3
    (2, 130, 6, 6, 70, 3, 3, 1, 1),         # reduction over several K blocks
    (2, 36, 14, 14, 44, 3, 3, 1, 1),        # channels-last: several patches, channel blocks
    (2, 8, 32, 32, 12, 3, 3, 1, 1),         # channels-last, 32-pixel rows: per-element epilogue
    (8, 512, 7, 7, 256, 3, 3, 1, 1),        # split-K forward, 18 chunks
    (4, 1024, 5, 5, 64, 1, 1, 1, 0),        # split-K forward, 1x1, 4 chunks
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_conv_gpu_cases(case, precision):
    i = GPU_CASES.index(case)
    _check(case, "cuda", precision, seed=i, bias=i % 2 == 0, accumulate=i % 3 == 1,
           dx_none=i % 4 == 3, db_none=i % 5 == 2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("part", range(4))     # 8 shapes a precision, as 4 tests (see below)
@settings(max_examples=2, deadline=None)
@given(case=conv_cases(max_n=3, max_c=24, max_hw=12, max_rs=3), seed=st.integers(0, 2**16),
       accumulate=st.booleans(), dx_none=st.booleans())
def test_conv_gpu_random_shapes(part, precision, case, seed, accumulate, dx_none):
    """Each drawn shape compiles every conv kernel anew (about 30 s on the H200's host), so
    the draws are split over `part`s that parallel workers take (one test of 8 draws ran
    233 s, the longest of the GPU run)."""
    _check(case, "cuda", precision, seed, True, accumulate, dx_none, False)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("index", range(config_count(conv)))
def test_conv_gpu_every_config(index, precision):
    with pinned(conv, index):
        for j, case in enumerate(CONFIG_CASES + GPU_CASES[-8:]):
            _check(case, "cuda", precision, seed=index, bias=j != 1,
                   accumulate=(index + j) % 2 == 1)


@pytest.mark.gpu
@gpu
def test_conv_gpu_deterministic():
    gen = torch.Generator().manual_seed(0)
    x = _rand((8, 64, 28, 28), gen, "cuda")
    w = _rand((64, 64, 3, 3), gen, "cuda")
    dy = _rand((8, 64, 28, 28), gen, "cuda")
    need = conv.backward_workspace_bytes(x.shape, w.shape, 1, 1, "implicit", "splitk")
    ws = torch.empty(need, dtype=torch.uint8, device="cuda")
    outs = []
    for _ in range(2):
        dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty(64, device="cuda")
        conv.backward(x, w, dy, dx, dw, db, stride=1, padding=1, algo_weight="splitk",
                      workspace=ws)
        outs.append((dx, dw, db))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _channels_last_passes(x, w, b, dy, y_channels_last):
    """One forward ("nhwc", fused ReLU) and one backward ("flipped_nhwc" masked by x, "tma")
    of a conv reading the channels-last x, into fresh poisoned outputs and workspaces:
    [y, dx, dw, db]."""
    dev = x.device
    fwd_ws = _workspace(conv.workspace_bytes(x.shape, w.shape, 1, 1, "forward", "nhwc"), dev)
    y = _nan((x.shape[0], w.shape[0], *x.shape[2:]), dev)
    y = _cl(y) if y_channels_last else y
    conv.forward(x, w, b, y, stride=1, padding=1, algo="nhwc", workspace=fwd_ws, relu=True)
    bwd_ws = _workspace(conv.backward_workspace_bytes(x.shape, w.shape, 1, 1, "flipped_nhwc",
                                                      "tma"), dev)
    dx, dw, db = _nan(x.shape, dev), _nan(w.shape, dev), _nan(b.shape, dev)
    conv.backward(x, w, dy, dx, dw, db, stride=1, padding=1, algo_data="flipped_nhwc",
                  algo_weight="tma", workspace=bwd_ws, x_is_relu_output=True)
    return [y.contiguous(), dx, dw, db]


def _check_repeatable(shape, device, y_channels_last):
    """The channels-last passes give the same bits run after run on the same inputs (the
    plan's eager and graphed steps rely on it: their losses are compared bit for bit)."""
    n, c, hw, k = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = _cl(_rand((n, c, hw, hw), gen, device))
    w = _rand((k, c, 3, 3), gen, device) / 30
    b, dy = _rand((k,), gen, device), _rand((n, k, hw, hw), gen, device)
    first = _channels_last_passes(x, w, b, dy, y_channels_last)
    assert not any(t.isnan().any() for t in first)
    for _ in range(2):
        again = _channels_last_passes(x, w, b, dy, y_channels_last)
        for name, a, z in zip(("y", "dx", "dw", "db"), first, again):
            assert torch.equal(a, z), f"{name} of {shape} changed between runs"


@pytest.mark.parametrize("y_channels_last", [False, True])
def test_channels_last_passes_repeat_bitwise(y_channels_last):
    _check_repeatable((2, 8, 8, 12), "cpu", y_channels_last)


# VGG16's and ResNet-50's 14-pixel shapes, and VGG16's 512@28, at batch 32
REPEAT_GPU_SHAPES = [(32, 512, 14, 512), (32, 256, 14, 256), (32, 512, 28, 512)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("y_channels_last", [False, True])
@pytest.mark.parametrize("shape", REPEAT_GPU_SHAPES)
def test_channels_last_gpu_passes_repeat_bitwise(shape, y_channels_last):
    _check_repeatable(shape, "cuda", y_channels_last)


# (N, C, H, K, kernel): batch-32 shapes where [128, 128] tiles in 8 warps, no longer offered,
# computed wrong sums on the H200 (see conv._NHWC_CONFIGS), and VGG16's 512@28
RACE_GPU_SHAPES = [(32, 512, 14, 512, 3), (32, 256, 14, 1024, 1), (32, 512, 28, 512, 3)]


def _same_right_bits(runs, ref, red_len, what):
    """Every run's output is the float64 reference to TF32 rounding, in run 0's bits."""
    for run, out in enumerate(runs):
        _close(out, ref, red_len, "tf32", f"{what}, run {run}")
        assert torch.equal(out, runs[0]), f"{what}, run {run}: other bits than run 0"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", RACE_GPU_SHAPES)
def test_channels_last_gpu_every_config_repeatable(shape):
    """Each config of the channels-last kernel, pinned, computes the float64 conv (TF32
    rounding) into a fresh poisoned output eight times with the same bits: the forward
    with its ReLU, and the "flipped_nhwc" data gradient masked by that ReLU, written and
    accumulated. A race between the kernel's warps shows as a wrong, changing sum."""
    n, c, hw, k, ksz = shape
    pad, dev = ksz // 2, "cuda"
    gen = torch.Generator().manual_seed(sum(shape))
    x = _cl(_rand((n, c, hw, hw), gen, dev))
    w, b = _rand((k, c, ksz, ksz), gen, dev) / 30, _rand((k,), gen, dev)
    dy, before = _rand((n, k, hw, hw), gen, dev), _rand(x.shape, gen, dev)
    y_ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), padding=pad))
    dx_ref = torch.nn.grad.conv2d_input(x.shape, w.double(), dy.double(), padding=pad)
    ws = _workspace(max(conv.workspace_bytes(x.shape, w.shape, 1, pad, "forward", "nhwc"),
                        conv.backward_workspace_bytes(x.shape, w.shape, 1, pad,
                                                      "flipped_nhwc")), dev)

    def data_grad(accumulate):
        dx = before.clone() if accumulate else _nan(x.shape, dev)
        conv.backward(x, w, dy, dx, None, None, stride=1, padding=pad,
                      algo_data="flipped_nhwc", workspace=ws, accumulate=accumulate,
                      x_is_relu_output=True)
        return dx

    for index in range(len(conv._NHWC_CONFIGS)):
        ys, dxs, sums = [], [], []
        with pinned(conv, index):
            for _ in range(8):
                ys.append(_nan((n, k, hw, hw), dev))
                conv.forward(x, w, b, ys[-1], stride=1, padding=pad, algo="nhwc",
                             workspace=ws, relu=True)
                dxs.append(data_grad(False))
                sums.append(data_grad(True))
        what = f"config {conv._NHWC_CONFIGS[index]}"
        _same_right_bits(ys, y_ref, c * ksz * ksz, f"{what}, forward")
        _same_right_bits(dxs, dx_ref * (x > 0), k * ksz * ksz, f"{what}, data gradient")
        _same_right_bits(sums, (dx_ref + before.double()) * (x > 0), k * ksz * ksz,
                         f"{what}, accumulated data gradient")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("case", CL_CASES + CL_GPU_CASES)
def test_channels_last_gpu_same_bits(case, precision):
    _check_channels_last(case, "cuda", precision)
