"""The routing record of a sample (``--use-rollout-routing-replay``): which experts the engine's router chose for each
of its tokens, kept on ``Sample.routed_experts`` for the trainer to replay (backends/routing_replay.py).

One rule serves fresh generations, resumed partial rollouts and multi-turn tool segments alike: every request asks
the engine for the positions not recorded yet (SGLang's ``routed_experts_start_len``), and what comes back is
appended. After each engine call the record covers every token but the last (``len(tokens) - 1`` positions): tool
tokens appended after a turn are recorded by the next request, which runs them through the model as its prompt.
A sample generated again from scratch (an abort without --partial-rollout) starts a new record; an aborted request
may leave it short (the engine never ran the rest), and the request that resumes the sample records the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from miles_async.rollout.sample import Sample, SampleStatus


@dataclass(frozen=True)
class RoutingShape:
    """What each recorded position holds: every decoder layer's top-k experts (SGLang's layout)."""

    num_layers: int
    topk: int

    @classmethod
    def of_model(cls, model_path: str) -> RoutingShape:
        """From the model's config.json (a VLM's language model's)."""
        config = json.loads((Path(model_path) / "config.json").read_text())
        text = config.get("text_config") or config
        return cls(int(text["num_hidden_layers"]), int(text["num_experts_per_tok"]))


def recorded(sample: Sample) -> int:
    """Positions of ``sample`` recorded so far."""
    return 0 if sample.routed_experts is None else len(sample.routed_experts)


def request_fields(sample: Sample) -> dict[str, Any]:
    """The /generate fields that ask for the positions not recorded yet."""
    return {"return_routed_experts": True, "routed_experts_start_len": recorded(sample)}


def record(sample: Sample, out: dict, shape: RoutingShape) -> None:
    """Append the engine's answer to ``request_fields`` to the sample's record; an answer without one, or one that
    does not end the record at the sample's last token, is an error naming the sample."""
    from miles_async.inference.routed_experts import decode

    encoded = out.get("meta_info", {}).get("routed_experts")
    if encoded is None:
        raise RuntimeError(
            f"--use-rollout-routing-replay: the engine returned no routed_experts for sample uid={sample.uid} "
            f"(SGLang records them only when started with --enable-return-routed-experts)"
        )
    rows = decode(encoded, shape.num_layers, shape.topk)
    sample.routed_experts = rows if sample.routed_experts is None else np.concatenate([sample.routed_experts, rows])
    expected = len(sample.tokens) - 1
    # An aborted request may have stopped before the model ran every position (an engine aborts a request still
    # waiting for its prefill with none): its record covers a prefix, and the request that resumes it asks for the
    # rest.
    short = sample.status == SampleStatus.ABORTED and len(sample.routed_experts) < expected
    if len(sample.routed_experts) != expected and not short:
        raise RuntimeError(
            f"--use-rollout-routing-replay: sample uid={sample.uid} has a routing record of "
            f"{len(sample.routed_experts)} positions after the engine's answer, for {expected} (its tokens but the "
            f"last)"
        )
