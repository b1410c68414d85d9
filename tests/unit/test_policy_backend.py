"""``PolicyMixin`` names what a backend's worker lacks when the worker is built, not mid-training."""

from __future__ import annotations

import pytest

from miles_async.arguments import parse_args
from miles_async.backends.policy import PolicyMixin
from tests.flag_helpers import minimal_flags


class _HalfABackend(PolicyMixin):
    """A new backend's worker that forgot its optimizer step and its weight source."""

    dp = module = model = ref_model = None
    optimizer_steps = 0

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self._init_policy_state()

    def _logprobs_of(self, model, batch, idx, temperature):
        raise NotImplementedError

    def _current_lr(self):
        return 0.0


class _NoKeptWeights(_HalfABackend):
    """Every hook but --keep-old-actor's (as the Megatron backend)."""

    def _train_step(self, batch, idx, temperature, loss_of, metrics_acc):
        raise NotImplementedError

    def _weight_source(self):
        raise NotImplementedError


def test_a_worker_without_the_hooks_policy_mixin_calls_fails_when_built(tmp_path):
    flags = [*minimal_flags(tmp_path), "--num-rollout", "1"]
    cfg = parse_args(flags).train
    with pytest.raises(
        TypeError, match=r"_HalfABackend mixes in PolicyMixin but lacks \['_train_step', '_weight_source'\]"
    ):
        _HalfABackend(cfg)
    assert _NoKeptWeights(cfg).cfg is cfg
    keep_old = parse_args([*flags, "--keep-old-actor"]).train
    with pytest.raises(TypeError, match=r"lacks \['_model_with_weights', '_snapshot_weights'\] .*KeepsOldWeights"):
        _NoKeptWeights(keep_old)
