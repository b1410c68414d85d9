"""Miles' and slime's whole flag lists: ``python -m scripts.upstream_flag_names MIRROR...``.

Each MIRROR is a git directory of radixark/miles or THUDM/slime (e.g. the ``fetch`` tool's ``/work/.mirror/...``).
The names its train scripts' parser takes are read from its HEAD: every ``add_argument("--...")`` in the files of
``SOURCES``, and for Miles each field of ``FSDPArgs`` as ``--field-name`` (its FSDP parser adds one flag per field).
They go to ``miles_async/config/upstream_flags/<name>.txt`` with the commit read, which ``scripts/gen_docs.py``
counts on the compatibility page. Megatron-LM's list (``megatron_lm.txt``) is read by other rules, named in its
header, and is not rewritten here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from scripts.survey_launchers import OUT, UPSTREAMS, git, mirrors

SOURCES = {
    "radixark/miles": (
        "miles/utils/arguments.py",
        "miles/backends/fsdp_utils/arguments.py",
        "miles/backends/megatron_utils/arguments.py",
        "miles/backends/sglang_utils/arguments.py",
        "miles/dashboard/args.py",  # added to the train parser for --use-miles-dashboard
        "miles/rollout/generate_hub/agentic_tool_call.py",  # a generate function's own flags (its add_arguments)
        "miles/rollout/generate_hub/multi_turn.py",
    ),
    "THUDM/slime": (
        "slime/utils/arguments.py",
        "slime/backends/megatron_utils/arguments.py",
        "slime/backends/sglang_utils/arguments.py",
    ),
}
DATACLASS_FLAGS = {"radixark/miles": ("miles/backends/fsdp_utils/arguments.py", "FSDPArgs")}


def added_flags(source: str) -> set[str]:
    """The ``--names`` of every ``add_argument`` call in ``source``."""
    return {
        arg.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--")
    }


def field_flags(source: str, class_name: str) -> set[str]:
    """``--field-name`` for each annotated field of dataclass ``class_name`` (but ``config``, its YAML path)."""
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {
        "--" + stmt.target.id.replace("_", "-")
        for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id != "config"
    }


def flag_names(git_dir: Path, repo: str) -> set[str]:
    names: set[str] = set()
    for path in SOURCES[repo]:
        names |= added_flags(git(git_dir, "show", f"HEAD:{path}"))
    if repo in DATACLASS_FLAGS:
        path, cls = DATACLASS_FLAGS[repo]
        names |= field_flags(git(git_dir, "show", f"HEAD:{path}"), cls)
    return names


def render(repo: str, commit: str, date: str, names: set[str]) -> str:
    what = ", ".join(SOURCES[repo])
    fields = f", plus {DATACLASS_FLAGS[repo][1]}'s fields as --field-name" if repo in DATACLASS_FLAGS else ""
    lines = [
        f"# {repo}'s flag names, read from commit {commit} ({date}) by `python -m scripts.upstream_flag_names`:",
        f"# the add_argument names of {what}{fields}. Names only.",
    ]
    return "\n".join([*lines, *sorted(names)]) + "\n"


def main(argv: list[str] | None = None) -> None:
    for git_dir, repo, date in mirrors(argv, __doc__.splitlines()[0]):
        commit = git(git_dir, "rev-parse", "HEAD").strip()
        names = flag_names(git_dir, repo)
        path = OUT / f"{UPSTREAMS[repo]}.txt"
        path.write_text(render(repo, commit, date, names))
        print(f"{path.relative_to(OUT.parents[2])}: {len(names)} flags at {commit[:12]}")


if __name__ == "__main__":
    main(sys.argv[1:])
