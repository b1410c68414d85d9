"""cpu_compat (Megatron on a machine without CUDA) replaces only registered targets (utils/upstream_patches.py),
checks them all before replacing any, and puts every original back: run in this process, so uninstall() must leave
nothing behind."""

from __future__ import annotations

import pytest
import torch

from miles_async.utils import upstream_patches
from miles_async.utils.upstream_patches import PATCHES, PatchTargetMissing


def _cpu_compat(monkeypatch):
    from miles_async.backends.megatron import cpu_compat

    monkeypatch.setattr(cpu_compat, "needed", lambda: True)  # on a GPU machine too: installed, then undone
    return cpu_compat


def test_cpu_compat_replaces_only_registered_targets_and_uninstall_puts_every_original_back(monkeypatch):
    from torch.overrides import _get_current_function_mode_stack as modes

    cpu_compat = _cpu_compat(monkeypatch)
    registered = {p.target for p in PATCHES if p.by.endswith("megatron/cpu_compat.py")}
    assert set(cpu_compat.REPLACED.targets) | {cpu_compat._MODE} == registered
    owners = {t: upstream_patches._owner(t) for t in cpu_compat.REPLACED.targets}
    before = {t: getattr(owner, name) for t, (owner, name) in owners.items()}
    depth = len(modes())
    with cpu_compat.installed():
        assert all(getattr(owner, name) is not before[t] for t, (owner, name) in owners.items())
        assert torch.zeros(1, device="cuda").device.type == "cpu" and torch.cuda.current_device() == 0
        assert len(modes()) == depth + 1
    assert {t: getattr(owner, name) for t, (owner, name) in owners.items()} == before
    assert len(modes()) == depth and not cpu_compat.REPLACED.active


def test_cpu_compat_refuses_a_missing_target_by_name_and_replaces_nothing(monkeypatch):
    """A megatron-core without the function the patch replaces (as an upgrade that renamed it would be): the
    attribute is deleted for the test."""
    from megatron.core.tensor_parallel import mappings

    cpu_compat = _cpu_compat(monkeypatch)
    current_device = torch.cuda.current_device
    monkeypatch.delattr(mappings, "_reduce_scatter_along_first_dim")
    with pytest.raises(PatchTargetMissing, match=r"mappings\._reduce_scatter_along_first_dim, patched by .*cpu_compat"):
        cpu_compat.apply()
    assert torch.cuda.current_device is current_device and not cpu_compat.REPLACED.active
