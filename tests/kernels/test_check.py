"""The batch check's reduction: how many values are NaN or infinite, into a caller's float."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tinysn  # noqa: F401  (interpreter switch before triton)
from tinysn.kernels import check

BAD = (float("nan"), float("inf"), -float("inf"))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 3 * check.BLOCK + 5), picks=st.lists(st.integers(0, 10**9), max_size=6),
       kinds=st.lists(st.sampled_from(BAD), min_size=6, max_size=6))
def test_counts_every_nonfinite_value(n, picks, kinds):
    """The flag equals torch's count of non-finite values, wherever they sit (first and last
    tile included); a finite tensor gives 0 and an empty one too."""
    x = torch.randn(n).clamp(-1e38, 1e38) * 1e30      # large but finite values
    for i, kind in zip(picks, kinds):
        if n:
            x[i % n] = kind
    flag = torch.full((1,), 7.0)
    check.nonfinite(x, flag)
    assert flag.item() == (~torch.isfinite(x)).sum().item()


def test_a_four_dimensional_batch_with_one_nan_in_its_last_element(device):
    x = torch.randn(3, 3, 17, 19, device=device)
    flag = torch.zeros(1, device=device)
    check.nonfinite(x, flag)
    assert flag.item() == 0
    x[-1, -1, -1, -1] = float("nan")
    check.nonfinite(x, flag)
    assert flag.item() == 1


@pytest.mark.parametrize("flag, match", [
    (torch.zeros(2), "flag must have shape"),
    (torch.zeros(1, dtype=torch.float64), "flag must be torch.float32"),
    (torch.zeros(1, device="meta"), "flag must be on x's device"),
])
def test_a_wrong_flag_is_named(flag, match):
    with pytest.raises(ValueError, match=match):
        check.nonfinite(torch.zeros(4), flag)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 3 * check.BLOCK + 5), high=st.integers(1, 1000),
       picks=st.lists(st.integers(0, 10**9), max_size=6),
       values=st.lists(st.sampled_from([-1, -2**40, 1000, 2**40]), min_size=6, max_size=6))
def test_outside_adds_how_many_labels_leave_the_range(n, high, picks, values):
    """The flag grows by torch's count of labels outside [0, high), wherever they sit; it is
    added to what the flag held (the images' count), not written over it."""
    labels = torch.randint(0, high, (n,))
    for i, v in zip(picks, values):
        if n:
            labels[i % n] = v if v != 1000 else high     # 1000 stands for `high` itself
    flag = torch.full((1,), 3.0)
    check.outside(labels, high, flag)
    assert flag.item() == 3 + ((labels < 0) | (labels >= high)).sum().item()


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(4), 5, torch.zeros(1)), "labels must be torch.int64"),
    ((torch.zeros(4, dtype=torch.int64), 0, torch.zeros(1)), "high must be an int >= 1"),
    ((torch.zeros(4, dtype=torch.int64), 5, torch.zeros(2)), "flag must have shape"),
])
def test_outside_names_a_wrong_argument(args, match):
    with pytest.raises(ValueError, match=match):
        check.outside(*args)
