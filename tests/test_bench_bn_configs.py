"""bench/bn_configs.py on the CPU: the shapes it sweeps, its constants put back, its checks."""
import torch

from bench import bn_configs, common
from tinysn.kernels import bn


def test_resnet50_batch_norm_shapes_and_counts():
    shapes = dict(bn_configs.bn_shapes("resnet50", 32))
    assert sum(shapes.values()) == 53                  # every batch norm of a step, once
    assert next(iter(shapes)) == (32, 64, 112, 112)    # the largest first
    assert shapes[(32, 256, 56, 56)] == 4              # layer1's three outputs and its shortcut


def test_a_combination_changes_the_geometry_and_is_put_back():
    """Each combination plans its chunks from its own constants (the memo cleared), is
    checked against torch, and leaves kernels/bn.py's constants as they were."""
    today = {name: getattr(bn, name) for name in bn_configs.CONSTANTS}
    shape = (2, 4, 12, 12)
    planned_today = bn.workspace_bytes(shape, "forward")
    small = dict(today, _TARGET_PROGRAMS=4, _MIN_CHUNK=16)
    large = dict(today, _TARGET_PROGRAMS=64, _MIN_CHUNK=16)
    sizes = []
    for combo in (small, large):
        before = bn_configs.set_constants(combo)
        sizes.append(bn.workspace_bytes(shape, "forward"))
        bn_configs.set_constants(before)
    assert sizes[0] < sizes[1]                          # more chunks, more partials
    row = bn_configs.measure(large, [(shape, 3)], torch.device("cpu"))
    assert row["correct"] and row["shapes"][0]["rel_err"] < 1e-5
    timed = row["shapes"][0]
    assert row["step_ms"] == 3 * (timed["forward_ms"] + timed["backward_ms"])
    assert {name: getattr(bn, name) for name in bn_configs.CONSTANTS} == today
    assert bn.workspace_bytes(shape, "forward") == planned_today


def test_wrong_figures_are_never_the_pick(monkeypatch):
    """A combination whose outputs are off is marked and its step time is infinite."""
    monkeypatch.setattr(bn_configs.Case, "rel_err", lambda self: 1.0)
    row = bn_configs.measure({}, [((2, 4, 6, 6), 1)], torch.device("cpu"))
    assert not row["correct"] and row["step_ms"] == float("inf")


def test_the_channel_order_is_swept_only_when_asked():
    assert bn_configs.parse_args([]).last_first == [True]
    assert bn_configs.parse_args(["--last-first", "0,1"]).last_first == [False, True]
    assert "_LAST_FIRST" in bn_configs.CONSTANTS        # set and put back like the others


def test_the_one_program_form_is_swept_only_when_asked_and_runs_where_chosen(monkeypatch):
    args = bn_configs.parse_args(["--channel-max", "0,8192", "--channel-programs", "4"])
    assert (args.channel_max, args.channel_programs) == ([0, 8192], [4])
    defaults = bn_configs.parse_args([])                           # today's
    assert (defaults.channel_max, defaults.channel_programs) == (
        [bn._CHANNEL_MAX], [bn._CHANNEL_PROGRAMS])
    launched = []
    monkeypatch.setattr(bn, "run", lambda kernel, *a, **k: launched.append(kernel.__name__))
    shape = (2, 8, 6, 6)
    for combo in ({"_CHANNEL_MAX": 0}, {"_CHANNEL_MAX": 72, "_CHANNEL_PROGRAMS": 8}):
        before = bn_configs.set_constants(combo)
        try:
            bn_configs.Case(shape, torch.device("cpu")).forward()
        finally:
            bn_configs.set_constants(before)
    assert launched == ["_bn_stats_kernel", "_bn_finalize_kernel", "_bn_norm_kernel",
                        "_bn_channel_fwd_kernel"]


def test_the_shipped_constants_are_the_h100_sweeps_pick():
    """kernels/bn.py's block shapes, channel order and one-launch thresholds are the pick of
    the last H100 sweep, which timed today's other constants beside the one-launch form."""
    pick = common.read("bench/results/bn-configs-channel-NVIDIA-H100-80GB-HBM3.json")["pick"]
    assert {name: getattr(bn, name) for name in pick} == pick
    assert set(pick) >= {"_TILE", "_WARPS", "_LAST_FIRST", "_CHANNEL_MAX", "_CHANNEL_PROGRAMS"}
