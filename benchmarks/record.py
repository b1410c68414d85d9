"""``benchmarks/results/results.json``'s entries, written only through here: each stamped by code with the command that
ran it, the commits, the date, the machine and the precision, and keyed by benchmark, precision and machine, so runs
on different machines or in different precisions never share an entry.

The stamp is ``{"benchmark", "command", "commits", "date", "machine", "dtype"}``; ``machine`` holds the fields its
figures depend on (``common.STAMPED_MACHINE``). Entries written before stamps existed get theirs from the machine
record ``run.py`` wrote with them (``legacy_stamp``), marked ``"derived"``. ``problems()`` is the check
``tests/unit/test_results_stamps.py`` runs: a stamp's commits must exist and an entry's rows must agree with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "results.json"
# The fields of ``common.machine_info()`` an entry's figures depend on (bf16 above all); ``common`` imports torch,
# which reading results.json must not need.
STAMPED_MACHINE = ("cpu_model", "cores", "memory_gib", "cpu_bf16", "torch")


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command as typed: ``python -m <module> <argv>``."""
    return " ".join(["python", "-m", module, *argv])


def dtype_of(entry: dict, machine: dict) -> str:
    """The precision an entry's figures were taken in: the dtypes it names (weight_sync times each on purpose), else
    what the CPU computes in (our runs take bf16 only where the CPU has it)."""
    settings = entry.get("settings")
    dtypes = settings.get("dtypes") if isinstance(settings, dict) else None
    if dtypes:
        return ", ".join(dtypes)
    return "bfloat16" if machine.get("cpu_bf16") else "float32"


def stamp(name: str, command: str, entry: dict, machine: dict) -> dict[str, Any]:
    """The stamp of a run that has just finished: ``machine`` is ``common.machine_info()`` (or ``kept_machine()``
    for runs kept from earlier invocations, whose commits it lists)."""
    return {
        "benchmark": name,
        "command": command,
        "commits": _commits(machine.get("git_commit")),
        "date": machine["date"],
        "machine": {k: machine.get(k) for k in STAMPED_MACHINE},
        "dtype": entry.get("dtype") or dtype_of(entry, machine),
    }


def legacy_stamp(name: str, entry: dict) -> dict[str, Any]:
    """The stamp of an entry written before stamps: from the machine record ``run.py`` wrote beside it."""
    quick = " --quick" if entry.get("quick") else ""
    machine = entry.get("machine", {})
    return {
        **stamp(name, f"python -m benchmarks.run --only {name}{quick}", entry, machine),
        "derived": "from the entry's machine record (written before stamps)",
    }


def _commits(text: str | None) -> list[str]:
    return [c.strip() for c in (text or "").split(",") if c.strip() and c.strip() != "?"]


def machine_label(machine: dict) -> str:
    bf16 = "bf16 arithmetic" if machine.get("cpu_bf16") else "no bf16 arithmetic"
    return (
        f"{machine.get('cpu_model', '?')}, {machine.get('cores', '?')} cores, {machine.get('memory_gib', '?')} GiB, "
        f"{bf16}, torch {machine.get('torch', '?')}"
    )


def entry_key(s: dict) -> str:
    """One entry per benchmark, precision and machine."""
    return f"{s['benchmark']} [{s['dtype']}; {machine_label(s['machine'])}]"


def load(path: Path = RESULTS) -> dict:
    """results.json, each entry under its stamp's key (an entry from before stamps gets its derived stamp)."""
    results = json.loads(path.read_text()) if path.exists() else {}
    entries = results.get("benchmarks", {})
    results["benchmarks"] = {}
    for key, entry in entries.items():
        s = entry.get("stamp") or legacy_stamp(key, entry)
        results["benchmarks"][entry_key(s)] = {**entry, "stamp": s}
    return results


def entries(results: dict, name: str) -> list[dict]:
    """The entries of benchmark ``name``, newest first."""
    found = [e for e in results.get("benchmarks", {}).values() if e["stamp"]["benchmark"] == name]
    return sorted(found, key=lambda e: e["stamp"]["date"], reverse=True)


def put(results: dict, name: str, entry: dict, command: str, machine: dict) -> str:
    """``entry`` stamped and stored in ``results`` under its key, replacing that key's earlier entry only (the same
    benchmark on another machine or in another precision keeps its own); refused when its rows do not agree with its
    stamp. Returns the key."""
    s = stamp(name, command, entry, machine)
    entry = {**entry, "stamp": s}
    wrong = list(_disagreements(entry))
    if wrong:
        raise ValueError(f"{name}: rows that do not belong to this run's stamp: {wrong}")
    key = entry_key(s)
    results.setdefault("benchmarks", {})[key] = entry
    if "error" not in entry:  # measured again: no longer among the rows taken out (docs/benchmarks.md)
        results.get("removed", {}).pop(name, None)
    return key


def save(results: dict, path: Path = RESULTS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


def _disagreements(entry: dict) -> Iterator[str]:
    """Rows of ``entry`` whose own precision, commit or machine is not its stamp's."""
    s = entry["stamp"]
    dtypes = {d.strip() for d in s["dtype"].split(",")}
    for i, row in enumerate(entry.get("rows", [])):
        if isinstance(row, dict) and row.get("dtype", s["dtype"]) not in dtypes:
            yield f"rows[{i}] is {row['dtype']}, the entry {s['dtype']}"
        if isinstance(row, dict) and "commit" in row and row["commit"] not in s["commits"]:
            yield f"rows[{i}] ran at {row['commit']}, the entry at {', '.join(s['commits'])}"
    for ran in _ran(entry):
        machine = ran.get("machine")
        if machine is not None and {k: machine.get(k) for k in STAMPED_MACHINE} != s["machine"]:
            yield f"a kept run on {machine_label(machine)}, the entry on {machine_label(s['machine'])}"


def _ran(o: Any) -> Iterator[dict]:
    """The stamps of kept runs (``common.ran_stamp``) anywhere in an entry."""
    if isinstance(o, dict):
        for k, v in o.items():
            if k == "ran" and isinstance(v, dict):
                yield v
            else:
                yield from _ran(v)
    elif isinstance(o, list):
        for v in o:
            yield from _ran(v)


def commit_exists(commit: str, repo: Path = ROOT) -> bool:
    probe = ["git", "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def problems(results: dict, repo: Path = ROOT) -> list[str]:
    """What is wrong with ``results`` (from ``load``): an entry without commits, a commit not in ``repo``'s history,
    an entry under another key than its stamp's, rows that disagree with their entry's stamp."""
    out = []
    for key, entry in results.get("benchmarks", {}).items():
        s = entry["stamp"]
        if key != entry_key(s):
            out.append(f"{key}: stored under another key than its stamp's ({entry_key(s)})")
        if not s["commits"]:
            out.append(f"{key}: no commit")
        out += [f"{key}: commit {c} is not in the history" for c in s["commits"] if not commit_exists(c, repo)]
        out += [f"{key}: {d}" for d in _disagreements(entry)]
    return out


if __name__ == "__main__":  # python -m benchmarks.record: check results.json
    found = problems(load())
    print("\n".join(found) or "results.json: every entry stamped, every commit found, no entry mixes runs")
    sys.exit(1 if found else 0)
