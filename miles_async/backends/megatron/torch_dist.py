"""Megatron-LM torch_dist checkpoints (what Miles' and slime's ``convert_hf_to_torch_dist.py`` write and their
launchers pass as ``--ref-load``) read into the model this backend builds, in whatever parallel layout it runs:
megatron-core's dist_checkpointing reads each rank's shards of the keys ``GPTModel.sharded_state_dict`` names,
which are Megatron-LM's (the local spec maps its layer-norm names onto Transformer Engine's, as Megatron-LM's
own checkpoints spell them).

Only the model's tensors are read. The common state (``common.pt``: Megatron-LM's ``args``, the iteration) is
not: it is a pickle of the writer's argument namespace, which may name classes of packages not installed here,
and nothing in it decides the weights.
"""

from __future__ import annotations

import os

import torch

from miles_async.utils.checkpoint import CheckpointError
from miles_async.utils.megatron_layout import torch_dist_folder


def load_weights(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """``model``'s parameters from the torch_dist checkpoint ``path`` (its tracker names the folder). A tensor the
    model needs that the checkpoint lacks fails naming it, before anything is read."""
    # megatron-core is imported where it is used, as in the rest of this backend (cpu_compat patches it first).
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class WithoutCommonState(TorchCommonLoadStrategy):
        """The common state is skipped (see the module's docstring); sharded objects still load."""

        def load_common(self, checkpoint_dir):
            return {}

    folder = torch_dist_folder(path)
    sharded = model.sharded_state_dict()
    wanted = {v.key for v in nested_values(sharded) if isinstance(v, ShardedTensor | ShardedTensorFactory)}
    held = set(dist_checkpointing.load_tensors_metadata(str(folder)))
    missing = sorted(wanted - held)
    if missing:
        extra = sorted(held - wanted)
        raise CheckpointError(
            f"{path}: the torch_dist checkpoint {folder} has no tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + (f"; it holds {', '.join(map(repr, extra[:3]))}, which the model does not name" if extra else "")
            + ": it was written for another model or layer spec than --hf-checkpoint's config.json describes"
        )
    state = dist_checkpointing.load({"model": sharded}, str(folder), common_strategy=WithoutCommonState())
    model.load_state_dict(state["model"])
