"""Run the benchmarks: ``python -m benchmarks.run [--quick] [--only NAME ...] [--out DIR]``.

Each benchmark is a module with ``run(quick: bool, out_dir: Path) -> dict``. The dict is stored
verbatim in ``results.json``; these keys are also rendered into ``results.md``:

- ``tables``: a list of ``benchmarks.common.table(...)`` dicts (title, columns, rows, note);
- ``plots``:  PNG file names the benchmark wrote into ``out_dir``;
- ``notes``:  a list of sentences worth reading next to the numbers.

Each entry is stamped and keyed by ``benchmarks/record.py`` (benchmark, precision, machine).

To add a benchmark, write the module and add one line to ``REGISTRY`` (``benchmarks/registry.py``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks import record
from benchmarks.common import machine_info, render_table
from benchmarks.registry import REGISTRY

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def render_results_page(results: dict) -> str:
    from scripts.gen_docs import render_results

    return render_results(results)


def update_pages() -> None:
    """The docs' figures (docs/benchmarks.md, the README's quickstart result) from results.json: scripts/gen_docs.py
    renders them, and tests/unit/test_docs.py checks they are what results.json renders to."""
    from scripts.gen_docs import main as gen_docs

    gen_docs([])


def measured(run: Callable[[], dict], quick: bool, machine: dict) -> dict:
    """``run()``'s entry with the mode, the seconds it took, the machine and the 1-minute load average before and
    after (the machine may be shared: above the core count, other work shared the CPUs)."""
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    entry = run()
    return {
        "quick": quick,
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine,
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        **entry,
    }


def _names(text: str) -> list[str]:
    """One ``--only`` word: a name or comma-separated names, each registered."""
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: not a benchmark ({', '.join(REGISTRY)})")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller settings (a few minutes in all)")
    ap.add_argument(
        "--only",
        nargs="+",
        type=_names,
        metavar="NAME",
        help=f"run only these, space- or comma-separated ({', '.join(REGISTRY)}); default: all",
    )
    ap.add_argument(
        "--readme-only",
        action="store_true",
        help="regenerate the docs' benchmark figures (README.md, docs/benchmarks.md) from results.json only",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    args = ap.parse_args(argv)

    try:
        from transformers.utils import logging as hf_logging

        # Per-checkpoint progress bars drown the benchmark's own progress lines.
        hf_logging.disable_progress_bar()
    except ImportError:
        pass

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "results.json"
    if args.readme_only:
        update_pages()
        return 0
    # Earlier entries are kept, so `--only X` refreshes X alone on this machine and in this precision (an entry of X
    # from another machine or precision stays beside it); every entry carries its own stamp.
    try:
        results = record.load(json_path)
    except ValueError:
        print(f"warning: {json_path} is not valid JSON; starting afresh", file=sys.stderr)
        results = {"benchmarks": {}}

    machine = machine_info()
    results["machine"] = machine
    failed = []
    selected = [n for word in args.only for n in word] if args.only else list(REGISTRY)
    for name in dict.fromkeys(selected):
        print(f"=== {name} ({'quick' if args.quick else 'full'})", flush=True)
        try:
            module = importlib.import_module(REGISTRY[name])
            entry = measured(functools.partial(module.run, args.quick, out), args.quick, machine)
        except Exception:  # noqa: BLE001 - one failed benchmark must not lose the others' results
            entry = {"quick": args.quick, "seconds": 0.0, "machine": machine, "error": traceback.format_exc()}
            failed.append(name)
            print(entry["error"], file=sys.stderr, flush=True)
        command = record.command_line("benchmarks.run", ["--only", name, *(["--quick"] if args.quick else [])])
        record.put(results, name, entry, command, entry["machine"])
        # Written after every benchmark so an interrupted run keeps what it measured.
        record.save(results, json_path)
        (out / "results.md").write_text(render_results_page(results))
        for t in entry.get("tables", []):
            print(render_table(t), "\n", flush=True)
        print(f"=== {name} done in {entry['seconds']:.0f} s", flush=True)
    print(f"results: {json_path} and {out / 'results.md'}")
    # The README shows full runs only; --quick is for checking that everything still runs.
    if not args.quick and out.resolve() == DEFAULT_OUT.resolve():
        update_pages()
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
