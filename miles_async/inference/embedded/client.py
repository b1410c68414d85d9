"""The embedded engine's client: the protocol's defaults plus what only this engine serves.

Its tensor route posts a raw safetensors blob to ``/update_weights_from_tensor?weight_version=V&flush=0|1``
(SGLang's takes pickled tensors in JSON, see ``sglang/client.py``: a safetensors blob is safe to parse and
cheap to produce). It also serves a per-tensor checksum of its weights (``--check-weight-update-equal``) and
reads them back (``/get_weights``, to seed a restarted engine from a peer under ``--use-fault-tolerance``).

On the trainer's node it maps the update from shared memory instead (``miles_async/weights/staging.py``): the
trainer writes it into /dev/shm files, ``stage_weights_from_shm`` sends their layout (the engine maps and checks
them while it generates) and ``commit_staged_weights`` copies them into the model.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from miles_async.inference.client import EngineClient

if TYPE_CHECKING:  # the driver, the controller and the executor import this module and need no torch
    import torch


def serialize_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """HF-named tensors as one safetensors blob (on the CPU, contiguous, one copy per alias of a shared storage)."""
    from safetensors.torch import save

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named_tensors:
        if name in out:
            raise ValueError(f"duplicate tensor name {name!r}")
        t = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share storage (tied embeddings);
        # a copy per alias keeps the format simple.
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return save(out)


def safetensors_metadata(raw: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (its header: 8-byte little-endian length, then JSON)."""
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]).get("__metadata__") or {}


class EmbeddedEngineClient(EngineClient):
    """``EngineClient`` for one embedded engine server (``embedded/server.py``)."""

    async def weights_checksum(self) -> dict[str, Any]:
        return await self._request("GET", "/weights_checksum")

    async def get_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The weights read between two decode steps, so no update is half applied."""
        from safetensors.torch import load

        raw = await self._request("GET", "/get_weights", raw=True)
        tensors = await asyncio.to_thread(load, raw)
        return tensors, int(safetensors_metadata(raw)["weight_version"])

    async def update_weights_from_tensors(
        self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: int | None = None, flush: bool = False
    ) -> dict[str, Any]:
        data = await asyncio.to_thread(serialize_tensors, named_tensors)
        params = {"flush": "1" if flush else "0"}
        if weight_version is not None:
            params["weight_version"] = str(int(weight_version))
        return await self._request("POST", "/update_weights_from_tensor", data=data, params=params)

    async def stage_weights_from_shm(self, segments: list[dict], weight_version: int) -> dict[str, Any]:
        """Have the engine map and check an update staged in this node's shared memory (applied on commit)."""
        return await self._request(
            "POST", "/stage_weights_from_shm", json_body={"weight_version": int(weight_version), "segments": segments}
        )

    async def commit_staged_weights(self, weight_version: int, flush: bool = True) -> dict[str, Any]:
        return await self._request(
            "POST", "/commit_staged_weights", json_body={"weight_version": int(weight_version), "flush": flush}
        )

    async def discard_staged_weights(self) -> dict[str, Any]:
        return await self._request("POST", "/discard_staged_weights")
