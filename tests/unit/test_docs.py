"""The documentation is checked, not trusted: the generated pages are what the code renders now, every flag has
help, the README's figures are the ones results.json renders to, every flag the docs name exists, every command in
the docs passes ``--check-config`` (a ```bash block holding a ``# fragment`` line is exempt), and the site builds
with ``mkdocs build --strict`` (no broken link or anchor)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from benchmarks import record
from benchmarks.registry import REGISTRY
from miles_async.arguments import FLAGS, build_parser, parse_args
from scripts import gen_docs
from tests.scripts.test_check_config import CONFIGS, CPU, QWEN3, _launcher_env, _write_data
from tests.scripts.test_launchers import _run, _words

ROOT = gen_docs.ROOT
GENERATED = [path for path in gen_docs.pages() if path != gen_docs.README]
WRITTEN = [gen_docs.README, *(p for p in sorted((ROOT / "docs").rglob("*.md")) if p not in GENERATED)]

# Flags of other programs the docs quote: docker, sbatch, pytest, mkdocs, SGLang's and vLLM's servers (the flags the
# launchers pass them), Chromium, and the benchmark and soak scripts' own.
FOREIGN_FLAGS = {
    "docker": {"--gpus", "--ipc", "--rm", "--shm-size", "--security-opt"},
    "sbatch": {"--requeue", "--signal"},
    "pytest": {"--dist", "--durations", "--timeout", "--repeat"},  # --repeat: tests/repeat.py
    "mkdocs": {"--strict"},
    "ray start": {"--head"},
    "SGLang's server": {
        "--api-key",
        "--base-gpu-id",
        "--device",
        "--disable-cuda-graph",
        "--enable-return-routed-experts",
        "--max-running-requests",
        "--max-total-tokens",
        "--sleep-on-idle",
        "--tp-size",
    },
    "vLLM's server": {
        "--enable-scale-out",
        "--enforce-eager",
        "--logprobs-mode",
        "--max-num-seqs",
        "--tensor-parallel-size",
    },
    "the tool sandbox's unshare": {"--fork"},
    "Chromium": {"--no-sandbox"},
    "the launchers": {"--dry-run"},
    "slime's, named as not built": {"--use-routing-replay"},
    "benchmarks.run, benchmarks.soak, benchmarks.train_step": {"--only", "--out", "--runs", "--variants"},
}
FLAG_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(-\*|-<)?")


def test_every_flag_has_help():
    missing = [f.name for f in FLAGS if not str(f.options.get("help", "")).strip()]
    assert not missing, f"flags without help (add help= to their declaration in miles_async/config/): {missing}"


@pytest.mark.parametrize("path", gen_docs.pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_generated_pages_are_what_the_code_renders(path):
    """The flag reference, the compatibility page, the benchmarks page and the README's quickstart figures, each
    rendered again in memory from the declarations and results.json."""
    assert path.read_text() == gen_docs.pages()[path](), (
        f"{path.relative_to(ROOT)} is out of date: run `python -m scripts.gen_docs`"
    )


# A typed figure: a percentage, a time, a size or a ratio (``1.08x``; ``TP 2 x EP 2`` is a layout, not one).
TYPED_FIGURE = re.compile(
    r"(?<![\w.-])\d+(?:[.,]\d+)?(?:\s?(?:%|s\b|ms\b|min\b|minutes?\b|seconds?\b|hours?\b|GB\b|GiB\b|MB\b)|x\b)"
)
# The figures the written pages may type: settings, arithmetic and facts, none of them measured, each with what it
# is. A measured figure is rendered from results.json into a generated page or block instead.
NOT_MEASURED = {
    "docs/concepts/loop.md": {"60 s": "the stop's wait before it prints the stacks"},
    "docs/guides/clusters.md": {"300 s": "--placement-timeout's default"},
    "docs/guides/engines.md": {"2 GiB": "the vLLM CPU KV cache the launcher sets"},
    "docs/guides/fault-tolerance.md": {"0.3 s": "the test double's save delay", "20 ms": "the test's poll interval"},
    "docs/guides/fsdp-lora.md": {"8x": "the count of scores, arithmetic", "24 GB": "a machine's memory"},
    "docs/guides/moe-parallelism.md": {
        "65 GB": "the projection's arithmetic from config.json",
        "22.5 GB": "the projection's arithmetic from config.json",
        "44 GB": "the projection's arithmetic from config.json",
        "0s": "zeros, not seconds",
    },
    "docs/guides/rewards.md": {
        "10 s": "the math-verify deadline",
        "50 ms": "the reward batch's flush delay",
        "60 s": "--rm-timeout's default",
        "1 s": "--rm-retry-backoff's default",
        "30 s": "the backoff's cap",
    },
    "docs/testing.md": {"20 minutes": "the budget", "20 s": "the default cap"},
    "docs/tool-sandbox.md": {"30 s": "--tool-timeout's default"},
}


def _outside_generated(text: str) -> str:
    """``text`` without its generated blocks (``<!-- NAME:start -->`` to ``<!-- NAME:end -->``)."""
    return re.sub(r"<!-- (\w+):start -->.*?<!-- \1:end -->", "", text, flags=re.S)


def test_every_measured_figure_in_the_docs_is_rendered_from_results_json():
    """A percentage, a time, a size or a ratio typed in the README or a written page of docs/ (outside the generated
    pages and blocks, which are checked against results.json above) fails, unless NOT_MEASURED lists it as a
    setting, arithmetic or fact; a listed figure no longer on its page fails too."""
    typed, stale = {}, {}
    for page in WRITTEN:
        name = str(page.relative_to(ROOT))
        found = {" ".join(m.group(0).split()) for m in TYPED_FIGURE.finditer(_outside_generated(page.read_text()))}
        allowed = NOT_MEASURED.get(name, {})
        if found - set(allowed):
            typed[name] = sorted(found - set(allowed))
        if set(allowed) - found:
            stale[name] = sorted(set(allowed) - found)
    assert not typed, f"figures typed outside a generated page or block (render them from results.json): {typed}"
    assert not stale, f"NOT_MEASURED lists figures these pages no longer have: {stale}"


def test_the_readmes_figures_are_the_ones_results_json_renders_to():
    """The README's only measured figures are in its generated block (checked above against results.json)."""
    text = gen_docs.README.read_text()
    block = gen_docs.marked(text, gen_docs.QUICKSTART_START, gen_docs.QUICKSTART_END)
    assert block is not None
    results = record.load()
    if record.entries(results, "trl_peer"):
        q = gen_docs.quickstart_figures(results)
        assert f"{q['final']:.1%}" in block and f"{q['median_step']:.1f} s" in block
    else:  # taken out until it is re-run with the current code: the block says how, and gives no figure
        assert "--only trl_peer" in block and "%" not in block
    words = len(text.replace(block, "").split()) + len(block.split())
    assert words <= 1200, f"README.md has {words} words (at most 1,200)"


def test_benchmarks_taken_out_are_not_shown_and_name_a_command_that_measures_them():
    """A benchmark listed as not re-run (results.json's "removed", shown on the benchmarks page) has no figures left
    in results.json, and its command is one benchmarks.run takes, which drops it from that list when it succeeds."""
    results = record.load()
    for name, removed in results.get("removed", {}).items():
        assert name in REGISTRY and not record.entries(results, name), name
        assert removed["command"] == f"python -m benchmarks.run --only {name}"
        assert removed["rows"] and removed["why"], name


def _names(text: str) -> set[str]:
    return {m.group(0) for m in FLAG_RE.finditer(text)}


def test_every_flag_named_in_the_docs_exists():
    ours = {o for a in build_parser()._actions for o in a.option_strings}
    foreign = set().union(*FOREIGN_FLAGS.values())
    unknown = {}
    for page in WRITTEN:
        for name in _names(page.read_text()):
            if name.endswith(("-*", "-<")):  # a family: --sglang-<flag>, --critic-*
                known = any(o.startswith(name[:-1]) for o in ours) or name[:-2] in ("--sglang", "--vllm")
            else:  # an engine's own flag, passed on to it as --<flag> (config/engine.py)
                known = name in ours or name in foreign or name.startswith(("--sglang-", "--vllm-"))
            if not known:
                unknown.setdefault(name, []).append(str(page.relative_to(ROOT)))
    assert not unknown, f"flags the docs name that train_async.py does not accept: {unknown}"


def _commands() -> list[tuple[str, str]]:
    """(page, command) for each train_async.py or launcher command in a ```bash block of the written pages,
    continuation lines joined; blocks with a `# fragment` line are left out. docker and sbatch lines run the
    launchers, whose exact commands tests/scripts/test_check_config.py checks."""
    found = []
    for page in WRITTEN:
        for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), re.S | re.M):
            if re.search(r"^\s*# fragment", block, re.M):
                continue
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                while words and re.fullmatch(r"\w+=.*", words[0]):
                    words = words[1:]
                if words[:2] == ["python", "train_async.py"] or (
                    words[:1] == ["bash"] and re.fullmatch(r"scripts/(run-.*|quickstart)\.sh", words[1])
                ):
                    found.append((str(page.relative_to(ROOT)), line.strip()))
    return sorted(set(found))


def test_the_docs_have_commands_to_check():
    commands = [c for _, c in _commands()]
    assert any("python train_async.py" in c for c in commands)
    assert any(QWEN3 in c for c in commands) and any("scripts/quickstart.sh" in c for c in commands)


@pytest.mark.parametrize(("page", "command"), _commands())
def test_each_command_in_the_docs_passes_check_config(page, command, tmp_path):
    """The command's train_async.py arguments (a launcher's as its --dry-run prints them), with --check-config,
    through the same parse as ``train_async.py --check-config``: the model flags against the model's published
    config.json (tests/scripts/model_configs) and small real data files at the paths the command names."""
    words = shlex.split(command, comments=True)
    while re.fullmatch(r"\w+=.*", words[0]):
        words = words[1:]
    if words[0] == "python":
        # $MOE_MODEL: the MoE guide's example, Miles' Qwen3-30B-A3B flags against that model's config.json.
        env = {
            "MODEL": str(CONFIGS / "SmolLM2-135M"),
            "MOE_MODEL": str(CONFIGS / "Qwen3-30B-A3B"),
            "DATA": str(tmp_path / "data"),
        }
        argv = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], command.split("train_async.py", 1)[1]))
    else:
        script = QWEN3 if words[1] == QWEN3 else CPU  # quickstart.sh runs the CPU launcher with its model and data
        env = _launcher_env(tmp_path, script, "Qwen3-4B" if script == QWEN3 else "SmolLM2-135M")
        extra = [w for w in words[2:] if w not in ("--dry-run", "--check-config")]
        dry = _run(script, env, ["--dry-run", *extra])
        assert dry.returncode == 0, dry.stderr
        printed = _words(dry.stdout)
        argv = printed[next(i for i, w in enumerate(printed) if w.endswith("train_async.py")) + 1 :]
    _write_data(argv)
    cfg = parse_args([*argv, "--check-config"] if "--check-config" not in argv else argv)
    assert cfg.check_config, f"{page}: {command}"


def test_the_site_builds_strict(tmp_path):
    """mkdocs build --strict: a broken link or anchor, a page missing from the nav or a docstring mkdocstrings
    cannot render fails the build."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "flags" / "index.html").is_file()


def test_the_docs_name_no_path_that_is_gone():
    """Repository paths quoted in the written pages (`scripts/...`, `miles_async/...`, `tests/...`) exist."""
    missing = set()
    for page in WRITTEN:
        for path in re.findall(
            r"`((?:scripts|miles_async|tests|benchmarks|examples|docker)/[\w./-]+)`", page.read_text()
        ):
            if not (ROOT / path.rstrip("/")).exists() and "*" not in path:
                missing.add((str(page.relative_to(ROOT)), path))
    assert not missing, f"paths the docs name that do not exist: {sorted(missing)}"
