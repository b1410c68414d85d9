"""The inference engines: their flags, checks and typed config (``EngineConfig``, ``FaultToleranceConfig``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from miles_async.config.capabilities import resolve_weight_update_method
from miles_async.config.declare import (
    Fallback,
    When,
    at_least,
    each,
    flag,
    group,
    importable,
    positive,
    require,
    when_flag,
    when_value,
)
from miles_async.config.engine_kinds import engine_python
from miles_async.config.machine import Machine
from miles_async.config.moe import is_moe
from miles_async.utils.api_key import ApiKey, api_key_from_env, new_api_key
from miles_async.utils.cpus import cpu_list


@dataclass(frozen=True)
class FaultToleranceConfig:
    """--use-fault-tolerance: engines are health-checked, quarantined, restarted and re-seeded with the weights."""

    health_check_interval: float  # seconds between two rounds of health checks
    health_check_timeout: float  # seconds one health check may take
    max_engine_restarts: int  # restarts per engine over the run before it is given up
    failure_threshold: int = 2  # failed checks in a row that quarantine an engine whose process still runs
    restart_backoff_base: float = 1.0
    restart_backoff_cap: float = 60.0


@dataclass(frozen=True)
class EngineConfig:
    backend: str  # "embedded", "sglang" or "vllm"
    model_path: str
    num_engines: int
    dtype: str
    max_running_requests: int
    num_threads: int
    host: str
    startup_timeout: float
    request_timeout: float
    seed: int
    fault_tolerance: FaultToleranceConfig | None = None  # None: a dead engine fails the run
    check_weight_update_equal: bool = False  # compare engine and trainer weight checksums after each update
    router: str = "builtin"  # "builtin" or "sglang" (SGLang's own router, untested here)
    # --rollout-backend sglang / vllm: the python of the engine's environment, --sglang-* / --vllm-* flags
    # passed through to its server (e.g. ("--mem-fraction-static", "0.7")), GPUs per engine (its tensor
    # parallel size), whether the engines get GPUs (else the engine's CPU build), and the folder the disk
    # weight route writes to.
    sglang_python: str | None = None
    sglang_args: tuple[str, ...] = ()
    vllm_python: str | None = None
    vllm_args: tuple[str, ...] = ()
    num_gpus_per_engine: int = 1
    use_gpu: bool = False
    weight_update_dir: str | None = None
    weight_update_method: str = "tensor"  # "tensor", "disk" or "distributed" (--weight-update-method, resolved)
    # The key every engine requires, on loopback too, and every client sends (inference/auth.py): the
    # run's own random one, or $MILES_ASYNC_ENGINE_API_KEY. Masked wherever the config is printed or dumped.
    api_key: ApiKey | None = None
    cpu_affinity: tuple[int, ...] | None = None  # --rollout-cpu-affinity: the cores each engine server is pinned to
    return_routed_experts: bool = False  # --use-rollout-routing-replay: /generate can return each token's experts


PASSTHROUGH_ENGINES = ("sglang", "vllm")


@dataclass(frozen=True)
class Passthrough:
    """The ``--<engine>-<flag> [value]`` arguments no flag here declares: they go to that engine's server."""

    engine: str
    choices: tuple = ()

    @property
    def dest(self) -> str:
        return f"{self.engine}_args"

    def is_set(self, ns: argparse.Namespace) -> bool:
        return bool(getattr(ns, self.dest, ()))

    def shown(self, ns: argparse.Namespace) -> str:
        return " ".join(f"--{self.engine}-{a[2:]}" if a.startswith("--") else a for a in getattr(ns, self.dest, ()))


PASSTHROUGH = {f"--{engine}-*": Passthrough(engine) for engine in PASSTHROUGH_ENGINES}

# The engine servers' flags that take several values (nargs "+") and that Miles' launchers pass. An undeclared
# --<engine>-<flag> takes at most one value; these are declared so that every value is parsed, typed and checked
# here, and they reach the server like the others (``passthrough_args``), under their first name.
LIST_PASSTHROUGH = (
    # The SGLang Miles pins calls the decode batch sizes --cuda-graph-bs (its launchers pass 1 2 4 8 $(seq 16 8
    # 256)); the SGLang installed here (0.5.23) splits it into -decode and -prefill and refuses the old spelling
    # as ambiguous.
    flag(
        "--sglang-cuda-graph-bs-decode",
        "--sglang-cuda-graph-bs",
        type=int,
        nargs="+",
        default=None,
        check=each(positive()),
        metavar="BS",
        help="SGLang's --cuda-graph-bs-decode: the decode batch sizes it captures CUDA graphs for "
        "(--sglang-cuda-graph-bs is Miles' spelling)",
    ),
    flag(
        "--sglang-cuda-graph-bs-prefill",
        type=int,
        nargs="+",
        default=None,
        check=each(positive()),
        metavar="BS",
        help="SGLang's --cuda-graph-bs-prefill: the prefill batch sizes it captures CUDA graphs for",
    ),
)

FAULT_TOLERANCE = when_flag("--use-fault-tolerance")
EMBEDDED = when_value("--rollout-backend", "embedded")
DISK_ROUTE = When("--weight-update-method disk", lambda ns: resolve_weight_update_method(ns) == "disk")

GROUPS = (
    group(
        "cluster",
        flag(
            "--rollout-num-threads",
            type=int,
            default=None,
            check=at_least(1),
            effect_needs=EMBEDDED,
            help="torch threads per embedded engine (default: half the cores; all of them under --synchronous, where "
            "generation and training take turns; the number of --rollout-cpu-affinity cores when that is given)",
        ),
        flag(
            "--rollout-cpu-affinity",
            type=cpu_list,
            default=None,
            metavar="CORES",
            help="pin each engine server (and every process it starts) to these CPU cores (e.g. 1 or 4-7, as "
            "taskset -c); see --train-cpu-affinity",
        ),
    ),
    group(
        "inference engines",
        flag(
            "--rollout-backend",
            default=Fallback("embedded"),
            choices=("embedded", "sglang", "vllm"),
            help="embedded: the project's own CPU engine server; sglang: SGLang's server "
            "(python -m sglang.launch_server, in SGLang's environment: scripts/setup_sglang_env.sh); "
            "vllm: vLLM's server (vllm.entrypoints.openai.api_server, in vLLM's environment: "
            "scripts/setup_vllm_env.sh). Any --sglang-<flag> [value] / --vllm-<flag> [value] not listed "
            "here goes to that server as --<flag> [value], e.g. --sglang-mem-fraction-static 0.7, "
            "--vllm-gpu-memory-utilization 0.7. Not given: the engine whose --sglang-* (or --vllm-*) flags the "
            "command passes, as Miles' launchers do (Miles' engine is SGLang, and it has no --rollout-backend), else "
            "embedded; the choice is logged",
        ),
        flag(
            "--sglang-python",
            default=None,
            effect_needs=when_value("--rollout-backend", "sglang"),
            help="python of SGLang's environment (default: $MILES_ASYNC_SGLANG_PYTHON, else "
            "~/.cache/miles-async/venv-sglang/bin/python if present, else this python)",
        ),
        flag(
            "--vllm-python",
            default=None,
            effect_needs=when_value("--rollout-backend", "vllm"),
            help="python of vLLM's environment (default: $MILES_ASYNC_VLLM_PYTHON, else "
            "~/.cache/miles-async/venv-vllm/bin/python if present, else this python)",
        ),
        flag(
            "--weight-update-dir",
            default=None,
            effect_needs=DISK_ROUTE,
            help="--rollout-backend sglang / vllm: where the trainer writes the weights the engines load "
            "(/update_weights_from_disk); default a folder in /dev/shm when present, else the output dir",
        ),
        flag(
            "--weight-update-method",
            default="auto",
            choices=("auto", "tensor", "disk", "distributed"),
            help="how a weight update reaches the engines. tensor: buckets of tensors over HTTP (the embedded "
            "engine; SGLang on the trainer's node: shared-memory / CUDA IPC handles, "
            "/update_weights_from_tensor); disk: an HF folder the engines load (SGLang, vLLM); distributed: "
            "broadcast from the trainer's rank 0 in a process group with the engines, NCCL on GPUs, gloo on "
            "the CPU (SGLang's update_weights_from_distributed). auto: tensor for embedded, distributed for "
            "sglang, disk for vllm",
        ),
        flag("--rollout-num-gpus", type=int, default=1, check=at_least(1), help="engine slots in all"),
        flag(
            "--rollout-num-gpus-per-engine",
            help="GPUs per engine (its tensor-parallel size); --rollout-num-gpus / this = engines",
            type=int,
            default=1,
            check=at_least(1),
        ),
        flag(
            "--rollout-dtype",
            default=None,
            choices=("bfloat16", "float32"),
            help="the engines' dtype. Default: bfloat16, except the embedded engine on a CPU without bf16 "
            "arithmetic (no AVX512-BF16 or AMX), which serves float32",
        ),
        flag(
            "--sglang-server-concurrency",
            type=int,
            default=64,
            check=at_least(1),
            help="max running requests per engine",
        ),
        flag("--engine-host", help="address the engines on this node listen on", default="127.0.0.1"),
        flag(
            "--engine-startup-timeout",
            help="seconds an engine may take to start before the run fails, naming it and its log",
            type=float,
            default=600.0,
            check=positive(),
        ),
        flag(
            "--engine-request-timeout",
            help="seconds one request to an engine (generation, weight update) may take",
            type=float,
            default=600.0,
            check=positive(),
        ),
        flag(
            "--use-fault-tolerance",
            action="store_true",
            help="health-check the engines; one that dies or stops answering is taken out of the router, "
            "its requests are retried on the others, and it is restarted with the current weights "
            "(copied from a serving engine). Without it a dead engine fails the run",
        ),
        flag(
            "--rollout-health-check-interval",
            type=float,
            default=10.0,
            check=positive(),
            effect_needs=FAULT_TOLERANCE,
            help="seconds between health checks (--use-fault-tolerance)",
        ),
        flag(
            "--rollout-health-check-timeout",
            type=float,
            default=5.0,
            check=positive(),
            effect_needs=FAULT_TOLERANCE,
            help="seconds a health check may take before it counts as failed",
        ),
        flag(
            "--max-engine-restarts",
            type=int,
            default=3,
            check=at_least(0),
            effect_needs=FAULT_TOLERANCE,
            help="restarts per engine over the run before it is given up (the run fails once no engine is left)",
        ),
        flag(
            "--check-weight-update-equal",
            action="store_true",
            help="after every weight update, compare a checksum of each engine's weights with the "
            "trainer's (in the engine dtype) and fail naming the first tensor that differs",
        ),
        flag(
            "--rollout-router",
            default="builtin",
            choices=("builtin", "sglang"),
            check=importable("sglang_router", "the sglang_router package: pip install sglang-router", "sglang"),
            help="builtin: least outstanding requests (with --use-fault-tolerance: retries on engine "
            "failure); sglang: SGLang's own router, needs sglang-router (untested)",
        ),
        *LIST_PASSTHROUGH,
    ),
)


def passthrough_args(ns: argparse.Namespace, engine: str, undeclared: tuple[str, ...]) -> tuple[str, ...]:
    """What goes to ``engine``'s server: the undeclared ``--<engine>-<flag> [value]`` words as ``--<flag> [value]``,
    then each list-valued flag declared here as ``--<flag> V1 V2 ...``."""
    prefix = f"--{engine}-"
    declared: list[str] = []
    for f in LIST_PASSTHROUGH:
        values = getattr(ns, f.dest)
        if f.name.startswith(prefix) and values is not None:
            declared += ["--" + f.name[len(prefix) :], *map(str, values)]
    return (*undeclared, *declared)


def validate(ns: argparse.Namespace) -> None:
    require(
        ns.rollout_num_gpus >= ns.rollout_num_gpus_per_engine,
        "--rollout-num-gpus must be >= --rollout-num-gpus-per-engine",
    )


def check_machine(ns: argparse.Namespace, machine: Machine) -> None:
    """--check-config: whether the engine's interpreter here has the engine (a run finds out when the engine
    starts, naming its log)."""
    name = ns.rollout_backend
    if not machine.check_config or name not in PASSTHROUGH_ENGINES:
        return
    python = engine_python(name, getattr(ns, f"{name}_python"))
    machine.expect(
        machine.python_has(python, name),
        f"--rollout-backend {name}: {python} cannot import {name} on this machine (scripts/setup_{name}"
        f"_env.sh builds its environment; --{name}-python names another interpreter)",
    )


def build(ns: argparse.Namespace, num_threads: int, use_gpu: bool) -> EngineConfig:
    ft = None
    if ns.use_fault_tolerance:
        ft = FaultToleranceConfig(
            ns.rollout_health_check_interval, ns.rollout_health_check_timeout, ns.max_engine_restarts
        )
    return EngineConfig(
        backend=ns.rollout_backend,
        model_path=ns.hf_checkpoint,
        num_engines=ns.rollout_num_gpus // ns.rollout_num_gpus_per_engine,
        dtype=ns.rollout_dtype,
        max_running_requests=ns.sglang_server_concurrency,
        num_threads=ns.rollout_num_threads or len(ns.rollout_cpu_affinity or ()) or num_threads,
        cpu_affinity=ns.rollout_cpu_affinity,
        host=ns.engine_host,
        startup_timeout=ns.engine_startup_timeout,
        request_timeout=ns.engine_request_timeout,
        seed=ns.seed,
        fault_tolerance=ft,
        check_weight_update_equal=ns.check_weight_update_equal,
        router=ns.rollout_router,
        sglang_python=ns.sglang_python,
        sglang_args=tuple(getattr(ns, "sglang_args", ())),
        vllm_python=ns.vllm_python,
        vllm_args=tuple(getattr(ns, "vllm_args", ())),
        num_gpus_per_engine=ns.rollout_num_gpus_per_engine,
        use_gpu=use_gpu,
        weight_update_dir=ns.weight_update_dir,
        weight_update_method=resolve_weight_update_method(ns),
        # Always one: every engine requires it, on loopback too (docs/security.md).
        api_key=api_key_from_env() or new_api_key(),
        return_routed_experts=ns.use_rollout_routing_replay and is_moe(ns),
    )
