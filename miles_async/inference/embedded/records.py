"""What goes into and comes out of the embedded engine: sampling parameters, one request's state, its result, the
errors, and how a waiting caller is answered."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any


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
