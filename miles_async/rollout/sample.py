"""The unit of rollout data: one prompt, one response, its reward and provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SampleStatus(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # stopped on EOS / a stop token
    TRUNCATED = "truncated"  # hit the response-length budget
    ABORTED = "aborted"  # the engine returned a partial output
    FAILED = "failed"


@dataclass
class Sample:
    """One trajectory. ``tokens`` is prompt + response; only response tokens are trained.

    ``weight_versions`` holds, per response token, the engine weight version that
    produced it, so staleness is measured rather than assumed.
    """

    uid: str  # the prompt's uid; every sample of a group shares it
    group_index: int  # position of the group inside its rollout
    index: int  # position of the sample inside its group
    prompt: str | list[dict[str, str]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: list[int] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)
    response: str = ""
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    loss_mask: list[int] | None = None  # None means every response token is trained
    reward: float | None = None
    status: SampleStatus = SampleStatus.PENDING
    # Wall-clock seconds (time.time()) the generation started / finished; used to show overlap.
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_tokens + self.response_tokens

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    def effective_loss_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * self.response_length
