"""benchmarks/results/results.json holds only what the benchmarks wrote: every entry carries the stamp
``benchmarks/record.py`` put on it (command, commits, date, machine, precision), each stamped commit is in the
repository's history, and no entry mixes machines or precisions."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import record

HERE = {"date": "2026-12-07T20:00:00+00:00", "cpu_model": "AMD EPYC", "cores": 2, "memory_gib": 23.5, "torch": "2.13"}


def _machine(commit: str, **changes) -> dict:
    return {**HERE, "cpu_bf16": False, "git_commit": commit, **changes}


CMD = "python -m benchmarks.levers"


def _head() -> str:
    return subprocess.run(["git", "-C", str(record.ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip()  # fmt: skip


def test_every_entry_of_results_json_is_stamped_and_its_commits_are_in_the_history():
    stored = json.loads(record.RESULTS.read_text())["benchmarks"]
    unstamped = [key for key, entry in stored.items() if "stamp" not in entry]
    assert not unstamped, f"entries without a stamp (written by hand?): {unstamped}"
    for key, entry in stored.items():
        assert set(entry["stamp"]) >= {"benchmark", "command", "commits", "date", "machine", "dtype"}, key
        assert entry["stamp"]["command"].startswith("python -m benchmarks."), key
    assert record.problems(record.load()) == []


def test_a_run_on_another_machine_or_in_another_precision_gets_its_own_entry():
    head = _head()
    results: dict = {"benchmarks": {}}
    first = record.put(results, "levers", {"rows": [], "dtype": "float32"}, CMD, _machine(head))
    record.put(results, "levers", {"rows": [], "dtype": "bfloat16"}, CMD, _machine(head))
    record.put(results, "levers", {"rows": [], "dtype": "float32"}, CMD,
               _machine(head, cpu_model="Intel Xeon"))  # fmt: skip
    assert len(results["benchmarks"]) == 3
    # the same benchmark, machine and precision again: it replaces that entry alone
    again = record.put(results, "levers", {"rows": [{"x": 1}], "dtype": "float32"}, CMD,
                       _machine(head))  # fmt: skip
    assert again == first and len(results["benchmarks"]) == 3
    assert results["benchmarks"][first]["rows"] == [{"x": 1}]
    assert record.problems(results) == []
    assert [e["stamp"]["dtype"] for e in record.entries(results, "levers")].count("float32") == 2


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"dtype": "bfloat16"}, "is bfloat16, the entry float32"),
        ({"commit": "40d84e6"}, "ran at 40d84e6"),
        ({"ran": {"commit": "x", "machine": {**HERE, "cpu_bf16": True}}}, "a kept run on AMD EPYC"),
    ],
)
def test_rows_from_another_run_are_refused(row, says):
    """The hand edits this check was written for: float32 rows from other commits and machines added to a bf16
    entry."""
    with pytest.raises(ValueError, match=says):
        record.put({}, "levers", {"rows": [row], "dtype": "float32"}, CMD, _machine(_head()))


def test_a_commit_missing_from_the_history_or_an_entry_under_another_key_is_named():
    results: dict = {"benchmarks": {}}
    key = record.put(results, "levers", {"rows": []}, CMD, _machine("0123abc"))
    results["benchmarks"]["levers"] = results["benchmarks"].pop(key)
    found = record.problems(results)
    assert any("commit 0123abc is not in the history" in p for p in found), found
    assert any("stored under another key" in p for p in found), found
