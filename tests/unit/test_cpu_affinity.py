"""--train-cpu-affinity and --rollout-cpu-affinity: Linux's CPU-list syntax, refused by name when malformed, the
thread count following the cores given, and the pinning itself on this machine's cores. A whole run pinned is
tests/e2e/test_train_async.py::test_the_trainer_and_the_engine_ran_on_the_cores_they_were_given."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from miles_async.arguments import parse_args
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.inference.launcher import EngineStartError
from miles_async.utils.cpus import cpu_list
from tests.scripts.helpers import ROOT


@pytest.mark.parametrize(
    ("text", "cores"), [("0", (0,)), ("1,0", (0, 1)), ("0-3,8", (0, 1, 2, 3, 8)), (" 2 - 3 ", (2, 3))]
)
def test_cpu_lists_parse_as_taskset_reads_them(text, cores):
    assert cpu_list(text) == cores


@pytest.mark.parametrize("flag", ["--train-cpu-affinity", "--rollout-cpu-affinity"])
@pytest.mark.parametrize("bad", ["x", "3-1", "-1", "0,,1", ""])
def test_a_malformed_core_list_is_refused_naming_the_flag(flag, bad, tiny_model, tiny_task, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", str(tiny_model), "--prompt-data", str(tiny_task[0]), "--num-rollout", "1",
                    "--rm-type", "first_integer", flag, bad])  # fmt: skip
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "is not a list of CPU cores" in err, err


def test_each_side_gets_a_thread_per_core_it_is_given(tiny_model, tiny_task, tmp_path):
    from tests.e2e.runner import tiny_args

    base = [*tiny_args(tiny_model, tiny_task, tmp_path), "--num-rollout", "1"]
    cfg = parse_args([*base, "--train-cpu-affinity", "0-2", "--rollout-cpu-affinity", "3"])
    assert (cfg.train.cpu_affinity, cfg.train.num_threads) == ((0, 1, 2), 3)
    assert (cfg.engine.cpu_affinity, cfg.engine.num_threads) == ((3,), 1)
    explicit = parse_args([*base, "--train-cpu-affinity", "0-2", "--train-num-threads", "2"])
    assert explicit.train.num_threads == 2 and explicit.engine.cpu_affinity is None


def test_pinning_names_the_flag_and_the_cores_this_node_has():
    """In a child process, so this one keeps its cores."""
    here = sorted(os.sched_getaffinity(0))
    probe = (
        "import os, sys\n"
        "from miles_async.utils.cpus import pin\n"
        "pin((int(sys.argv[1]),), '--train-cpu-affinity'); print(sorted(os.sched_getaffinity(0)))\n"
        "try:\n"
        "    pin((4096,), '--train-cpu-affinity')\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(here[-1])], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    pinned, refused = proc.stdout.strip().splitlines()
    assert pinned == f"[{here[-1]}]"
    assert refused == f"--train-cpu-affinity: core(s) [4096] are not available on this node (it has [{here[-1]}])"


def test_an_engine_on_cores_this_node_lacks_is_refused_before_it_starts(tiny_model, tiny_task, tmp_path):
    from tests.e2e.runner import tiny_args

    here = sorted(os.sched_getaffinity(0))
    cfg = parse_args(
        [*tiny_args(tiny_model, tiny_task, tmp_path), "--num-rollout", "1", "--rollout-cpu-affinity", "4096"]
    )
    engine = EmbeddedEngineProcess(cfg.engine, 0, str(tmp_path))
    with pytest.raises(EngineStartError) as refused:
        engine.start()
    assert (
        str(refused.value) == f"--rollout-cpu-affinity: core(s) [4096] are not available on this node (it has {here})"
    )
    assert engine.proc is None and engine.pids == []
