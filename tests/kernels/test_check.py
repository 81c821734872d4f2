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
