"""How long a newcomer waits: the README's GPU command run twice, the first time on empty
caches (triton's compiled kernels and tinysn's tuning and conv rankings, in fresh temporary
folders), the second time on what the first left. For each run: seconds from starting the
process until the CLI reports its first step done, and the whole run's wall time.

    python3 bench/first_run.py --out first-run.json [-- train --model resnet50 ...]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import add_out_argument, write  # noqa: E402

README_COMMAND = ["train", "--model", "resnet50", "--batch", "32", "--memory", "12GiB",
                  "--policy", "all", "--steps", "50", "--device", "cuda"]
MARK = "first step done"


def timed_run(command, env) -> dict:
    """Run `python3 -m tinysn COMMAND`; seconds until the first-step line, and in all."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tinysn", *command], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
    first, lines = None, []
    for line in proc.stdout:
        for part in line.split("\r"):
            if MARK in part and first is None:
                first = time.perf_counter() - start
            if part.strip():
                lines.append(part.rstrip())
    code = proc.wait()
    return {"exit_code": code, "first_step_s": first, "total_s": time.perf_counter() - start,
            "last_lines": [x for x in lines if "|" not in x][-4:]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(parser)
    parser.add_argument("command", nargs="*", default=README_COMMAND,
                        help="the tinysn command (default: the README's GPU command)")
    args = parser.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory() as caches:
        env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
               "TINYSN_CACHE_DIR": os.path.join(caches, "tinysn")}
        for name in ("cold", "warm"):
            runs[name] = timed_run(args.command, env)
            print(f"{name}: first step after {runs[name]['first_step_s']} s, "
                  f"{runs[name]['total_s']:.1f} s in all, exit {runs[name]['exit_code']}",
                  flush=True)
            for line in runs[name]["last_lines"]:
                print("   ", line)
    write(args.out, {"command": ["tinysn", *args.command], "cpus": os.cpu_count(), **runs})


if __name__ == "__main__":
    main()
