"""The README's first commands are the ones CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_readme_opens_with_setup_and_test_commands():
    setup, tests = readme_commands()[:2]
    assert "pip install" in setup and "tinysn train" in setup
    assert tests.startswith("python3 -m pytest")


def test_ci_runs_exactly_the_readme_test_command():
    tests = readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in [line.strip() for line in ci]
