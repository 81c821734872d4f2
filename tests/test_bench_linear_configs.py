"""bench/linear_configs.py on the CPU (Triton's interpreter, its small case): every GPU config
of the fully connected GEMM runs pinned, in each pass, and each pass names its fastest."""
import json

import pytest

from bench import linear_configs
from tinysn.kernels import _common, linear


def test_every_config_of_every_pass_is_timed_and_the_fastest_named(tmp_path):
    out = tmp_path / "linear-configs.json"
    result = linear_configs.main(["--batch", "2", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    count = _common.config_count(linear)
    rows = result["rows"]
    assert len(rows) == len(linear_configs.PASSES) * (count + 1)
    for name in linear_configs.PASSES:
        timed = [r for r in rows if r["pass"] == name and "config" in r]
        best = [r for r in rows if r["pass"] == name and "best_config" in r]
        assert [r["config"] for r in timed] == [linear_configs.config_text(i)
                                                for i in range(count)]
        fastest = min(timed, key=lambda r: r["tinysn_ms"])
        assert len(best) == 1 and best[0]["best_config"] == fastest["config"]
        assert best[0]["tinysn_ms"] == fastest["tinysn_ms"] > 0
    moved = linear_configs.pass_bytes(2, 64, 48)
    for r in rows:
        assert r["gb_per_s"] == moved[r["pass"]] / r["tinysn_ms"] / 1e6


def test_a_fused_step_moves_the_weight_and_its_momentum_both_ways():
    """The fused pass's floor is 16 bytes an element of the weight (read and write it and its
    momentum), on top of the plain weight gradient's reads: what its GB/s is measured by."""
    moved = linear_configs.pass_bytes(32, 25088, 4096)
    assert moved["dw+db+sgd"] - moved["dw+db"] == 3 * 4 * 4096 * 25088


def test_grid_pins_the_list_then_the_grid_on_the_passes_named(tmp_path):
    out = tmp_path / "linear-grid.json"
    result = linear_configs.main(["--batch", "2", "--passes", "dw+db+sgd", "--grid",
                                  "--out", str(out)])
    grid = linear_configs.grid_configs()
    listed = _common.config_count(linear)
    timed = [r for r in result["rows"] if "config" in r]
    assert {r["pass"] for r in result["rows"]} == {"dw+db+sgd"}
    assert len(timed) == listed + len(grid)
    last = grid[-1]
    assert timed[-1]["config"] == f"{last.kwargs} w{last.num_warps} s{last.num_stages}"
    assert len(linear._gemm_kernel.all_configs) == listed        # the list is restored


def test_an_unknown_pass_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        linear_configs.main(["--passes", "dw+sgd"])
    assert "unknown pass 'dw+sgd'" in capsys.readouterr().err
