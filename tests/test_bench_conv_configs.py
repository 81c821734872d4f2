"""bench/conv_configs.py's choices (the GPU timing itself runs only on the device machine)."""
import contextlib

import pytest
import torch

from bench import conv_configs
from tinysn.kernels import _common, conv


PHASES = ["forward", "data_implicit", "data_transposed", "weight_splitk", "weight_onepass",
          "forward_nhwc", "data_nhwc", "weight_nhwc", "weight_tma"]


def test_greedy_first_takes_the_best_single_config_then_what_lowers_the_total_most():
    rows = [{"ms": [2.0, 1.0, 3.0, 1.5]},      # config 1 is best alone (total 4.0)
            {"ms": [2.0, 3.0, 1.0, 1.5]}]
    assert conv_configs.greedy(rows, 1) == [3]   # 1.5 + 1.5 = 3.0 beats 1 (4.0) and 0 (4.0)
    assert conv_configs.greedy(rows, 2) == [3, 1]   # then 1: 1.0 + 1.5 (ties with 2 later)
    assert conv_configs.greedy(rows, 4) == [3, 1, 2, 0]


def test_candidates_keep_todays_configs_first_and_drop_repeats_and_oversized_tiles():
    today = conv._FWD_CONFIGS
    big = conv._cfg(256, 256, 64, 8, 4)             # 256 KiB of operand tiles per stage set
    out = conv_configs.candidates(today, [today[0], big, conv._cfg(32, 32, 32, 4, 2)])
    assert out[:len(today)] == list(today)
    assert [str(c) for c in out[len(today):]] == [str(conv._cfg(32, 32, 32, 4, 2))]
    assert not conv_configs.fits(big)
    assert all(conv_configs.fits(c) for c in conv._FWD_CONFIGS + conv._WGT_CONFIGS)


def test_every_conv_autotuner_is_swept_from_its_own_list():
    tuned = conv_configs.tuners()
    assert set(tuned) == {"forward", "data_implicit", "data_transposed", "weight", "nhwc",
                          "weight_nhwc", "weight_tma"}
    phases = [p for _, _, _, served in tuned.values() for p in served]
    assert sorted(phases) == sorted(PHASES)
    for tuner, today, cands, _ in tuned.values():
        assert [str(c) for c in tuner.all_configs] == [str(c) for c in today]
        assert cands[:len(today)] == list(today) and len(cands) > len(today)
        assert len({str(c) for c in cands}) == len(cands)


def test_the_pixel_major_kernels_are_also_swept_unpipelined():
    tuned = conv_configs.tuners()
    earlier = {"forward": conv_configs.EARLIER_FWD, "data_transposed": conv_configs.EARLIER_T}
    for name, (_, today, cands, _) in tuned.items():
        single = {(str(c.kwargs), c.num_warps) for c in cands if c.num_stages == 1}
        if name in earlier:          # today's tiles and the earlier list's, in one stage
            expected = today + earlier[name]
            if name == "data_transposed":   # and the one-stage ones with dY from registers
                expected += [c for c in conv_configs.reg_a(expected) if c.num_stages == 1]
            assert single == {(str(c.kwargs), c.num_warps) for c in expected}, name
        else:
            assert not single, name


def test_a_sweep_on_the_cpu_times_every_phase_under_every_candidate(monkeypatch):
    """The sweep's plumbing on one tiny shape under the interpreter: each phase runs under
    each of its tuner's configs (counted by a stand-in timer), the rows and picks follow,
    and conv's launcher is restored afterwards."""
    calls = []
    monkeypatch.setattr(conv_configs, "DEVICE", "cpu")
    monkeypatch.setattr(conv_configs, "BATCH", 1)
    monkeypatch.setattr(conv_configs, "SHAPES", [(4, 8, 8, 3)])   # C, Q % 4 == 0: "nhwc" runs
    monkeypatch.setattr(conv_configs, "median_ms",
                        lambda fn: (fn(), calls.append(1), float(len(calls)))[2])
    tuned = {name: (t, list(today)[:1], list(today)[:2], phases)
             for name, (t, today, _, phases) in conv_configs.tuners().items()}
    launch = conv._launch
    rows = conv_configs.sweep([conv_configs.problem(*s) for s in conv_configs.SHAPES], tuned)
    assert conv._launch is launch
    assert [r["phase"] for r in rows] == PHASES
    assert all(len(r["ms"]) == 2 and r["today_ms"] == r["ms"][0] for r in rows)
    assert len(calls) == len(PHASES) * 3            # two configs and cuDNN per phase
    picks = conv_configs.pick_all(rows, tuned)      # the stand-in timer: earlier is faster
    assert picks == {name: [str(cands[0])] for name, (_, _, cands, _) in tuned.items()}


def test_a_run_selects_tuners_and_kernel_sizes_and_names_what_does_not_exist():
    tuned, shapes = conv_configs.selection("weight", 3)
    assert list(tuned) == ["weight"]
    assert shapes and all(s[3] == 3 for s in shapes)
    assert len(shapes) == sum(s[3] == 3 for s in conv_configs.SHAPES)
    tuned, shapes = conv_configs.selection("forward,data_implicit")
    assert list(tuned) == ["forward", "data_implicit"] and shapes == conv_configs.SHAPES
    tuned, shapes = conv_configs.selection("data_transposed_reg_a", resnet50=True)
    _, today, cands, _ = tuned["data_transposed_reg_a"]
    names = [str(c) for c in cands]
    assert names[:len(today)] == [str(c) for c in today] and len(set(names)) == len(names)
    assert {str(c) for c in conv_configs.reg_a(today)} <= set(names)
    assert all(c.kwargs.get("REG_A") for c in cands[len(today):])     # the twins alone
    assert len(shapes) == 12 and (512, 512, 7, 3) in shapes and (64, 64, 224, 3) not in shapes
    with pytest.raises(ValueError, match="unknown tuner wieght"):
        conv_configs.selection("weight,wieght")
    with pytest.raises(ValueError, match="no shape has kernel size 5"):
        conv_configs.selection("weight", 5)


def test_a_sweep_of_one_tuner_runs_only_its_phases(monkeypatch):
    """A subset of the tuners (--tuners) compiles and times only the phases they serve: each
    phase of the shape's problem here records its calls instead of launching."""
    called = []
    monkeypatch.setattr(conv_configs, "median_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(_common, "INTERPRET", False)     # the compile pass runs too
    monkeypatch.setattr(_common, "compiling_in_parallel", contextlib.nullcontext)
    problem = {p: (lambda p=p: called.append(p), lambda: None) for p in PHASES}
    t, today, _, served = conv_configs.tuners()["weight"]
    rows = conv_configs.sweep([problem], {"weight": (t, today[:1], today[:2], served)},
                              shapes=[(3, 4, 5, 3)])
    assert [r["phase"] for r in rows] == ["weight_splitk", "weight_onepass"]
    assert called == ["weight_splitk", "weight_onepass"] + ["weight_splitk"] * 2 + \
        ["weight_onepass"] * 2          # compiled once, then timed under both configs


def test_the_channels_last_weight_gradient_is_swept_only_where_it_applies(monkeypatch):
    """A shape whose output width is not divisible by 4 has no "weight_nhwc" phase, and a sweep
    of its tuner over it times nothing."""
    monkeypatch.setattr(conv_configs, "DEVICE", "cpu")
    monkeypatch.setattr(conv_configs, "BATCH", 1)
    assert "weight_nhwc" in conv_configs.problem(4, 8, 8, 3)
    odd = conv_configs.problem(4, 8, 6, 3)
    assert "weight_nhwc" not in odd and "forward_nhwc" in odd
    monkeypatch.setattr(conv_configs, "median_ms", lambda fn: 1 / 0)    # never called
    t, today, _, served = conv_configs.tuners()["weight_nhwc"]
    assert conv_configs.sweep([odd], {"weight_nhwc": (t, today[:1], today[:2], served)},
                              shapes=[(4, 8, 6, 3)]) == []


def test_a_config_that_computes_wrongly_or_racily_is_never_picked(monkeypatch):
    """Each candidate runs three times into a poisoned output before it is timed: one whose
    bits change between runs (a race), one far from cuDNN's result and one that leaves an
    element unwritten get an infinite time and their fault, and the pick passes them by."""
    monkeypatch.setattr(conv_configs, "median_ms", lambda fn: 1.0)
    out, right = torch.zeros(4), torch.ones(4)
    # what the four configs write, run by run (a fault ends a config's runs)
    writes = iter([1.0, 1.0, 1.0,  1.0, 1.5,  3.0, 3.0, 3.0,  float("nan")])

    def fn():
        out.fill_(next(writes))
    t, today, cands, served = conv_configs.tuners()["forward"]
    four = (t, today[:1], cands[:4], served)
    rows = conv_configs.sweep([{"forward": (fn, lambda: right, out)}], {"forward": four},
                              shapes=[(3, 4, 5, 3)])
    assert rows[0]["ms"] == [1.0, float("inf"), float("inf"), float("inf")]
    assert rows[0]["faults"] == {1: "run 1 gave other bits than run 0",
                                 2: "relative error 2.0e+00 against cuDNN",
                                 3: "run 0 left elements unwritten"}
    assert conv_configs.pick_all(rows, {"forward": four}) == {"forward": [str(cands[0])]}


def _sweep(gpu, candidates, times, cudnn):
    """A one-tuner ("forward") sweep file's payload: a row per shape, `times` its ms."""
    return {"environment": {"gpu": gpu}, "candidates": {"forward": candidates},
            "rows": [{"tuner": "forward", "ms": ms, "cudnn_ms": c}
                     for ms, c in zip(times, cudnn)]}


def test_a_joint_pick_weighs_each_gpu_by_its_own_cudnn_time():
    names = ["BLOCK_M: 64, num_stages: 1", "BLOCK_M: 128, num_stages: 4"]
    slow = _sweep("A", names, [[10.0, 13.0]], [10.0])      # X 1.0x cuDNN, Y 1.3x
    fast = _sweep("B", [n + ", ir_override: None" for n in names[::-1]],   # 3.9's names,
                  [[1.0, 1.5]], [1.0])                      # another order: Y 1.0x, X 1.5x
    # in ms X wins (11.5 against 14.0); against each GPU's cuDNN Y does (2.3 against 2.5)
    assert conv_configs.pick_jointly([slow, fast], {"forward": 1}) == {"forward": [names[1]]}
    assert conv_configs.pick_jointly([slow], {"forward": 1}) == {"forward": [names[0]]}


def test_a_joint_pick_takes_only_what_every_file_timed():
    only_a = "BLOCK_M: 32, num_stages: 1"
    a = _sweep("A", ["BLOCK_M: 64, num_stages: 1", only_a], [[2.0, 1.0]], [1.0])
    b = _sweep("B", ["BLOCK_M: 64, num_stages: 1"], [[2.0]], [1.0])
    assert conv_configs.joint_rows([a, b], "forward") == (
        ["BLOCK_M: 64, num_stages: 1"], [{"ms": [2.0]}, {"ms": [2.0]}])


def test_the_h100_sweep_with_dy_and_x_from_registers_picks_the_lists_conv_py_holds():
    """The forward and "transposed" lists are the greedy pick of the H100's sweep of the lists
    before them beside the same configs with REG_A (conv.py says so)."""
    sweep = conv_configs.sweep_file("bench/results/conv-configs-reg-a-NVIDIA-H100-80GB-HBM3.json")
    for tuner, today in (("forward_reg_a", conv._FWD_CONFIGS),
                         ("data_transposed_reg_a", conv._T_CONFIGS)):
        names = sweep["candidates"][tuner]
        rows = [r for r in sweep["rows"] if r["tuner"] == tuner]
        pick = [names[i] for i in conv_configs.greedy(rows, len(today))]
        assert list(map(conv_configs.config_key, pick)) == \
            [conv_configs.config_key(str(c)) for c in today]
        assert any(c.kwargs.get("REG_A") for c in today)


def test_a_sweep_on_another_gpu_can_take_back_the_lists_before():
    every = {n: [conv_configs.config_key(str(c)) for c in t[2]]
             for n, t in conv_configs.tuners().items()}
    for tuner, earlier in (("forward", conv_configs.EARLIER_FWD),
                           ("data_transposed", conv_configs.EARLIER_T)):
        for c in earlier + conv_configs.one_stage(earlier):
            assert conv_configs.config_key(str(c)) in every[tuner]


def test_pick_names_a_file_that_is_not_a_sweep(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"rows": []}')
    for path in (bad, tmp_path / "missing.json"):
        monkeypatch.setattr("sys.argv", ["conv_configs.py", "--pick", str(path)])
        with pytest.raises(SystemExit):
            conv_configs.main()
        assert str(path) in capsys.readouterr().err
