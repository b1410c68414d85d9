"""SGLang's own tensor route (``/update_weights_from_tensor``) for an engine on the trainer's node.

SGLang takes the tensors pickled with torch's multiprocessing reductions, so only handles travel over
HTTP and the engine maps the memory itself: CUDA IPC handles for GPU tensors (the colocated route of
Miles and slime), shared-memory files for CPU tensors. For the CPU the file-system sharing strategy is
used while pickling: torch's default, file descriptors, hands them over through a socket back to this
process that only a child of it may use (an unrelated server is refused: "digest sent was rejected").
Each bucket is copied once into shared memory and kept alive until SGLang has loaded it.

SGLang wants ``/begin_weight_update`` before and ``/end_weight_update`` after the tensors of an update
(its CPU kernels pack weights, which must be unpacked to load new ones); ``push_buckets`` calls them.
Everything else is SGLang's native API, as the base client speaks it.
"""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import torch

from miles_async.inference.client import EngineClient, EngineError


def shared_memory_pickle(named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[str, list[torch.Tensor]]:
    """(base64 of the pickled (name, tensor) list, the shared tensors to keep alive until the engine loaded them)."""
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler

    shared: list[tuple[str, torch.Tensor]] = []
    for name, t in named_tensors:
        t = t.detach()
        if t.device.type == "cpu":
            buf = torch.empty(t.shape, dtype=t.dtype).share_memory_()
            buf.copy_(t)
            t = buf
        shared.append((name, t))
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        out = io.BytesIO()
        ForkingPickler(out, 4).dump(shared)
    finally:
        mp.set_sharing_strategy(before)
    return base64.b64encode(out.getvalue()).decode(), [t for _, t in shared]


class SGLangEngineClient(EngineClient):
    """``EngineClient`` for one SGLang server: the tensor route in SGLang's format."""

    _tp_size: int | None = None

    async def begin_weight_update(self) -> None:
        await self._request("POST", "/begin_weight_update", json_body={})

    async def end_weight_update(self) -> None:
        await self._request("POST", "/end_weight_update", json_body={})

    async def tp_size(self) -> int:
        if self._tp_size is None:
            info = await self._request("GET", "/get_server_info")
            self._tp_size = int(info.get("tp_size", 1))
        return self._tp_size

    async def update_weights_from_tensors(self, named_tensors: list[tuple[str, torch.Tensor]],
                                          weight_version: int | None = None, flush: bool = False) -> dict[str, Any]:
        payload, keep_alive = await asyncio.to_thread(shared_memory_pickle, named_tensors)
        body: dict[str, Any] = {"serialized_named_tensors": [payload] * await self.tp_size(), "flush_cache": flush}
        if weight_version is not None:
            body["weight_version"] = str(int(weight_version))
        out = await self._request("POST", "/update_weights_from_tensor", json_body=body)
        del keep_alive  # loaded: the shared files may go
        if not isinstance(out, dict) or not out.get("success"):
            raise EngineError(self.base_url, "/update_weights_from_tensor", f"not loaded: {out}")
        return out
