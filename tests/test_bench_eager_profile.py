"""bench/eager_profile.py: an eager step's host time split by cProfile (CPU smoke run)."""
import json
import os

from bench import eager_profile


def test_profiles_an_eager_step_and_counts_its_triton_launches(tmp_path):
    out = tmp_path / "eager.json"
    r = eager_profile.main(["--model", "lenet", "--batch", "2", "--steps", "1", "--top", "5",
                            "--out", str(out)])
    assert json.loads(out.read_text())["model"] == "lenet"
    assert r["step_ms"] > 0 and r["issue_ms"] > 0
    assert 0 < r["pool_peak_bytes"] == r["planned_peak_bytes"] <= r["arena_bytes"]
    assert r["process_peak_bytes"] is None              # the CPU has no device peak
    # every layer launch runs at least one Triton kernel, SGD one per parameter besides
    assert r["triton_launches_per_step"] >= r["plan_launches_per_step"] > 0
    # on the interpreter the kernels run inside Triton's `run`: nearly all the time (its
    # cumulative time may pass the sum of own times by the profiler's rounding)
    assert 0.5 < r["triton_launch_path_share"] < 1.05 and 0 < r["tinysn_own_share"] < 0.5
    # with Triton's launches stubbed out the same launches are counted, and the host's
    # time is tinysn's own: a small part of a step whose kernels the interpreter runs
    assert r["stubbed_launches_per_step"] == r["triton_launches_per_step"]
    assert sum(r["launches_by_kernel"].values()) == r["stubbed_launches_per_step"]
    assert 0 < r["own_issue_ms"] < r["issue_ms"] / 2
    assert len(r["top"]) == 5
    own = [row["own_us_per_step"] for row in r["top"]]
    assert own == sorted(own, reverse=True) and own[0] > 0


def test_the_stub_counts_launches_runs_nothing_and_restores_triton():
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter, jit

    @triton.jit
    def fill(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, 1.0, mask=offs < n)

    runs = (jit.JITFunction.run, interpreter.InterpretedFunction.run)
    x = torch.zeros(8)
    with eager_profile.triton_stubbed() as calls:
        fill[(1,)](x, 8, BLOCK=8)
        fill[(1,)](x, 8, BLOCK=8)
    assert calls == {"fill": 2} and not x.any()
    assert (jit.JITFunction.run, interpreter.InterpretedFunction.run) == runs
    fill[(1,)](x, 8, BLOCK=8)
    assert bool((x == 1).all())


def test_own_only_counts_every_launch_of_a_resnet_step_by_kernel(tmp_path, capsys):
    """--own-only: ResNet-50's launches without running a kernel (seconds on a CPU): one SGD
    launch for the fc layer and one for each conv and the batch norm after it; a batch norm
    of small channels, many of them, one launch each way (bn._one_program), any other three
    (partial sums, their merge, the elementwise pass)."""
    import tinysn as sn
    from tinysn.kernels import bn
    out = tmp_path / "own.json"
    r = eager_profile.main(["--model", "resnet50", "--batch", "1", "--steps", "1", "--own-only",
                            "--no-fuse-bn-relu", "--out", str(out)])
    assert json.loads(out.read_text())["own_issue_ms"] == r["own_issue_ms"] > 0
    net = sn.models.resnet50(batch=1)
    bns = sum(layer.op == "bn" for layer in net.layers)
    by = r["launches_by_kernel"]
    # a batch norm's scale and shift share the SGD launch of the conv before it (liveness
    # `_update_groups`): 54 launches for 161 tensors
    assert by["_sgd_kernel"] == 1 + bns == 54
    one = sum(bn._one_program(n, c, h * w) for n, c, h, w in
              (layer.shape for layer in net.layers if layer.op == "bn"))
    assert by["_bn_channel_fwd_kernel"] == by["_bn_channel_bwd_kernel"] == one == 38
    three = ["_bn_stats_kernel", "_bn_finalize_kernel", "_bn_norm_kernel",
             "_bn_bwd_partial_kernel", "_bn_bwd_finalize_kernel", "_bn_dx_kernel"]
    assert [by[k] for k in three] == [bns - one] * 6 and bns == 53
    assert sum(by.values()) == r["stubbed_launches_per_step"] > r["plan_launches_per_step"]
    assert "step_ms" not in r and "_sgd_kernel" in capsys.readouterr().out
    fused = eager_profile.main(["--model", "resnet50", "--batch", "1", "--steps", "1",
                                "--own-only"])
    # the 16 ReLUs after an add are fused into it either way (its fan-out masks dy); with
    # the batch norms' fused too none is left: those 33 are read by one conv or pool alone,
    # whose backward masks dx
    relus = {k: v for k, v in by.items() if k.startswith("_relu")}
    assert relus == {"_relu_fwd_kernel": 33, "_relu_bwd_kernel": 33}
    assert not any(k.startswith("_relu") for k in fused["launches_by_kernel"])
    assert fused["stubbed_launches_per_step"] == r["stubbed_launches_per_step"] - 2 * 33


def test_names_tinysn_and_site_package_files_by_their_package():
    here = os.path.join(eager_profile.TINYSN_DIR, "runtime.py")
    assert eager_profile.where((here, 3, "step")) == "tinysn/runtime.py:3(step)"
    pkg = os.path.join("/x", "lib", "site-packages", "triton", "runtime", "jit.py")
    assert eager_profile.where((pkg, 9, "run")) == "triton/runtime/jit.py:9(run)"
    assert eager_profile.is_triton_run((pkg, 9, "run"))
    assert not eager_profile.is_triton_run((here, 9, "run"))
