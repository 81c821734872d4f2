"""The GPU correctness run as one results JSON: pytest run in this process on the given
arguments (default: `-m gpu tests`), one row per test (node id, outcome, seconds and, where it
did not pass, a one-line reason), the count of each outcome and pytest's exit code, which is
also this script's.

    python3 bench/gpu_tests.py --out gpu-tests.json [-- -q -m gpu -n 14 tests]

With pytest-xdist (`-n N`) the workers' reports reach this process's hooks, so the rows are
the same as without it. SIGTERM (what `timeout` sends) interrupts pytest like Ctrl-C, so a run
cut short still writes the rows it has, with exit code 2 (interrupted).
"""
import argparse
import os
import re
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401  (before triton: picks the interpreter on a CPU machine)
import pytest  # noqa: E402

from bench.common import add_out_argument, write  # noqa: E402

DEFAULT_ARGS = ["-m", "gpu", "tests"]
OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
# a later phase's outcome replaces an earlier one only when it ranks higher: a teardown error
# turns a pass into an error, but a failed call stays a failure
RANK = {"passed": 0, "xpassed": 0, "skipped": 0, "xfailed": 0, "failed": 1, "error": 1}


def phase_outcome(report):
    """The test outcome one phase's report stands for, or None (a setup or teardown that
    passed says nothing about the test). A report of no phase (xdist's for a test whose
    worker crashed) counts as the call's."""
    xfail = hasattr(report, "wasxfail")
    if report.when not in ("setup", "teardown"):
        if xfail:
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome
    if report.failed:
        return "error"
    if report.skipped:
        return "xfailed" if xfail else "skipped"
    return None


def reason_of(report) -> str:
    """One line saying why a test did not pass: an xfail's or skip's reason, else the first
    line of the crash message, else the last line of the report's text."""
    if getattr(report, "wasxfail", ""):
        return report.wasxfail
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):                 # a skip: (path, line, "Skipped: why")
        return longrepr[2].removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and crash.message.strip():
        return crash.message.strip().splitlines()[0]
    lines = str(longrepr or "").strip().splitlines()
    return re.sub(r"^E\s+", "", lines[-1].strip()) if lines else ""


class Collector:
    """A pytest plugin keeping one row per test, built from its phases' reports (setup, call,
    teardown) and from failed collections; a test that started and never finished (the run
    was interrupted) keeps outcome None. Under pytest-xdist the reports arrive at the
    controller's hooks, where this plugin is registered."""

    def __init__(self):
        self.rows = {}

    def _row(self, nodeid) -> dict:
        """The row of `nodeid`, begun (outcome None) at its first report."""
        return self.rows.setdefault(nodeid, {"nodeid": nodeid, "outcome": None, "seconds": 0.0})

    def pytest_runtest_logstart(self, nodeid, location):
        """A test began: it has a row even if the run stops before its setup is reported."""
        self._row(nodeid)

    def pytest_runtest_logreport(self, report):
        row = self._row(report.nodeid)
        row["seconds"] += report.duration
        outcome = phase_outcome(report)
        if outcome is not None and (row["outcome"] is None
                                    or RANK[outcome] > RANK[row["outcome"]]):
            row["outcome"] = outcome
            row.pop("reason", None)
            if outcome not in ("passed", "xpassed"):
                row["reason"] = reason_of(report)

    def pytest_collectreport(self, report):
        if report.failed:
            self.rows[report.nodeid] = {"nodeid": report.nodeid, "outcome": "error",
                                        "seconds": 0.0, "reason": reason_of(report)}

    def results(self) -> dict:
        """The count of each outcome, the rows (by node id) of every test that finished and
        the node ids of those started and not finished."""
        done = sorted((r for r in self.rows.values() if r["outcome"] is not None),
                      key=lambda r: r["nodeid"])
        counts = {name: sum(r["outcome"] == name for r in done) for name in OUTCOMES}
        unfinished = sorted(r["nodeid"] for r in self.rows.values() if r["outcome"] is None)
        return {"counts": counts, "unfinished": unfinished, "rows": done}


def _interrupt(signum, frame):
    """SIGTERM handler: stop pytest as Ctrl-C does, so its session still finishes, and ignore
    any SIGTERM after this one: `timeout` sends it to the process and again to its group, and
    a second KeyboardInterrupt inside pytest's handling of the first ends the run unwritten."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def run_pytest(pytest_args, collector) -> int:
    """pytest.main on `pytest_args` with `collector` registered; SIGTERM interrupts it (in
    the main thread, where a handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return int(pytest.main(pytest_args, plugins=[collector]))
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return int(pytest.main(pytest_args, plugins=[collector]))
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv=None) -> int:
    """Run pytest, write the results JSON to --out, print the counts; return pytest's code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(parser)
    parser.add_argument("pytest_args", nargs="*", default=DEFAULT_ARGS,
                        help="pytest's arguments, after `--` (default: -m gpu tests)")
    args = parser.parse_args(argv)
    collector = Collector()
    start = time.perf_counter()
    code = run_pytest(list(args.pytest_args), collector)
    results = collector.results()
    payload = {"pytest_args": list(args.pytest_args), "exit_code": code,
               "wall_s": time.perf_counter() - start, **results}
    counts = ", ".join(f"{n} {name}" for name, n in results["counts"].items() if n)
    if results["unfinished"]:
        counts += f", {len(results['unfinished'])} unfinished"
    print(f"gpu_tests: {counts or 'no tests'}, exit code {code}", flush=True)
    if write(args.out, payload):
        print(f"wrote {args.out}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
