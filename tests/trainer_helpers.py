"""A torch-backend actor trained a few steps on engine outputs, and its log-probs beside an engine's: the checks
that a weight update reached an engine (tests/integration/test_weight_update.py, tests/engines)."""

from __future__ import annotations

from tests.tolerance import StepBounds, assert_rejected, assert_within


def actor_trained_on(cfg, prompts: list[list[int]], outputs: list[dict], steps: int = 3):
    """An FSDPTrainActor after ``steps`` updates that reward a truncated copy of each greedy output over the output
    itself, so its greedy outputs move away from ``outputs``."""
    from miles_async.backends.fsdp.actor import FSDPTrainActor
    from miles_async.rollout.batch import to_train_batch
    from miles_async.rollout.sample import Sample

    def sample(g: int, p: list[int], out: dict, i: int, n: int) -> Sample:
        logprobs = [x[0] for x in out["meta_info"]["output_token_logprobs"]]  # --use-tis weighs against them
        return Sample(
            uid=str(g),
            group_index=g,
            index=i,
            prompt="",
            prompt_tokens=p,
            response_tokens=out["output_ids"][:n],
            rollout_logprobs=logprobs[:n],
            reward=0.0 if i == 0 else 1.0,
        )

    actor = FSDPTrainActor(cfg.train, rank=0, world_size=1, total_optimizer_steps=10)
    batch = to_train_batch(
        [
            [sample(g, p, out, i, n) for i, n in enumerate([len(out["output_ids"]), 1])]
            for g, (p, out) in enumerate(zip(prompts, outputs))
        ]
    )
    for step in range(steps):
        actor.train(step, batch)
    return actor


def assert_engine_logprobs_match(actor, prompts: list[list[int]], outputs: list[dict]) -> None:
    """The engine's log-probs of its own outputs equal the trainer's for the same tokens (temperature 1), within
    float32 rounding: the engine decodes token by token with a KV cache, the trainer runs whole sequences
    (tests/tolerance.py). Negative control: the log-probs an engine that missed the update would give (the
    weights before training) must not pass. (A shift by one token is no control here: the trained model repeats
    one token at an almost constant log-prob.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from miles_async.rollout.batch import to_train_batch
    from miles_async.rollout.sample import Sample

    untrained = AutoModelForCausalLM.from_pretrained(actor.cfg.model_path, dtype=torch.float32).eval()
    engine, trainer, stale = {}, {}, {}
    for n, (p, o) in enumerate(zip(prompts, outputs)):
        batch = to_train_batch(
            [
                [
                    Sample(
                        uid="0",
                        group_index=0,
                        index=0,
                        prompt="",
                        prompt_tokens=p,
                        response_tokens=o["output_ids"],
                        reward=0.0,
                    )
                ]
            ]
        )
        trainer[n] = actor._logprobs_of(actor.module, batch, [0], 1.0)[0]
        engine[n] = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        with torch.no_grad():
            logits = untrained(torch.tensor([p + o["output_ids"]])).logits[0, len(p) - 1 : -1]
        stale[n] = logits.log_softmax(-1).gather(-1, torch.tensor(o["output_ids"])[:, None])[:, 0].tolist()
    rows = [p + o["output_ids"] for p, o in zip(prompts, outputs)]
    tol = StepBounds.of(actor.cfg.model_path, rows).logprob
    assert_within(engine, trainer, tol, "the engine's log-probs vs the trainer's")
    assert_rejected(stale, trainer, tol, "log-probs under the weights before training")
