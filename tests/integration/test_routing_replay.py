"""Rollout routing replay in the torch backend (backends/routing_replay.py) on tiny HF MoE models of every family the
replay knows: the routers' weights for replayed experts are their own computation (replaying a model's own choice
changes nothing), a record different from the model's own choice is what the experts receive (and agreement counts
the difference), the router still gets gradients, and the policy worker maps each sample's record through both of
its layouts (one row per sample, shared prefix) to the same log-probs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles_async.backends.routing_replay import Replayer, ReplayStats, hf_routers
from tests.integration.test_megatron_moe import _tiny_deepseek_v3, _tiny_glm4_moe, _tiny_qwen2_moe
from tests.tolerance import StepBounds, assert_within


def _families(tmp_path):
    from miles_async.assets.tiny_model import make_tiny_model

    return {
        "qwen3_moe": make_tiny_model(tmp_path / "qwen3_moe", seed=2, arch="qwen3_moe"),
        "mixtral": make_tiny_model(tmp_path / "mixtral", seed=1, arch="mixtral"),
        "qwen2_moe": _tiny_qwen2_moe(tmp_path / "qwen2_moe"),
        "glm4_moe": _tiny_glm4_moe(tmp_path / "glm4_moe"),
        "deepseek_v3": _tiny_deepseek_v3(tmp_path / "deepseek_v3"),
    }


def _own_routing(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, [tokens, layers, topk] of each MoE layer's own choice, -1 at dense layers)."""
    config = model.config
    own = torch.full((ids.numel(), config.num_hidden_layers, config.num_experts_per_tok), -1, dtype=torch.long)

    def keep(layer: int):
        def hook(module, args, out) -> None:
            own[:, layer] = out[2]

        return hook

    hooks = [router.register_forward_hook(keep(layer)) for layer, router in hf_routers(model)]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    return logits, own


def _experts_received(model) -> tuple[dict[int, torch.Tensor], list]:
    """What each MoE layer's experts module is called with (its ``top_k_index``), by layer."""
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for layer, router in hf_routers(model):
        block = next(m for m in model.modules() if getattr(m, "gate", None) is router)
        hooks.append(
            block.experts.register_forward_pre_hook(
                lambda m, args, layer=layer: got.__setitem__(layer, args[1].clone())
            )
        )
    return got, hooks


def test_hf_replay_routes_by_the_record_with_the_routers_own_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    for family, path in _families(tmp_path).items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        torch.manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (2, 11))
        logits, own = _own_routing(model, ids)
        moe_layers = [layer for layer, _ in hf_routers(model)]
        assert moe_layers, family

        replayer = Replayer()
        replayer.install_hf(model)
        # Its own choice replayed: the routers' recomputed weights are theirs, so nothing changes.
        stats = ReplayStats()
        replayer.set(own, stats)
        with torch.no_grad():
            replayed = model(input_ids=ids).logits
        torch.testing.assert_close(replayed, logits, rtol=1e-6, atol=1e-6, msg=family)
        assert stats.metrics()["routing_agreement"] == 1.0, family

        # Another choice on the first half of the tokens (each expert moved to the next: still k distinct ones),
        # no record on the rest: the experts receive exactly that, and agreement counts the moved half.
        n_experts = int(own[:, moe_layers[0]].max()) + 1
        forced = own.clone()
        half = ids.numel() // 2
        for layer in moe_layers:
            forced[:half, layer] = (own[:half, layer] + 1) % max(n_experts, model.config.num_experts_per_tok + 1)
        forced[half:] = -1
        got, hooks = _experts_received(model)
        stats = ReplayStats()
        replayer.set(forced, stats)
        with torch.no_grad():
            moved = model(input_ids=ids).logits
        for h in hooks:
            h.remove()
        for layer in moe_layers:
            expected = torch.where(forced[:, layer] >= 0, forced[:, layer], own[:, layer])
            assert torch.equal(got[layer], expected), (family, layer)
        assert (moved - logits).abs().max() > 1e-3, family
        assert 0.0 < stats.metrics()["routing_agreement"] < 1.0, family
        assert stats.replayed_tokens == half * len(moe_layers), family

        # The router learns through the replayed experts' weights.
        model.train()
        replayer.set(forced)
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
        for _, router in hf_routers(model):
            assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0, family
        replayer.clear()


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_policy_worker_replays_each_samples_record_in_its_layout(tmp_path, tiny_task, shared_prefix):
    """The same forced records give the same log-probs whether the worker lays the micro-batch out one row per sample
    or with one copy of each group's prompt, and they differ from the model's own routing: each record reached its
    sample's tokens. Two samples per prompt, responses of unequal length (padding in both layouts)."""
    from miles_async.arguments import parse_args
    from miles_async.assets.tiny_model import make_tiny_model
    from miles_async.backends.fsdp.actor import FSDPTrainActor
    from miles_async.rollout.batch import RolloutBatch

    path = make_tiny_model(tmp_path / "qwen3_moe", seed=2, arch="qwen3_moe")
    train, _ = tiny_task

    def actor(replay: bool, share: bool) -> FSDPTrainActor:
        flags = ["--use-rollout-routing-replay"] if replay else []
        cfg = parse_args(
            ["--hf-checkpoint", str(path), "--prompt-data", str(train), "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rm-type", "first_integer",
             "--use-tis", "--shared-prefix" if share else "--no-shared-prefix",
             "--output-dir", str(tmp_path / "out"), *flags]
        )  # fmt: skip
        assert cfg.train.routing_replay == replay
        return FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=1)

    prompts = [[5, 9, 17, 30], [5, 9, 17, 30], [7, 8, 40], [7, 8, 40]]
    responses = [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41]]
    tokens = [p + r for p, r in zip(prompts, responses)]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    rng = np.random.default_rng(0)
    records = [
        np.stack(
            [rng.permutation(config.num_experts)[: config.num_experts_per_tok] for _ in range((len(t) - 1) * 2)]
        ).reshape(len(t) - 1, config.num_hidden_layers, config.num_experts_per_tok)
        for t in tokens
    ]
    # A group's samples share their prompt, and so its record: the engine ran the same prompt tokens.
    for a, b in ((0, 1), (2, 3)):
        records[b][: len(prompts[b])] = records[a][: len(prompts[a])]
    batch = RolloutBatch(
        tokens=tokens,
        prompt_lengths=[len(p) for p in prompts],
        response_lengths=[len(r) for r in responses],
        loss_masks=[[1] * len(r) for r in responses],
        rollout_logprobs=[[0.0] * len(r) for r in responses],
        weight_versions=[[0] * len(r) for r in responses],
        rewards=[0.0] * 4,
        group_index=[0, 0, 1, 1],
        uids=["a", "a", "b", "b"],
        routed_experts=records,
    )
    idx = [0, 1, 2, 3]
    replayed = actor(True, shared_prefix)
    assert replayed._shares_prefix == shared_prefix
    got = replayed._logprobs_of(replayed.module, batch, idx, 1.0)
    other, plain = actor(True, not shared_prefix), actor(False, shared_prefix)  # the same weights: the checkpoint's
    reference = other._logprobs_of(other.module, batch, idx, 1.0)
    own = plain._logprobs_of(plain.module, batch, idx, 1.0)
    for i in idx:
        torch.testing.assert_close(torch.tensor(got[i]), torch.tensor(reference[i]), rtol=1e-5, atol=1e-5)
    assert max(abs(a - b) for i in idx for a, b in zip(got[i], own[i])) > 1e-3
    assert replayed._routing_stats.metrics()["routing_agreement"] < 1.0

    # A sample without a record is refused, naming it.
    missing = RolloutBatch(**{**batch.__dict__, "routed_experts": [records[0], None, records[2], records[3]]})
    with pytest.raises(ValueError, match="uid=a .*routing record of none"):
        replayed._logprobs_of(replayed.module, missing, idx, 1.0)


def _forced_records(tokens: list[list[int]], num_layers: int, num_experts: int, topk: int, seed: int = 0):
    """A record of ``topk`` distinct random experts for every layer at every position but the last of each sample,
    the same for the prompt of samples that share it."""
    rng = np.random.default_rng(seed)
    by_prefix: dict[tuple, np.ndarray] = {}
    out = []
    for t in tokens:
        rows = []
        for pos in range(len(t) - 1):
            key = tuple(t[: pos + 1])
            if key not in by_prefix:
                by_prefix[key] = np.stack([rng.permutation(num_experts)[:topk] for _ in range(num_layers)])
            rows.append(by_prefix[key])
        out.append(np.stack(rows).astype(np.int32))
    return out


def _megatron_logprobs_worker(rank, world, port, argv: list[str], records: list, out: str) -> None:
    import dataclasses

    from miles_async.arguments import parse_args
    from miles_async.backends.megatron.actor import MegatronTrainActor
    from tests.integration.test_megatron_backend import _batch

    actor = MegatronTrainActor(parse_args(argv).train, rank, world, total_optimizer_steps=10)
    actor.init_process_group("127.0.0.1", port)
    batch = dataclasses.replace(_batch(0), routed_experts=records)
    idx = list(range(len(batch)))
    replayed = actor._logprobs_of(actor.module, batch, idx, 1.0)
    stats = actor._routing_stats.metrics()
    actor._replayer.clear()
    actor._replayer, routing_replay = None, actor._replayer  # the model's own routing, for the contrast
    own = actor._logprobs_of(actor.module, batch, idx, 1.0)
    actor._replayer = routing_replay
    metrics = actor.train(0, batch)
    router_grads = [
        float(p.main_grad.abs().sum()) if getattr(p, "main_grad", None) is not None else 0.0
        for name, p in actor.module.named_parameters()
        if name.endswith("router.weight")
    ]
    if rank == 0:
        torch.save({"replayed": replayed, "own": own, "agreement": stats.get("routing_agreement"),
                    "replayed_tokens": stats.get("routing_replayed_tokens"), "metrics": metrics,
                    "router_grads": router_grads}, out)  # fmt: skip


def test_megatron_replays_the_record_as_the_torch_backend_does(tiny_task, tmp_path):
    """The Megatron backend routes by the same forced records as the torch backend, one rank and at TP 2 (sequence
    parallel: each TP rank's routers see its share of the sequence) x PP 2 (each stage's layers take theirs by
    global layer number): the log-probs equal the torch backend's under the same replay within float32 rounding at
    its noise scale (tests/tolerance.py: 7.5e-5; 4.8e-7 measured at both layouts, 2026-12-07), and differ from
    their own routing's by far more. A training step with replay reports the agreement of its own passes and gives
    the routers gradients."""
    import dataclasses

    from transformers import AutoConfig

    from miles_async.arguments import parse_args
    from miles_async.assets.tiny_model import make_tiny_model
    from miles_async.backends.fsdp.actor import FSDPTrainActor
    from tests.integration.test_megatron_backend import _args, _batch, _spawn

    model = make_tiny_model(tmp_path / "qwen3_moe", seed=2, arch="qwen3_moe")
    config = AutoConfig.from_pretrained(model)
    train, _ = tiny_task
    batch = _batch(0)
    records = _forced_records(batch.tokens, config.num_hidden_layers, config.num_experts, config.num_experts_per_tok)
    # One optimizer step over the whole batch (--global-batch-size 16, no KL): the step's passes are its training
    # forward alone, over the log-prob pass's micro-batches under the same weights.
    base = _args(model, train, tmp_path, "--moe-aux-loss-coeff", "0", "--moe-token-dispatcher-type", "alltoall",
                 "--use-rollout-routing-replay", "--global-batch-size", "16")  # fmt: skip
    torch_actor = FSDPTrainActor(parse_args(base[:-2] + ["--no-shared-prefix"]).train, 0, 1, total_optimizer_steps=10)
    idx = list(range(len(batch)))
    tol = StepBounds.of(model, batch.tokens).logprob
    expected = torch_actor._logprobs_of(
        torch_actor.module, dataclasses.replace(batch, routed_experts=records), idx, 1.0
    )
    layouts = {
        "one": (1, base),
        "tp2_pp2": (4, base + ["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2",
                               "--sequence-parallel", "--pipeline-model-parallel-size", "2"]),
    }  # fmt: skip
    for name, (world, argv) in layouts.items():
        _spawn(_megatron_logprobs_worker, world, argv, records, str(tmp_path / f"{name}.pt"))
        got = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert_within(got["replayed"], expected, tol, f"{name}: log-probs under replay vs the torch backend's")
        gap = max(abs(a - b) for i in idx for a, b in zip(got["replayed"][i], got["own"][i]))
        assert gap > 1e-2, name
        assert 0.0 < got["agreement"] < 0.9, name  # random records: about topk / experts of the choices agree
        # The step's routers saw the log-prob pass's tokens and made its choices: the same counts.
        assert got["metrics"]["train/optimizer_steps"] == 1, name
        assert got["metrics"]["train/routing_replayed_tokens"] == got["replayed_tokens"], name
        assert got["metrics"]["train/routing_agreement"] == got["agreement"], name
        assert got["router_grads"] and all(g > 0 for g in got["router_grads"]), name
