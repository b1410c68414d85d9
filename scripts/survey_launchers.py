"""Which flags Miles' and slime's published launchers pass: ``python -m scripts.survey_launchers MIRROR...``.

Each MIRROR is a git directory of radixark/miles or THUDM/slime (e.g. the ``fetch`` tool's ``/work/.mirror/...``);
its HEAD's launcher and example scripts are read (bash ``scripts/**.sh`` and ``examples/**.sh``, Python
``scripts/**/run_*.py``, ``examples/**/run_*.py`` and the model-argument files ``scripts/models/*.py``) and every
``--flag`` they spell is counted once per script, into ``miles_async/config/upstream_flags/<name>_launchers.txt``
with the commit read. Bash comments and Python comments and docstrings are skipped (they describe, they do not
pass). What the scripts pass to other programs (``ray``, ``hf download``, Slurm, a standalone SGLang server, the
converters, the Python launchers' own options) is listed in ``NOT_TRAIN`` and left out;
tests/unit/test_launcher_flags.py parses every remaining flag through ``train_async.py``'s parser.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "miles_async" / "config" / "upstream_flags"
UPSTREAMS = {"radixark/miles": "miles", "THUDM/slime": "slime"}
SCRIPT = re.compile(
    r"^(scripts/.*\.sh|scripts/(.*/)?run_[^/]*\.py|scripts/models/[^/]*\.py|examples/.*\.sh|examples/.*/run_[^/]*\.py)$"
)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")

# Flags of the other programs the scripts call, never of the train script.
NOT_TRAIN = {
    "ray": (
        "--address --block --dashboard-host --dashboard-port --disable-usage-stats --force --head --node-ip-address "
        "--num-gpus --port --runtime-env-json --submission-id --no-wait --temp-dir"
    ),
    "hf download / Slurm / srun": (
        "--local-dir --repo-type --container-image --container-mounts --container-name --export --gpus-per-node "
        "--mem --nodes --ntasks --ntasks-per-node --overlap --time"
    ),
    "a standalone SGLang server, agent server or converter": (
        "--model-path --tp --host --mem-fraction-static --chunked-prefill-size --max-concurrent --agent-timeout "
        "--trials-dir --api-url --data --strategy --block-size --max-workers --save-dir --output-dir --model-dir "
        "--fp8-rollout"
    ),
    "the Python launchers' own options (typer) and their messages": (
        "--mode --hardware --node-rank --head-ip --download-only --extra-args --your-arg --task --train-mode "
        "--enable-eval --enable-mtp --enable-optimizer-offload --no-megatron-use-deepep --rollout-fp8 --topology "
        "--cuda-visible-devices --ray-hostfile --join-ray-workers --no-join-ray-workers --use-ref --no-use-ref "
        "--no-colocate --eval-backend --model-local-dir --data-dir --rollout-num-nodes --num-nodes"
    ),
    "the Claude Code CLI an agent example starts": "--agents --settings --disable-slash-commands --disallowed",
}
NOT_TRAIN_FLAGS = frozenset(name for names in NOT_TRAIN.values() for name in names.split())


def launchers(git_dir: Path) -> list[str]:
    files = git(git_dir, "ls-tree", "-r", "--name-only", "HEAD").split()
    return sorted(p for p in files if SCRIPT.match(p))


def passed_text(path: str, text: str) -> str:
    """The words of a script that can reach a command line: bash without comments, Python's strings but its
    docstrings."""
    if path.endswith(".sh"):
        return "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in text.splitlines())
    tree = ast.parse(text)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return "\n".join(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    )


def survey(git_dir: Path) -> tuple[str, list[str], Counter[str]]:
    """The HEAD commit, its launcher scripts, and per flag how many of them pass it."""
    commit = git(git_dir, "rev-parse", "HEAD").strip()
    scripts = launchers(git_dir)
    counts: Counter[str] = Counter()
    for path in scripts:
        found = set(FLAG.findall(passed_text(path, git(git_dir, "show", f"HEAD:{path}"))))
        counts.update(found - NOT_TRAIN_FLAGS)
    return commit, scripts, counts


def render(repo: str, commit: str, date: str, scripts: list[str], counts: Counter[str]) -> str:
    lines = [
        f"# Flags {repo}'s published launchers pass, read from commit {commit} ({date}) by "
        "`python -m scripts.survey_launchers`:",
        f"# {len(scripts)} scripts (bash scripts/**.sh and examples/**.sh, Python scripts/**/run_*.py, "
        "examples/**/run_*.py, scripts/models/*.py);",
        "# each line: the flag, then how many of those scripts pass it. Other programs' flags are left out "
        "(scripts/survey_launchers.py NOT_TRAIN).",
    ]
    lines += [f"{name} {n}" for name, n in sorted(counts.items())]
    return "\n".join(lines) + "\n"


def read(name: str) -> dict[str, int]:
    """A written survey: flag -> how many launchers pass it."""
    path = OUT / f"{name}_launchers.txt"
    return {
        flag: int(n) for flag, n in (line.split() for line in path.read_text().splitlines() if line.startswith("--"))
    }


def git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(git_dir), *args], capture_output=True, text=True, check=True).stdout


def repo_of(git_dir: Path) -> str:
    """Which upstream a mirror is: its remote URL, else its folder name (``owner+name``)."""
    for repo in UPSTREAMS:
        if repo.replace("/", "+") in str(git_dir) or repo in str(git_dir):
            return repo
    raise SystemExit(f"{git_dir}: not a mirror of {' or '.join(UPSTREAMS)}")


def mirrors(argv: list[str] | None, description: str) -> list[tuple[Path, str, str]]:
    """The mirrors named on the command line: (git directory, which upstream, its HEAD's commit date)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("mirrors", nargs="+", type=Path, help="git directories of radixark/miles and THUDM/slime")
    args = parser.parse_args(argv)
    return [(d, repo_of(d), git(d, "log", "-1", "--format=%cs", "HEAD").strip()) for d in args.mirrors]


def main(argv: list[str] | None = None) -> None:
    for git_dir, repo, date in mirrors(argv, __doc__.splitlines()[0]):
        commit, scripts, counts = survey(git_dir)
        path = OUT / f"{UPSTREAMS[repo]}_launchers.txt"
        path.write_text(render(repo, commit, date, scripts, counts))
        print(f"{path.relative_to(ROOT)}: {len(counts)} flags from {len(scripts)} scripts at {commit[:12]}")


if __name__ == "__main__":
    main(sys.argv[1:])
