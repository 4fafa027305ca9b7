"""The README a newcomer reads first: short, with its two commands (CI runs the test command, .ci/run)."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARK = "pip install torch==2.13.0 . && python -m tokenyard.tools.bench"
TESTS = 'pip install torch==2.13.0 ".[test]" && python -m pytest -q tests'


def test_readme_gives_the_benchmark_and_test_commands_within_12000_characters():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 12000, len(text)
    assert BENCHMARK in text and TESTS in text
    assert "python -m pytest -q tests" in (ROOT / ".ci" / "run").read_text()  # CI runs it too
