"""The SGLang backend's pure parts: flag passthrough, the launch command, the response adapter, the CPU stand-in."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from miles_async.arguments import parse_args
from miles_async.inference.client import normalize_meta
from miles_async.inference.embedded.launcher import EmbeddedEngineProcess
from miles_async.inference.engines import make_engine_process
from miles_async.inference.launcher import ROOT
from miles_async.inference.sglang.launcher import CPU_SHIMS, SGLangEngineProcess
from tests.flag_helpers import minimal_flags


def _args(tmp_path, *extra):
    return [*minimal_flags(tmp_path, n_prompts=1), "--rollout-batch-size", "1", "--num-rollout", "1", *extra]


def test_sglang_flags_pass_through(tmp_path):
    cfg = parse_args(
        _args(
            tmp_path,
            "--rollout-backend",
            "sglang",
            "--sglang-mem-fraction-static",
            "0.7",
            "--sglang-enable-metrics",
            "--sglang-attention-backend=fa3",
            "--sglang-python",
            "/x/python",
            "--rollout-num-gpus",
            "4",
            "--rollout-num-gpus-per-engine",
            "2",
        )
    )
    e = cfg.engine
    assert e.backend == "sglang" and e.sglang_python == "/x/python"
    assert e.sglang_args == ("--mem-fraction-static", "0.7", "--enable-metrics", "--attention-backend", "fa3")
    assert e.num_engines == 2 and e.num_gpus_per_engine == 2
    assert parse_args(_args(tmp_path)).engine.sglang_args == ()


def test_list_valued_sglang_flags_reach_the_server_typed_and_checked(tmp_path):
    """--sglang-cuda-graph-bs (Miles' spelling of SGLang's --cuda-graph-bs-decode) takes all its values (an
    undeclared --sglang-<flag> takes one), each an int and positive, and reaches SGLang's command line after the
    undeclared ones; the embedded engine, named, refuses it."""
    from miles_async.arguments import ConfigError

    sglang = ["--rollout-backend", "sglang", "--sglang-python", "/venv/bin/python"]
    given = ["--sglang-cuda-graph-bs", "1", "2", "16", "--sglang-max-total-tokens", "64"]
    cfg = parse_args(_args(tmp_path, *sglang, *given, "--sglang-cuda-graph-bs-prefill", "4", "8"))
    server = ["--max-total-tokens", "64", "--cuda-graph-bs-decode", "1", "2", "16", "--cuda-graph-bs-prefill", "4", "8"]
    assert cfg.engine.sglang_args == tuple(server)
    assert make_engine_process(cfg.engine, 0, None).command()[-len(server) :] == server
    with pytest.raises(ConfigError, match="^--sglang-cuda-graph-bs-decode must be positive"):
        parse_args(_args(tmp_path, *sglang, "--sglang-cuda-graph-bs", "1", "0"))
    with pytest.raises(SystemExit):
        parse_args(_args(tmp_path, *sglang, "--sglang-cuda-graph-bs", "1", "two"))
    with pytest.raises(ConfigError, match="^--sglang-cuda-graph-bs-decode 1 2 is not supported by the embedded"):
        parse_args(_args(tmp_path, "--rollout-backend", "embedded", "--sglang-cuda-graph-bs", "1", "2"))


def test_unknown_flags_still_fail(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(_args(tmp_path, "--no-such-flag", "1"))


def test_sglang_refuses_what_it_cannot_do_yet(tmp_path):
    from miles_async.arguments import ConfigError

    with pytest.raises(ConfigError, match="fault-tolerance"):
        parse_args(_args(tmp_path, "--rollout-backend", "sglang", "--use-fault-tolerance"))
    with pytest.raises(ConfigError, match="weights_checksum"):
        parse_args(_args(tmp_path, "--rollout-backend", "sglang", "--check-weight-update-equal"))


def test_launch_command(tmp_path):
    from dataclasses import replace

    cfg = parse_args(
        _args(
            tmp_path,
            "--rollout-backend",
            "sglang",
            "--sglang-python",
            "/venv/bin/python",
            "--sglang-max-total-tokens",
            "4096",
            "--rollout-dtype",
            "float32",
        )
    ).engine
    proc = make_engine_process(replace(cfg, use_gpu=False), 1, None)
    assert isinstance(proc, SGLangEngineProcess)
    cmd = proc.command()
    assert cmd[:3] == ["/venv/bin/python", "-m", "miles_async.inference.sglang.serve"]  # sglang.launch_server
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--port"] == str(proc.port) and flags["--dtype"] == "float32" and flags["--weight-version"] == "0"
    assert flags["--device"] == "cpu" and flags["--attention-backend"] == "torch_native"
    assert "--disable-cuda-graph" in cmd
    assert cmd.count("--max-total-tokens") == 1 and flags["--max-total-tokens"] == "4096"  # the user's wins
    env = proc.env()
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and str(CPU_SHIMS) in env["PYTHONPATH"]
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == str(ROOT)  # serve.py runs from the checkout

    gpu = SGLangEngineProcess(replace(cfg, use_gpu=True, num_gpus_per_engine=2), 1, None).command()
    flags = dict(zip(gpu, gpu[1:]))
    assert flags["--base-gpu-id"] == "2" and flags["--tp-size"] == "2" and "--device" not in gpu
    assert type(make_engine_process(replace(cfg, backend="embedded"), 0, None)) is EmbeddedEngineProcess


def test_sglang_meta_is_normalized():
    meta = {
        "weight_version": "3",
        "weight_versions": [{"version": "2", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}],
    }
    normalize_meta(meta, 5)
    assert meta["weight_version"] == 3
    assert meta["output_token_weight_versions"] == [2, 2, 3, 3, 3]
    embedded = {"weight_version": 1, "output_token_weight_versions": [1, 1]}
    normalize_meta(embedded, 2)
    assert embedded == {"weight_version": 1, "output_token_weight_versions": [1, 1]}


def _stand_in():
    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", CPU_SHIMS / "sgl_kernel" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_stand_in_assign_req_to_token_pool():
    k = _stand_in()
    req_to_token = torch.zeros(3, 8, dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 0]),
        torch.tensor([3, 3]),
        torch.tensor([10, 11, 20, 21, 22]),
        8,
    )
    assert req_to_token[2, :4].tolist() == [0, 10, 11, 0]
    assert req_to_token[0, :4].tolist() == [20, 21, 22, 0]
    assert req_to_token[1].sum() == 0


def test_cpu_stand_in_copy_all_layer_kv_cache():
    k = _stand_in()
    layers = [torch.arange(20, dtype=torch.float32).reshape(5, 4).clone() for _ in range(2)]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    # a swap: rows 0 and 1 exchange, which needs every source read before any write
    k.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([0, 1]), torch.tensor([1, 0]))
    for t in layers:
        assert t[0].tolist() == [4, 5, 6, 7] and t[1].tolist() == [0, 1, 2, 3] and t[2].tolist() == [8, 9, 10, 11]
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        k.verify_tree_greedy_cpu()
