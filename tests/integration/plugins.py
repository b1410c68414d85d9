"""Plugins loaded by dotted path in the plugin tests (each one leaves a visible trace)."""

from miles_async.config import DataConfig
from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.generate import generate_sample
from miles_async.rollout.rollout import generate_rollout


async def tagged_generate(ctx, sample, sampling_params):
    sample = await generate_sample(ctx, sample, {**sampling_params, "max_new_tokens": 1})
    sample.metadata["generated_by"] = "tagged_generate"
    return sample


async def doubling_rollout(ctx, rollout_id):
    """Two batches per rollout."""
    return await generate_rollout(ctx, rollout_id) + await generate_rollout(ctx, rollout_id)


class CountingSource:
    """Prompts "repeat <k>" made up on the fly; the state is a counter."""

    def __init__(self, cfg: DataConfig, batch_size: int):
        self.batch_size = batch_size
        self.next = 0

    def next_batch(self):
        items = [
            PromptItem(f"c{self.next + i}", f"repeat {(self.next + i) % 10}", str((self.next + i) % 10), {})
            for i in range(self.batch_size)
        ]
        self.next += self.batch_size
        return items

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def label_reward(sample):
    return float(sample.metadata.get("generated_by") == "tagged_generate")
