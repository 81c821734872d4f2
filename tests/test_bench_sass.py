"""bench/sass.py compiles tinysn's kernels for the H200 (sm_90) on a CPU machine: the SGD
update's loads and stores are 16 bytes wide with nothing spilled, and an autotuned kernel
(fc6's GEMM) is compiled once per GPU config, each a matrix-instruction kernel."""
import json
import os
import subprocess
import sys

from tinysn.kernels import linear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sass.py"), *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_reports_every_config_of_what_a_launcher_runs(tmp_path):
    out = tmp_path / "sass.json"
    done = _run("--only", "sgd 1M,fc6 fwd", "--batch", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    sgd = [r for r in rows if r["case"] == "sgd 1M"]
    assert [r["kernel"] for r in sgd] == ["_sgd_kernel"]
    assert sgd[0]["registers"] > 0 and sgd[0]["local_bytes"] == 0
    assert {"LDG.E.128", "STG.E.128"} <= set(sgd[0]["opcodes"])
    gemm = [r for r in rows if r["case"] == "fc6 fwd"]
    assert len(gemm) == len(linear._gemm_kernel.all_configs)
    assert len({r["config"] for r in gemm}) == len(gemm)
    assert all(any(op.startswith(("HGMMA", "HMMA")) for op in r["opcodes"]) for r in gemm)
    assert all(0 < r["shared_bytes"] <= 227 * 1024 for r in gemm)


def test_an_unknown_case_is_one_line():
    done = _run("--only", "nope")
    assert done.returncode != 0
    assert "unknown case(s) ['nope']" in done.stderr
