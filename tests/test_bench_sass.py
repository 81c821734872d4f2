"""bench/sass.py compiles tinysn's kernels for the H200 (sm_90) on a CPU machine. Over every
case and every GPU config of the autotuned kernels: nothing spills, shared memory fits the
H200's 227 KiB and every GEMM is a matrix-instruction kernel (a config list change that
breaks one of these fails here, before any GPU time); the SGD update's loads and stores are
16 bytes wide; a batch norm is three kernels each way, or one for small channels; an
autotuned kernel (fc6's GEMM) is compiled once per GPU config."""
import json
import os
import re
import subprocess
import sys

from tinysn.kernels import bn, linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_SHARED_BYTES = 227 * 1024


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sass.py"), *args],
                          capture_output=True, text=True, env=env, timeout=1200)


def test_every_config_compiles_for_the_h200_without_spills(tmp_path):
    out = tmp_path / "sass.json"
    done = _run("--batch", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        where = f"{r['case']} {r['kernel']} {r['config']}"
        assert r["local_bytes"] == 0, f"spills: {where}"
        assert 0 < r["registers"] <= 255, where
        assert r["shared_bytes"] <= H200_SHARED_BYTES, f"shared memory: {where}"
        if r["kernel"].startswith(("_conv_", "_gemm")):
            assert any(op.startswith(("HGMMA", "HMMA")) for op in r["opcodes"]), where
        hgmma = any(op.startswith("HGMMA") for op in r["opcodes"])
        assert (r["wgmma_a"] is not None) == hgmma, where
    sgd = [r for r in rows if r["case"] == "sgd 1M"]
    assert [r["kernel"] for r in sgd] == ["_sgd_kernel"]
    assert {"LDG.E.128", "STG.E.128"} <= set(sgd[0]["opcodes"])
    # a batch norm is three kernels each way (partials, their merge, the elementwise pass),
    # the last left out without dx, or, small channels, many of them, one kernel each way
    # (at batch 2 the 256@56 and 2048@7 cases); both forms compile; a conv's and a batch
    # norm's updates one launch
    kernels = {case: [r["kernel"] for r in rows if r["case"] == case]
               for case in {r["case"] for r in rows}}
    for case, c, hw, three in [
            ("bn fwd residual 256@56", 256, 56, ["_bn_stats_kernel", "_bn_finalize_kernel",
                                                 "_bn_norm_kernel"]),
            ("bn bwd residual 256@56", 256, 56, ["_bn_bwd_partial_kernel",
                                                 "_bn_bwd_finalize_kernel", "_bn_dx_kernel"]),
            ("bn bwd 64@56", 64, 56, ["_bn_bwd_partial_kernel",
                                      "_bn_bwd_finalize_kernel", "_bn_dx_kernel"]),
            ("bn bwd params 2048@7", 2048, 7, ["_bn_bwd_partial_kernel",
                                               "_bn_bwd_finalize_kernel"])]:
        one = "_bn_channel_fwd_kernel" if " fwd " in case else "_bn_channel_bwd_kernel"
        assert kernels[case] == ([one] if bn._one_program(2, c, hw * hw) else three), case
    assert {"_bn_channel_fwd_kernel", "_bn_channel_bwd_kernel", "_bn_stats_kernel",
            "_bn_norm_kernel", "_bn_dx_kernel"} <= {r["kernel"] for r in rows}
    assert kernels["sgd 3 tensors"] == ["_sgd_kernel"]
    # the split-K forward and data gradient: the forward GEMM over chunks, then their sum
    assert set(kernels["conv fwd splitk 512@7"]) == {"_conv_fwd_kernel", "_splitk_reduce_kernel"}
    assert set(kernels["conv dgrad flipped_splitk+ 512@7"]) == {
        "_weight_flip_kernel", "_conv_fwd_kernel", "_splitk_reduce_kernel"}
    # the split-K weight gradient sums the bias gradient in its GEMM: no kernel of its own
    assert set(kernels["conv wgrad splitk+db 3->64@224"]) == {
        "_conv_bwd_weight_kernel", "_splitk_reduce_kernel"}
    # max pooling's gather from stored argmaxes stores whole rows 16 bytes at a time, and
    # takes the input in groups of the stride (a lane: one column of a group of 2 rows on
    # 3x3/2), each group's pixels sharing their windows' loads at constant offsets and taps
    # (100 instructions a pixel when each window computed its own addresses, 44-53 with
    # immediate offsets from the pixel's own window, 23 grouped)
    # the tiling windows' backward from stored argmax bytes keeps its 16-byte stores
    tiles = [r for r in rows if r["case"] == "pool 2x2/2 bwd stored argmax relu"]
    assert tiles and all("STG.E.128" in r["opcodes"] for r in tiles)
    for r in (r for r in rows if r["kernel"] == "_pool_argmax_bwd_kernel"):
        lanes = int(re.search(r"LANES: (\d+)", r["config"]).group(1))
        assert "STG.E.128" in r["opcodes"], r["config"]
        assert r["instructions"] * r["num_warps"] * 32 / (lanes * 2) < 26, r
    gemm = [r for r in rows if r["case"] == "fc6 fwd"]
    assert len(gemm) == len({r["config"] for r in gemm}) == len(linear._gemm_kernel.all_configs)
    # every autotuned kernel of tinysn is among the cases, each with its whole GPU list
    from tinysn.kernels import conv, join, lrn, pool
    for module in (conv, join, linear, lrn, pool):
        for name, tuner in vars(module).items():
            if hasattr(tuner, "all_configs"):
                base = getattr(tuner.base_fn, "__name__", name)
                configs = {r["config"] for r in rows if r["kernel"] == base}
                assert len(configs) == len(tuner.all_configs), name


def test_an_unknown_case_is_one_line():
    done = _run("--only", "nope")
    assert done.returncode != 0
    assert "unknown case(s) ['nope']" in done.stderr


def test_wgmma_a_source_reads_the_a_operand():
    # in a process of its own: importing bench/sass.py switches Triton's interpreter off
    line = "/*1b50*/  HGMMA.64x64x8.F32.TF32 R56, {}, gdesc[UR16], R56, gsb0 ;  /* 0x04 */"
    lines = [line.format("R88"), line.format("gdesc[UR28]"),
             line.format("R88") + "\n" + line.format("gdesc[UR8]"),
             "/*0010*/  HMMA.1688.F32.TF32 R4, R8, R12, R4 ;"]
    code = ("import json, sys; from bench.sass import wgmma_a_source; "
            "print(json.dumps([wgmma_a_source(s) for s in json.loads(sys.argv[1])]))")
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", code, json.dumps(lines)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == ["registers", "shared", "registers+shared", None]
