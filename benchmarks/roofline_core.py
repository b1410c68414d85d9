"""The roofline's accounting, shared by ``benchmarks/roofline.py`` (the CPU) and ``scripts/gpu/roofline.py`` (one GPU):
the machine's limits (matrix-multiply rate, memory bandwidth), each phase's work counted on the graph it executes
(FLOPs through ``torch.utils.flop_counter``, bytes from the weights and KV cache a decode step reads), its time, and
where that time goes (``torch.profiler``).

A phase's bound is the roofline's: the least time its work can take here, the longer of its FLOPs at the large-shape
matmul peak of the dtype it computes in and its bytes at the triad bandwidth; its fraction is that time over the time
it took (equally: its achieved rate over the binding limit). The drivers at the end run one quickstart-shaped step
through our own code paths: the embedded engine's prefill and decode (``Engine._admit`` / ``Engine._decode_step``),
and the torch backend's old-log-prob and reference forwards, training forward and backward, and optimizer step
(``FSDPTrainActor``).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

# Goals of issue 34: compute-bound phases at this fraction of the matmul peak, decode of the bandwidth bound.
COMPUTE_GOAL, BANDWIDTH_GOAL = 0.40, 0.50
# AdamW's step per fp32 parameter: reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq.
ADAMW_BYTES_PER_PARAM = 7 * 4


def no_sync() -> None:
    return None


def cuda_sync() -> None:
    torch.cuda.synchronize()


# --------------------------------------------------------------------------- the machine's limits
def best_seconds(fn: Callable[[], Any], min_seconds: float, max_reps: int, sync: Callable[[], None] = no_sync) -> float:
    """The fastest of repeated calls of ``fn`` after one warm-up, repeated until ``min_seconds`` have passed
    (at least once, at most ``max_reps`` times): the least disturbed run on a shared machine."""
    fn()
    sync()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 1 or (spent < min_seconds and reps < max_reps):
        t0 = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def matmul_flops(m: int, k: int, n: int) -> int:
    """An ``[m, k] @ [k, n]`` product: one multiply and one add per term."""
    return 2 * m * k * n


def matmul_rate(
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype,
    device: str = "cpu",
    min_seconds: float = 0.3,
    max_reps: int = 20,
    sync: Callable[[], None] = no_sync,
) -> float:
    """FLOP/s of torch's ``[m, k] @ [k, n]`` in ``dtype`` on ``device`` (best run)."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    seconds = best_seconds(lambda: torch.mm(a, b, out=out), min_seconds, max_reps, sync)
    return matmul_flops(m, k, n) / seconds


def triad_bandwidth(
    elements: int, device: str = "cpu", min_seconds: float = 0.3, max_reps: int = 20, sync: Callable[[], None] = no_sync
) -> float:
    """Bytes/s of STREAM's triad ``a = b + s * c`` in float32 through torch: two arrays read, one written, each far
    larger than the caches."""
    b = torch.rand(elements, device=device)
    c = torch.rand(elements, device=device)
    a = torch.empty_like(b)
    seconds = best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), min_seconds, max_reps, sync)
    return 3 * elements * 4 / seconds


def step_shapes(hidden: int, intermediate: int, vocab: int, tokens: dict[str, int]) -> list[tuple[str, int, int, int]]:
    """(label, m, k, n) of the matmuls a step runs: the MLP's up and down projections and the output projection, at
    each phase's token count."""
    return [
        (f"{phase} {what}", m, k, n)
        for phase, m in tokens.items()
        for what, k, n in (
            ("MLP up", hidden, intermediate),
            ("MLP down", intermediate, hidden),
            ("lm_head", hidden, vocab),
        )
    ]


# --------------------------------------------------------------------------- counting the work
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _cpu_flash_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter, which also counts the CPU's fused attention (torch 2.x registers only the GPU kernels:
    without this, attention would count as free on the CPU). Attention counts every score, masked or not: that is
    what the kernel computes."""
    return FlopCounterMode(
        display=False, custom_mapping={_CPU_FLASH: _cpu_flash_flops, _CPU_FLASH_BACKWARD: _cpu_flash_backward_flops}
    )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter once (a tied embedding is the output projection's
    matrix), except an untied input embedding, of which a step reads only its rows' vectors."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embed.weight.data_ptr() != head.weight.data_ptr():
        seen.pop(embed.weight.data_ptr(), None)
    return sum(seen.values())


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of one token's keys and values over every layer."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


# --------------------------------------------------------------------------- phases
@dataclass
class Phase:
    """One phase of a step: its work (FLOPs, and the bytes it must move where they can bind), its time, and the
    profile of where that time went."""

    name: str
    dtype: str  # what it computes in: picks its matmul peak
    flops: float = 0.0  # on the executed graph
    bytes: float = 0.0  # least memory traffic: counted for decode and the optimizer, 0 (not binding) elsewhere
    seconds: float = 0.0
    calls: int = 0
    ops: Counter = field(default_factory=Counter)  # op -> self CPU microseconds, in profiled calls
    tokens: int = 0

    def bound_seconds(self, peaks: dict[str, float], bandwidth: float) -> float:
        """The roofline: the least time its FLOPs and bytes take at this machine's limits."""
        return max(self.flops / peaks[self.dtype], self.bytes / bandwidth)

    def binding(self, peaks: dict[str, float], bandwidth: float) -> str:
        """Which limit the roofline puts it under: "compute" or "memory"."""
        return "memory" if self.bytes / bandwidth > self.flops / peaks[self.dtype] else "compute"

    def fraction(self, peaks: dict[str, float], bandwidth: float) -> float:
        return self.bound_seconds(peaks, bandwidth) / self.seconds

    def top_ops(self, n: int = 5) -> list[tuple[str, float, float]]:
        """(op, self CPU ms, share of the profiled self CPU time) of the ``n`` costliest ops."""
        total = sum(self.ops.values()) or 1.0
        return [(op, us / 1e3, us / total) for op, us in self.ops.most_common(n)]


def goal_of(binding: str) -> float:
    return BANDWIDTH_GOAL if binding == "memory" else COMPUTE_GOAL


@contextlib.contextmanager
def measured(phase: Phase, how: str, sync: Callable[[], None] = no_sync) -> Iterator[None]:
    """One call of ``phase``'s code: timed (``"time"``), its FLOPs counted (``"flops"``) or profiled
    (``"profile"``). One at a time: the counter and the profiler would slow the timed run."""
    if how == "time":
        sync()
        t0 = time.perf_counter()
        yield
        sync()
        phase.seconds += time.perf_counter() - t0
        phase.calls += 1
    elif how == "flops":
        with flop_counter() as counter:
            yield
        phase.flops += counter.get_total_flops()
    elif how == "profile":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        for event in prof.key_averages():
            phase.ops[event.key] += event.self_cpu_time_total
    else:
        raise ValueError(f"unknown measurement {how!r}")


def wrap(
    fn: Callable[..., Any],
    phase: Phase,
    how: str,
    when: Callable[[], bool] = lambda: True,
    before: Callable[[], None] | None = None,
) -> Callable[..., Any]:
    """``fn`` measured on each call for which ``when()`` holds; ``before`` runs first (outside the measurement)."""

    def measured_fn(*args: Any, **kwargs: Any) -> Any:
        if not when():
            return fn(*args, **kwargs)
        if before is not None:
            before()
        with measured(phase, how):
            return fn(*args, **kwargs)

    return measured_fn


# --------------------------------------------------------------------------- our code paths
def engine_phases(engine: Any, prompts: list[list[int]], n_samples: int, new_tokens: int, how: str) -> list[Phase]:
    """Prefill and decode of one step's generation on the embedded engine: every prompt ``n_samples`` times,
    ``new_tokens`` each (stop tokens banned until then, so every run does the same work). The engine is paused while
    the requests go in, so they are admitted as one batch, as a step's requests arriving together are.

    ``_admit`` and ``_decode_step`` are measured on the decode thread that runs them (a FLOP counter counts its own
    thread's ops). A decode step's bytes are the weights plus the KV cache of each row's context."""
    from miles_async.inference.embedded.records import SamplingParams

    dtype = str(engine.dtype).removeprefix("torch.")
    prefill, decode = Phase("prefill", dtype), Phase("decode", dtype)
    weights, per_token = weight_bytes(engine.model), kv_bytes_per_token(engine.model.config, engine.dtype)

    def count_decode_bytes() -> None:
        rows = engine._batch.rows
        decode.tokens += len(rows)
        decode.bytes += weights + per_token * sum(s.context_len for s in rows)

    def count_prefill_tokens() -> None:
        prefill.tokens += sum(s.context_len for s in engine._waiting)

    engine._admit = wrap(engine._admit, prefill, how, lambda: bool(engine._waiting), count_prefill_tokens)
    engine._decode_step = wrap(engine._decode_step, decode, how, before=count_decode_bytes)
    try:
        engine.pause("in_place").result(60)
        params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=1.0)
        futures = [engine.submit(p, params) for p in prompts for _ in range(n_samples)]
        engine.resume().result(60)
        for f in futures:
            f.result(600)
        # The last results resolve inside the last decode step, still measured: wait for it to end, so that its
        # time is whole and no other measurement (a profiler: one per process) starts before it stops.
        engine.run_between_steps(lambda: None).result(60)
    finally:
        del engine._admit, engine._decode_step  # back to the class's methods
    return [prefill, decode]


def actor_phases(actor: Any, batch: Any, rollout_id: int, how: str, sync: Callable[[], None] = no_sync) -> list[Phase]:
    """The torch backend's phases of one training step on ``batch``, through ``FSDPTrainActor``'s own methods:

    - old log-probs: ``_logprobs_of`` the policy (what ``prepare`` runs when a rollout takes several optimizer steps);
    - reference: ``prepare`` itself, whose only forward is the reference model's (one optimizer step, KL penalty 0:
      the old log-probs come from the training pass);
    - training: ``train`` less its optimizer step (forward, loss, backward, gradient clipping);
    - optimizer: the optimizer's ``step`` (AdamW; its bytes: fp32 weights, gradients and both moments).
    """
    dtype = actor.cfg.dtype
    old, ref = Phase("old log-probs", dtype), Phase("reference forward", dtype)
    train, opt = Phase("train fwd+bwd", dtype), Phase("optimizer", "float32")
    tokens = sum(len(t) for t in batch.tokens)
    for p in (old, ref, train, opt):
        p.tokens = tokens
    opt.bytes = ADAMW_BYTES_PER_PARAM * sum(p.numel() for p in actor.module.parameters() if p.requires_grad)

    actor.module.eval()
    with torch.no_grad(), measured(old, how, sync):
        actor._logprobs_of(actor.module, batch, list(range(len(batch))), 1.0)
    with measured(ref, how, sync):
        actor.prepare(rollout_id, batch)
    if how == "profile":  # one profile, its ops split by whether they ran inside the optimizer's step
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            actor.train(rollout_id, batch)
        for event in prof.events():
            (opt if _inside(event, "Optimizer.step") else train).ops[event.name] += event.self_cpu_time_total
        return [old, ref, train, opt]
    # The optimizer's step is timed from inside train(), by its own hooks (its FLOPs are elementwise: uncounted).
    started: list[float] = []

    def pre(*_: Any) -> None:
        sync()
        started.append(time.perf_counter())

    def post(*_: Any) -> None:
        sync()
        opt.seconds += time.perf_counter() - started.pop()
        opt.calls += 1

    hooks = [actor.optimizer.register_step_pre_hook(pre), actor.optimizer.register_step_post_hook(post)]
    try:
        with measured(train, how, sync):
            actor.train(rollout_id, batch)
    finally:
        for h in hooks:
            h.remove()
    train.seconds -= opt.seconds
    return [old, ref, train, opt]


def _inside(event: Any, name: str) -> bool:
    """Whether ``event`` or one of its callers is named ``name``..."""
    while event is not None:
        if event.name.startswith(name):
            return True
        event = event.cpu_parent
    return False


def account(timed: list[list[Phase]], counted: list[Phase], profiled: list[Phase] | None = None) -> list[Phase]:
    """Each phase from its runs: the median time of the timed runs, the work (FLOPs, bytes) of the counted run, the
    profiled run's ops."""
    import statistics

    out = []
    for i, c in enumerate(counted):
        p = Phase(c.name, c.dtype, flops=c.flops, bytes=c.bytes, tokens=c.tokens)
        p.seconds = statistics.median(run[i].seconds for run in timed)
        p.calls = timed[0][i].calls
        if profiled is not None:
            p.ops = profiled[i].ops
        out.append(p)
    return out
