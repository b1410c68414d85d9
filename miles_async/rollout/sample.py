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

    An ABORTED sample keeps the tokens generated so far: that is the whole state a partial
    rollout needs to continue it (``--partial-rollout``), whichever generate function runs.
    """

    uid: str  # the prompt's uid; every sample of a group shares it
    group_index: int  # position of the group inside its rollout
    index: int  # position of the sample inside its group
    prompt: str | list[dict[str, str]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)  # the dataset's; the framework never writes it
    # A VLM prompt's images by reference (paths, data: URIs or base64, from --multimodal-keys), in the order of
    # their placeholders in prompt_tokens: the engine and the trainer each load the pixels from them.
    images: list[str] = field(default_factory=list)
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
    # Set by the rollout driver, read by the rollout metrics.
    partial_resumes: int = 0  # times an aborted generation was continued from its tokens
    offpolicy_masked_tokens: int = 0  # tokens --mask-offpolicy-in-partial-rollout took out of the loss
    # Set by a multi-turn generate function (rollout/multi_turn.py): assistant turns generated so far. With the
    # response tokens and loss mask it is the whole conversation state a resumed partial rollout needs.
    turns: int = 0
    # --use-rollout-routing-replay: the experts the engine's router chose, [len(tokens) - 1, layers, topk] (SGLang's
    # layout, rollout/routing.py): every position but the last, prompt included. None: not recorded.
    routed_experts: Any = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_tokens + self.response_tokens

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    def get_reward_value(self, args: Any = None) -> float:
        """The reward as a number (Miles/slime's accessor, which their dynamic-sampling filters call); the reward
        model already read any --reward-key, so ``args`` is not needed."""
        return float(self.reward)

    def effective_loss_mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * self.response_length

    def remaining_budget(self, max_new_tokens: int) -> int:
        """Response tokens still allowed when ``max_new_tokens`` bounds the whole response."""
        return max(0, max_new_tokens - self.response_length)

    def append_output(self, tokens: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Extend the response with the continuation of an aborted generation."""
        if not len(tokens) == len(logprobs) == len(versions):
            raise ValueError(
                f"sample uid={self.uid}: continuation of {len(tokens)} tokens came with "
                f"{len(logprobs)} log-probs and {len(versions)} weight versions"
            )
        self.response_tokens.extend(tokens)
        self.rollout_logprobs.extend(logprobs)
        self.weight_versions.extend(versions)
        # An explicit mask (e.g. set by a custom generate function) must stay aligned with the
        # response; freshly generated tokens are trained unless masked later.
        if self.loss_mask is not None:
            self.loss_mask.extend([1] * len(tokens))

    def mask_offpolicy_tokens(self) -> int:
        """Set loss mask 0 on tokens from weights older than this sample's newest version.

        Returns how many trained tokens this newly masked. A sample without per-token
        versions carries no evidence of mixing, so it is left alone.
        """
        if not self.weight_versions:
            return 0
        if len(self.weight_versions) != self.response_length:
            raise ValueError(
                f"sample uid={self.uid}: {len(self.weight_versions)} weight versions for "
                f"{self.response_length} response tokens; cannot tell which tokens are off-policy"
            )
        mask = list(self.effective_loss_mask())
        if len(mask) != self.response_length:
            raise ValueError(
                f"sample uid={self.uid}: loss mask of {len(mask)} tokens for {self.response_length} response tokens"
            )
        newest = max(self.weight_versions)
        masked = 0
        for i, version in enumerate(self.weight_versions):
            if version < newest and mask[i]:
                mask[i] = 0
                masked += 1
        self.loss_mask = mask
        return masked
