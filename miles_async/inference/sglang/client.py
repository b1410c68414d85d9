"""SGLang's client: its native API, as the base client (``inference/client.py``) speaks it, plus its tensor
route (``/update_weights_from_tensor``) for an engine on the trainer's node.

That route takes tensors pickled with torch's multiprocessing reductions, so only handles travel over HTTP
and the engine maps the memory itself; the trainer's side (the shared memory and its lifetime) is
``miles_async.weights.shared_memory``. SGLang wants ``/begin_weight_update`` before and
``/end_weight_update`` after the tensors of an update (its CPU kernels pack weights, which must be unpacked
to load new ones); the weight routes call them.
"""

from __future__ import annotations

from typing import Any

from miles_async.inference.client import EngineClient, EngineError


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

    async def update_weights_from_serialized(
        self, payloads: list[str], weight_version: int | None = None, flush: bool = False
    ) -> dict[str, Any]:
        """One bucket as the base64 of its pickled (name, tensor) handles, one pickle per TP rank (``tp_size``)."""
        body: dict[str, Any] = {"serialized_named_tensors": payloads, "flush_cache": flush}
        if weight_version is not None:
            body["weight_version"] = str(int(weight_version))
        out = await self._request("POST", "/update_weights_from_tensor", json_body=body)
        if not isinstance(out, dict) or not out.get("success"):
            raise EngineError(self.base_url, "/update_weights_from_tensor", f"not loaded: {out}")
        return out
