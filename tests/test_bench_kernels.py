"""bench/kernels.py's command line and the rows of its norm and misc groups, on the CPU (the
timing itself runs only on the device machine)."""
import pytest
import torch

from bench import common, kernels, kernels_misc, kernels_norm


def test_kernels_takes_out_and_refuses_without_a_gpu(tmp_path, monkeypatch, capsys):
    """--out is accepted (the device script passes it), and a CPU-only host gets one line and
    no results file."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "k.json"
    assert kernels.main(["--only", "misc", "--out", str(out)]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not out.exists()


def test_kernels_refuses_an_unknown_group(capsys):
    assert kernels.main(["--only", "conv,nope"]) == 2
    assert "unknown group" in capsys.readouterr().out


def test_dropout_rows_call_the_kernels_as_the_runtime_does():
    """Both dropout rows run (no "error" row), and the forward keeps about half the values."""
    runner = common.Runner(lambda *_: None, kernels_misc._fmt, timer=lambda fn: 1.0)
    kernels_misc._bench_dropout(runner, "cpu", batch=1)
    assert [r["kernel"] for r in runner.rows] == ["dropout.forward", "dropout.backward"] * 2
    assert not [r for r in runner.rows if "error" in r], runner.rows
    for row in runner.rows[::2]:
        assert 0.45 < row["keep_fraction"] < 0.55


@pytest.mark.parametrize("module,group", [(m, g) for m in (kernels_norm, kernels_misc)
                                          for g in m.GROUPS])
def test_every_row_runs_its_kernels(module, group, monkeypatch):
    """Each group's rows call tinysn's kernels as they are today (a changed signature shows
    as an "error" row), at batch 1 under the interpreter, with a stub timer; the fully
    connected and SGD rows on small sizes (theirs do not scale with the batch)."""
    monkeypatch.setattr(kernels_misc, "LINEAR_SHAPES", (("small fc", 48, 40),))
    monkeypatch.setattr(kernels_misc, "SGD_NUMEL", 5000)
    runner = common.Runner(lambda *_: None, module._fmt, timer=lambda fn: 1.0)
    getattr(module, f"_bench_{group}")(runner, "cpu", 1)
    assert runner.rows and not [r for r in runner.rows if "error" in r], runner.rows
