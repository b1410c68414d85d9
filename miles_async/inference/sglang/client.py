"""SGLang's client: its native API, as the base client (``inference/client.py``) speaks it, plus its tensor
route (``/update_weights_from_tensor``) for an engine on the trainer's node.

That route takes tensors pickled with torch's multiprocessing reductions, so only handles travel over HTTP
and the engine maps the memory itself; the trainer's side (the shared memory and its lifetime) is
``miles_async.weights.shared_memory``. SGLang wants ``/begin_weight_update`` before and
``/end_weight_update`` after the tensors of an update (its CPU kernels pack weights, which must be unpacked
to load new ones); the weight routes call them.

A VLM prompt: SGLang takes ``input_ids`` with ONE image placeholder token per image and expands each itself, with
its own processor, to the image's patches (``BaseMultimodalProcessor._expand_input_ids``: the other tokens stay as
sent). Our prompts hold each image's placeholders expanded already (the trainer's and the embedded engine's form;
SGLang would decode them to text whose every placeholder its processor takes for another image, and fail), so
``generate`` sends each run of the image token as one. The image token's id is the model's ``image_token_id``
(config.json of the folder ``/model_info`` names). The engine's expansion equals ours where its processor does:
see docs/guides/vision.md for SGLang's own image-size rule of Qwen2-VL.
"""

from __future__ import annotations

from typing import Any

from miles_async.inference.client import EngineClient, EngineError
from miles_async.inference.vlm_requests import image_token_of, vlm_request


class SGLangEngineClient(EngineClient):
    """``EngineClient`` for one SGLang server: the tensor route in SGLang's format."""

    _tp_size: int | None = None
    _image_token_id: int | None = None
    _model_checked = False

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *args: Any, **kwargs: Any):
        image_token = await self.image_token_id()
        if image_token is not None:  # SGLang adds logit_bias before its log-probs
            input_ids, sampling_params = vlm_request(
                input_ids, sampling_params, image_token, bool(kwargs.get("image_data"))
            )
        return await super().generate(input_ids, sampling_params, *args, **kwargs)

    async def image_token_id(self) -> int | None:
        """The served VLM's image placeholder token (``image_token_id`` of its config.json); None for a text model
        (``/model_info``'s ``has_image_understanding``)."""
        if self._model_checked:
            return self._image_token_id
        try:
            info = await self._request("GET", "/model_info")
        except EngineError as e:
            if e.status != 404:
                raise
            info = None  # not SGLang's server (a stand-in that answers /generate only): no VLM to adapt to
        if isinstance(info, dict) and info.get("has_image_understanding"):
            try:
                self._image_token_id = image_token_of(str(info.get("model_path", "")))
            except ValueError as e:
                raise EngineError(self.base_url, "/model_info", str(e)) from e
        self._model_checked = True
        return self._image_token_id

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
