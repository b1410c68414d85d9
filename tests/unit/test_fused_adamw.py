"""--optimizer adam is torch's fused AdamW (issue 34: on the CPU torch's default loops over the tensors, 5x slower on
SmolLM2-135M). Its steps equal the for-loop AdamW's within tests/tolerance.py's Adam bound (same gradients: only
the update's own rounding differs), weight decay and moments included; a step at another learning rate is
rejected."""

from __future__ import annotations

import torch

from miles_async.backends.fsdp.worker import make_optimizer
from miles_async.config.train import OptimizerConfig
from tests.tolerance import adam_tolerance, assert_rejected, assert_within

OPT = OptimizerConfig("adam", 1e-2, 0.0, 0, "constant", 0.1, 0.9, 0.98, 1e-8, 1.0)
HYPER = {"lr": OPT.lr, "betas": (OPT.adam_beta1, OPT.adam_beta2), "eps": OPT.adam_eps}


def _params(start: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(w.clone()) for w in start]


def _step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> dict:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizer.step()
    return {i: p.detach().clone() for i, p in enumerate(params)}


def test_fused_adamw_steps_like_the_for_loop_adamw():
    torch.manual_seed(0)
    start = [torch.randn(33, 17), torch.randn(50)]
    fused, loop, faster = _params(start), _params(start), _params(start)
    optimizer = make_optimizer(fused, OPT)
    assert optimizer.defaults["fused"]
    reference = torch.optim.AdamW(loop, **HYPER, weight_decay=OPT.weight_decay, foreach=False)
    for step in range(1, 4):
        # Gradients over many scales, some near eps, where Adam's update is most sensitive to rounding.
        grads = [torch.randn_like(w) * 10.0 ** torch.randint(-9, 1, w.shape) for w in start]
        moments = [reference.state[p] for p in loop] if step > 1 else None
        state = {i: (m["exp_avg"].clone(), m["exp_avg_sq"].clone()) for i, m in enumerate(moments or [])} or None
        want = _step(reference, loop, grads)
        zero = {i: torch.zeros_like(g) for i, g in enumerate(grads)}
        tol = adam_tolerance(dict(enumerate(grads)), zero, want, HYPER, step, state)
        assert_within(_step(optimizer, fused, grads), want, tol, f"fused AdamW, step {step}")
        if step == 1:
            other = torch.optim.AdamW(faster, **{**HYPER, "lr": OPT.lr * 1.5}, weight_decay=OPT.weight_decay)
            assert_rejected(_step(other, faster, grads), want, tol, "AdamW at 1.5x the learning rate")


def test_a_checkpoint_of_an_unfused_adamw_resumes_fused(tmp_path):
    """A checkpoint written before the optimizer was fused (or on another device) carries its kernel choice in its
    param groups; loading it must keep this machine's fused kernel and take only the state."""
    from miles_async.backends.fsdp import checkpoint

    torch.manual_seed(0)
    written = torch.nn.Linear(4, 3)
    old = torch.optim.AdamW(written.parameters(), **HYPER, foreach=False)
    written(torch.randn(2, 4)).sum().backward()
    old.step()
    checkpoint.save(checkpoint.state_of(written, old), tmp_path, None, background=False)

    resumed = torch.nn.Linear(4, 3)
    optimizer = make_optimizer(resumed.parameters(), OPT)
    checkpoint.load(resumed, optimizer, tmp_path, None)
    group = optimizer.param_groups[0]
    assert group["fused"] is True and not group["foreach"]
    assert group["lr"] == OPT.lr
    for p_old, p_new in zip(written.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(old.state[p_old]["exp_avg_sq"], optimizer.state[p_new]["exp_avg_sq"])
