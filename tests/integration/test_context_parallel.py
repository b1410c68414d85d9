"""Context parallelism's data path, over gloo between 2 real ranks: the Megatron actor's own ``_layout`` (each
sequence cut into 4 chunks, rank 0 holding chunks 0 and 3, rank 1 chunks 1 and 2) and ``_outputs`` (each rank's
tokens' log-probs and entropies, gathered back in sequence order) give, on both ranks, the log-probs, entropies,
loss and gradients that the whole sequences give on one rank.

The model is a stand-in: megatron-core's context-parallel attention is Transformer Engine's, which needs a GPU
(scripts/gpu/check_context_parallel.py runs the real one on 2 GPUs). It is position-wise, logits = (token embedding +
position embedding) @ head, like everything in a transformer but attention, so a token or position id on the wrong
rank or in the wrong order changes its logits. ``self`` is a stand-in for the actor's state too (``_layout`` and
``_outputs`` read its layout and group): the actor itself needs the GPT model to start.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from miles_async.backends.megatron import context_parallel as cp_path
from miles_async.backends.megatron.actor import MegatronTrainActor, megatron_layout
from miles_async.backends.packing import collate
from tests.ports import spawn_ranks

VOCAB, HIDDEN, PAD = 23, 8, 0
# Prompts and responses of different lengths: left padding, response padding and a longest sequence (9 tokens)
# that _layout pads to a multiple of 2 x CP.
PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16]]
RESPONSES = [[17, 18, 19, 20], [21, 2, 3, 4, 5, 6], [7, 8]]


class _PositionWise(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.positions = torch.nn.Parameter(torch.randn(32, HIDDEN, generator=g))
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB + 3, generator=g))  # padded vocabulary

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return (self.tokens[ids] + self.positions[pos]) @ self.head


def _actor_state(cp: int, rank: int, group) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        par=types.SimpleNamespace(cp=cp, sequence_parallel=False),
        tp=1,
        pad_id=PAD,
        cp_rank=rank,
        cp_group=group,
        arch=types.SimpleNamespace(vocab_size=VOCAB),
        _replayer=None,  # no --use-rollout-routing-replay
    )


def _step(cp: int, rank: int, group, control: bool = False) -> dict:
    """Log-probs, entropies, a loss over them and its gradients, through the actor's CP path; ``control``: this
    rank's tokens cut in plain halves (rank 0 the first half) instead of Megatron's chunk pairs."""
    state = _actor_state(cp, rank, group)
    mb = collate(PROMPTS, RESPONSES, [[1] * len(r) for r in RESPONSES], PAD)
    layout = MegatronTrainActor._layout(state, mb)
    if control:
        ids, pos, _ = megatron_layout(mb, PAD, 2 * cp)
        width = layout.ids.shape[1]
        layout = layout._replace(
            ids=ids[:, rank * width : (rank + 1) * width], pos=pos[:, rank * width : (rank + 1) * width]
        )
    model = _PositionWise()
    logits = model(layout.ids, layout.pos)
    logprobs, entropy = MegatronTrainActor._outputs(state, logits, mb, layout, 1.0, True)
    mask = mb.response_mask
    loss = -(logprobs * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if cp > 1:  # Megatron's DDP: the mean over data parallel x CP ranks
            dist.all_reduce(g, group=group)
            g /= cp
        grads[name] = g
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "loss": loss.detach(), "grads": grads,
            "local_len": layout.ids.shape[1]}  # fmt: skip


def _ranks(rank: int, world: int, port: int, out: str, control: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.save(_step(world, rank, dist.group.WORLD, control), f"{out}.{rank}")


@pytest.mark.parametrize("control", [False, True], ids=["megatron_chunks", "misplaced_chunks"])
def test_cp2_gives_the_whole_sequences_log_probs_entropies_loss_and_gradients(tmp_path, control):
    one = _step(1, 0, None)
    assert spawn_ranks(_ranks, 2, str(tmp_path / "cp"), control, timeout=120) == [0, 0]
    ranks = [torch.load(f"{tmp_path / 'cp'}.{r}", weights_only=False) for r in range(2)]
    # 9 tokens padded to 12, 6 on each rank
    assert [r["local_len"] for r in ranks] == [6, 6] and one["local_len"] == 9

    trained = collate(PROMPTS, RESPONSES, [[1] * len(r) for r in RESPONSES], PAD).response_mask.bool()

    def same(a: dict, b: dict) -> bool:
        close = lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-6)  # noqa: E731
        # Response padding is never trained nor reported: its log-probs differ by design (whole sequences score the
        # padding id there, CP the next token).
        return (
            all(close(a[k][trained], b[k][trained]) for k in ("logprobs", "entropy"))
            and all(close(a[k], b[k]) for k in ["loss"])
            and all(close(a["grads"][n], b["grads"][n]) for n in a["grads"])
        )

    if control:
        # Chunks cut in plain halves but gathered as Megatron's pairs: tokens land at the wrong positions.
        assert not any(same(one, r) for r in ranks)
        return
    for r in ranks:
        assert same(one, r)
    assert (one["logprobs"][trained] < 0).all() and one["grads"]["positions"].abs().sum() > 0


def test_each_rank_holds_its_chunk_pair():
    assert cp_path.local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_path.local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_path.local_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    with pytest.raises(ValueError, match="13 tokens does not cut into 4 equal chunks"):
        cp_path.local_positions(13, 2, 0)


def test_the_gpu_check_passes_or_says_what_this_machine_lacks():
    """scripts/gpu/check_context_parallel.py runs the actor at CP 2 against CP 1 where 2 GPUs and Transformer Engine
    are, and must pass there; anywhere else it stops at once naming what is missing, with exit status 2."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[2] / "scripts" / "gpu" / "check_context_parallel.py"
    runs_here = torch.cuda.device_count() >= 2 and importlib.util.find_spec("transformer_engine") is not None
    timeout = 540 if runs_here else 120  # the check itself: CP 1, then CP 2, each in spawned ranks
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout)
    if runs_here:
        assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-2000:] + run.stderr[-3000:]
        return
    assert run.returncode == 2, run.stderr
    assert "needs 2 CUDA GPUs and Transformer Engine (found" in run.stderr
