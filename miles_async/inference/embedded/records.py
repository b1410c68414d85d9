"""What goes into and comes out of the embedded engine: sampling parameters, one request's state, its result, the
errors, and how a waiting caller is answered."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class EngineDeadError(RuntimeError):
    """The decode thread has died; the engine cannot serve any request."""


class RequestRejectedError(ValueError):
    """A request is invalid for this engine (e.g. duplicate rid)."""


class UnknownParameterError(ValueError):
    """A weight update named tensors the model does not have."""

    def __init__(self, names: list[str]):
        self.names = names
        super().__init__(f"unknown parameter names: {names}")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables top-k (SGLang uses -1)
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True


@dataclass
class GenerationResult:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    output_weight_versions: list[int]
    finish_type: str  # "stop" | "length" | "abort"
    finish_matched: int | None
    weight_version: int
    text: str
    e2e_latency: float
    # return_routed_experts: the experts of positions [routed_experts_start_len, prompt + output - 1),
    # [rows, num_hidden_layers, num_experts_per_tok] int32 (inference/routed_experts.py); else None.
    routed_experts: np.ndarray | None = None


@dataclass
class Seq:
    """One request on the decode thread: its prompt, what it generated so far and who waits for it."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    submitted_at: float
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    finished: bool = False
    # A VLM request's images: their references as sent (what a prefill may be shared by) and their pixel inputs
    # (``pixel_values``, ``image_grid_thw``), kept so a flushed or retracted row is prefilled again with them.
    image_refs: tuple[str, ...] = ()
    pixels: dict[str, Any] | None = None
    # Qwen2-VL: the row's last 3-D position + 1 - its length, set at prefill; a decode step's position adds it.
    rope_delta: int = 0
    # Rollout routing replay (return_routed_experts): the experts every layer chose at each context position from
    # routed_start on, as [n, layers, top_k] int32 chunks in position order. A prefill replaces them all (a flushed
    # or retracted row is prefilled again, and its context's routing is then that prefill's), a decode step appends
    # the row of the position it reads. None: not asked for (the request pays nothing).
    routed_start: int = 0
    routed: list[np.ndarray] | None = None

    def record_routing(self, rows: np.ndarray, first_position: int) -> None:
        """Keep ``rows`` (``[n, layers, top_k]``), the routing of context positions ``first_position`` on: a
        prefill's (``first_position`` 0, replacing what was kept) or a decode step's (appended)."""
        if self.routed is None:
            return
        if first_position == 0:
            self.routed = []
        skip = max(0, self.routed_start - first_position)
        if skip < len(rows):
            self.routed.append(rows[skip:].copy())  # a copy: never a view pinning the whole batch's array

    def routed_experts(self) -> np.ndarray | None:
        """The routing of positions ``[routed_start, context_len - 1)``: every position a forward pass read."""
        if self.routed is None:
            return None
        rows = max(0, self.context_len - 1 - self.routed_start)
        if not self.routed:
            return np.zeros((0, 0, 0), dtype=np.int32)  # aborted before its first forward pass
        return np.concatenate(self.routed)[:rows]

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)


def resolve(fut: concurrent.futures.Future | None, value: Any = None, error: BaseException | None = None) -> None:
    """Answer a waiting caller (with ``value``, or ``error``)."""
    # The waiting side may have cancelled (client went away); losing that race is fine.
    if fut is None or fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


def record_routing(seqs: Iterable[Seq], rows: Iterable[int], routing: np.ndarray) -> None:
    """After a forward pass, give each of ``seqs`` that asked for it the routing of the positions the pass ran for it:
    the last of its context's positions in its row ``rows[i]`` of ``routing`` (``[B, S, layers, top_k]``, rows left
    padded). A prefill runs the whole context, so a re-prefilled row's earlier routing is replaced by the
    recomputation its cache comes from (SGLang's too: a prefill rewrites its capture buffer at every position it
    computes); a decode step runs the last position only. Rows shared by identical contexts serve each of them."""
    width = routing.shape[1]
    for seq, row in zip(seqs, rows):
        if seq.routed is not None:
            ran = min(width, seq.context_len)
            seq.record_routing(routing[row, width - ran :], seq.context_len - ran)
