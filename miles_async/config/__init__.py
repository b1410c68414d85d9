"""Typed, validated configuration handed to each component, and where each flag is declared.

One module per component declares its flags (names, type, default, help, checks) next to the typed config
they fill: ``cluster``, ``train`` (with the model), ``checkpoint``, ``rollout`` (data, sampling, rewards),
``loop`` (the loop and its asynchrony), ``engine``, ``evaluation``, ``megatron``, ``algorithm``, ``tracking``,
``model`` (Megatron-LM's architecture flags against config.json), ``control`` (the control API and /metrics),
``compat`` (launcher flags accepted without effect), ``report`` (--check-config). ``capabilities`` is the
backend x feature table; ``engine_kinds`` what each engine is to the flags (its weight routes, its interpreter);
``declare`` the way a flag is declared; ``machine`` every check of the local machine. Nothing here imports
``inference/``, which imports this package; the modules this face imports reach their siblings by their own
names, never through the face (that would close a circle).
``miles_async.arguments.parse_args`` builds these once from the command line; components receive only the
piece they need, never the argparse namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_async.config.algorithm import ESTIMATORS, AlgorithmConfig
from miles_async.config.checkpoint import CheckpointConfig
from miles_async.config.cluster import ClusterConfig
from miles_async.config.control import ControlConfig
from miles_async.config.engine import EngineConfig, FaultToleranceConfig
from miles_async.config.evaluation import EvalConfig
from miles_async.config.loop import FullyAsyncConfig, LoopConfig
from miles_async.config.megatron import MegatronConfig
from miles_async.config.rollout import (
    DataConfig,
    DynamicSamplingConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
)
from miles_async.config.tools import SandboxConfig, ToolsConfig
from miles_async.config.tracking import TrackingConfig
from miles_async.config.train import OptimizerConfig, TrainConfig

__all__ = [
    "ESTIMATORS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ControlConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "EngineConfig",
    "EvalConfig",
    "FaultToleranceConfig",
    "FullyAsyncConfig",
    "LoopConfig",
    "MegatronConfig",
    "OptimizerConfig",
    "RewardConfig",
    "RolloutConfig",
    "SamplingConfig",
    "SandboxConfig",
    "ToolsConfig",
    "TrackingConfig",
    "TrainConfig",
]


@dataclass(frozen=True)
class Config:
    cluster: ClusterConfig
    engine: EngineConfig
    rollout: RolloutConfig
    eval: EvalConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    tracking: TrackingConfig
    loop: LoopConfig
    critic: TrainConfig | None = None
    control: ControlConfig | None = None  # --api-server-*: the control API and /metrics (None: not served)
    tools: ToolsConfig | None = None  # --tools-path: multi-turn generation with tools (None: single turn)
    check_config: bool = False  # --check-config: print the configuration and the worker plan instead of running
    warnings: tuple[str, ...] = ()  # flags given without effect; what this machine lacks under --check-config
