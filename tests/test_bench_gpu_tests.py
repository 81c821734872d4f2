"""bench/gpu_tests.py: pytest run in-process on throwaway test files (one of each outcome, a
collection that fails, a run cut short by SIGTERM, a crashed xdist worker), with and without
`-n 2`; the JSON's rows, counts and exit code, and where it is written."""
import json
import signal

import pytest

from bench import gpu_tests

THROWAWAY = '''
import pytest


def test_passes():
    assert 1 + 1 == 2


def test_fails():
    assert 2 + 2 == 5, "arithmetic is broken"


@pytest.mark.skip(reason="nothing to run here")
def test_skipped():
    pass


@pytest.mark.xfail(reason="a known gap")
def test_xfails():
    assert False


@pytest.mark.xfail(reason="fixed since")
def test_xpasses():
    pass


@pytest.fixture
def broken_setup():
    raise RuntimeError("setup broke")


def test_setup_errors(broken_setup):
    pass


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")


def test_teardown_errors(broken_teardown):
    pass
'''
EXPECTED = {  # test name: (outcome, reason)
    "test_passes": ("passed", None),
    "test_fails": ("failed", "AssertionError: arithmetic is broken"),
    "test_skipped": ("skipped", "nothing to run here"),
    "test_xfails": ("xfailed", "a known gap"),
    "test_xpasses": ("xpassed", None),
    "test_setup_errors": ("error", "RuntimeError: setup broke"),
    "test_teardown_errors": ("error", "RuntimeError: teardown broke"),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder of throwaway test files (one module name each, shared by every run)."""
    path = tmp_path_factory.mktemp("gpu_tests")
    (path / "test_throwaway.py").write_text(THROWAWAY)
    (path / "test_broken_import.py").write_text("import no_such_module_here\n")
    (path / "test_terminated.py").write_text(
        "import os, signal\n\nimport pytest\n\n\ndef test_first():\n    pass\n\n\n"
        "@pytest.fixture\ndef sigterm():\n    os.kill(os.getpid(), signal.SIGTERM)\n\n\n"
        "def test_sigterm_in_setup(sigterm):\n    pass\n\n\n"
        "def test_never_reached():\n    pass\n")
    (path / "test_worker_crash.py").write_text(
        "import os\n\n\ndef test_survives():\n    pass\n\n\n"
        "def test_crashes():\n    os._exit(3)\n")
    return path


def run(folder, out, name, *extra):
    """bench/gpu_tests.main on one throwaway file; (exit code, the JSON written to `out`).
    The SIGTERM handler it sets is put back."""
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:benchmark", f"--rootdir={folder}",
            *extra, str(folder / name)]
    handler = signal.getsignal(signal.SIGTERM)
    code = gpu_tests.main(["--out", str(out), "--", *args])
    assert signal.getsignal(signal.SIGTERM) is handler
    data = json.loads(out.read_text())
    assert data["pytest_args"] == args and data["exit_code"] == code
    assert set(data["environment"]) >= {"gpu", "torch", "command"}
    return code, data


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist-n2"])
def test_every_outcome_with_its_reason_and_pytests_exit_code(folder, tmp_path, workers):
    out = tmp_path / "results" / "gpu-tests.json"
    code, data = run(folder, out, "test_throwaway.py", *workers)
    assert code == pytest.ExitCode.TESTS_FAILED
    rows = {r["nodeid"].split("::")[1]: r for r in data["rows"]}
    assert set(rows) == set(EXPECTED) and data["unfinished"] == []
    for name, (outcome, reason) in EXPECTED.items():
        assert rows[name]["outcome"] == outcome, name
        assert rows[name].get("reason") == reason, name
        assert rows[name]["seconds"] >= 0
    assert data["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 2,
                              "xfailed": 1, "xpassed": 1}
    assert [r["nodeid"] for r in data["rows"]] == sorted(r["nodeid"] for r in data["rows"])


def test_a_failed_collection_is_an_error_row(folder, tmp_path):
    code, data = run(folder, tmp_path / "r.json", "test_broken_import.py")
    assert code == pytest.ExitCode.INTERRUPTED
    reason = "ModuleNotFoundError: No module named 'no_such_module_here'"
    assert data["rows"] == [{"nodeid": "test_broken_import.py", "outcome": "error",
                             "seconds": 0.0, "reason": reason}]


def test_sigterm_interrupts_pytest_and_the_finished_rows_are_written(folder, tmp_path):
    code, data = run(folder, tmp_path / "r.json", "test_terminated.py")
    assert code == pytest.ExitCode.INTERRUPTED
    assert [(r["nodeid"], r["outcome"]) for r in data["rows"]] == [
        ("test_terminated.py::test_first", "passed")]
    assert data["unfinished"] == ["test_terminated.py::test_sigterm_in_setup"]


def test_a_second_sigterm_while_pytest_stops_still_writes_the_rows(tmp_path):
    """`timeout` signals the process, then its group: the second SIGTERM lands while pytest
    handles the first (here from pytest_keyboard_interrupt)."""
    twice = tmp_path / "twice"
    twice.mkdir()
    (twice / "conftest.py").write_text(
        "import os, signal\n\n\ndef pytest_keyboard_interrupt(excinfo):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n")
    (twice / "test_twice.py").write_text(
        "import os, signal\n\n\ndef test_first():\n    pass\n\n\n"
        "def test_terminated():\n    os.kill(os.getpid(), signal.SIGTERM)\n")
    code, data = run(twice, tmp_path / "r.json", "test_twice.py")
    assert code == pytest.ExitCode.INTERRUPTED
    assert [r["outcome"] for r in data["rows"]] == ["passed"]
    assert data["unfinished"] == ["test_twice.py::test_terminated"]


def test_a_crashed_xdist_worker_fails_its_test(folder, tmp_path):
    code, data = run(folder, tmp_path / "r.json", "test_worker_crash.py", "-n", "1",
                     "--max-worker-restart=0")
    assert code == pytest.ExitCode.TESTS_FAILED
    rows = {r["nodeid"].split("::")[1]: r for r in data["rows"]}
    assert rows["test_survives"]["outcome"] == "passed"
    assert rows["test_crashes"]["outcome"] == "failed"
    assert "crashed while running" in rows["test_crashes"]["reason"]


def test_out_must_name_a_json_file_before_pytest_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_tests.main(["--out", str(tmp_path / "r.txt"), "--", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--out must name a .json file" in err
    assert list(tmp_path.iterdir()) == []
