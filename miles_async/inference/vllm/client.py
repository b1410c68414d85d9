"""vLLM's server behind the SGLang-shaped ``EngineClient``: the same calls, vLLM's endpoints.

vLLM (0.32; ``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1`` and
``--enable-scale-out``, see ``vllm/launcher.py``) has what an RL loop needs under other names:

- ``/inference/v1/generate``: token ids in, token ids, text and the sampled tokens' log-probs out,
  with per-token weight-version spans (``weight_versions``), like SGLang's. A VLM prompt's images go as ``data:``
  URIs in its ``content_parts``, one placeholder token per image, which vLLM expands with its own processor
  (``inference/vlm_requests.py``); the served model's ``image_token_id`` is read from the folder ``/v1/models``
  names.
- ``/pause?mode=keep|abort`` and ``/resume``: SGLang's ``in_place`` (requests freeze and continue
  after the update) is vLLM's ``keep``; ``retract`` has no vLLM counterpart and maps to ``keep``.
- ``/abort_requests``: vLLM prefixes the ids we give with ``generate-tokens-``; aborting by the
  bare id silently matches nothing.
- Weights from disk: ``/collective_rpc`` ``reload_hf_weights(weights_path=...)`` on every worker (vLLM's
  ``reload_weights`` plus a repair for tied embeddings: ``vllm/worker.py``), then
  ``/reset_prefix_cache`` (the cached prefixes belong to the old weights) and
  ``/update_weight_version``.

Everything is mapped back to SGLang's response shape here, so nothing else knows which engine
answered. Not available: routed experts (rollout routing replay: vLLM 0.32 captures them only in its Model Runner
V2, which needs Triton, absent from its CPU build; ``config/capabilities.py`` refuses the flag), and (the
protocol's defaults refuse them) pushing tensors over HTTP, ``/get_weights``
and our per-tensor checksum (vLLM's ``/weight_checker`` hashes its own fused, and on the CPU repacked,
parameters, which a trainer's HF-named tensors cannot be compared with).
"""

from __future__ import annotations

from typing import Any

from miles_async.inference.client import EngineClient, EngineError, as_version, check_finish_reason, normalize_meta
from miles_async.inference.vlm_requests import image_token_of, vlm_request
from miles_async.vision.images import ImageError, as_data_uri

REQUEST_ID_PREFIX = "generate-tokens-"
PAUSE_MODES = {"in_place": "keep", "retract": "keep", "abort": "abort"}
# SGLang sampling-param names -> vLLM's; a name in neither map is refused rather than silently dropped.
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
SAME = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "skip_special_tokens",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "n",
    "logit_bias",
}


def vllm_sampling_params(params: dict[str, Any], return_logprob: bool) -> dict[str, Any]:
    """SGLang's sampling params as vLLM's (``logprobs: 0``: the sampled token's log-prob only)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key in RENAMED:
            out[RENAMED[key]] = value
        elif key in SAME:
            out[key] = value
        elif key == "no_stop_trim":
            continue  # vLLM keeps the stop token in token_ids anyway
        else:
            raise ValueError(f"sampling param {key!r} has no vLLM counterpart (--rollout-backend vllm)")
    if int(out.get("n", 1)) != 1:
        raise ValueError("--rollout-backend vllm: one sample per request (n=1); groups are separate requests")
    if return_logprob:
        out["logprobs"] = 0
    return out


def sglang_shaped(answer: dict[str, Any]) -> dict[str, Any]:
    """A vLLM /inference/v1/generate answer in SGLang's /generate shape (text, output_ids, meta_info)."""
    choice = answer["choices"][0]
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    spans = choice.get("weight_versions") or []
    meta: dict[str, Any] = {
        "id": answer.get("request_id"),
        "finish_reason": {"type": choice.get("finish_reason") or "abort"},
        "prompt_tokens": (answer.get("usage") or {}).get("prompt_tokens"),
        "completion_tokens": len(ids),
        "output_token_logprobs": [[float(c["logprob"]), tid, None] for c, tid in zip(content, ids)],
        "weight_versions": spans,
    }
    if spans:
        meta["weight_version"] = spans[-1]["version"]
    normalize_meta(meta, len(ids))
    return {"text": choice.get("text") or "", "output_ids": ids, "meta_info": meta}


class VLLMEngineClient(EngineClient):
    """``EngineClient`` for one vLLM server."""

    _image_token_id: int | None = None
    _no_image_token = "no served model checked"
    _model_checked = False

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
        timeout: float | None = None,
        image_data: list[str] | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int = 0,
    ) -> dict[str, Any]:
        if return_routed_experts:
            # vLLM 0.32 captures them only in its Model Runner V2, which needs Triton: not in its CPU build
            # (config/capabilities.py refuses --use-rollout-routing-replay with vLLM).
            raise EngineError(
                self.base_url,
                "/inference/v1/generate",
                "routed experts (rollout routing replay) are not wired to vLLM; use --rollout-backend sglang or "
                "embedded",
            )
        image_token = await self.image_token_id()
        if image_token is not None:
            input_ids, sampling_params = vlm_request(input_ids, sampling_params, image_token, bool(image_data))
        elif image_data:
            raise EngineError(
                self.base_url,
                "/inference/v1/generate",
                f"an image prompt for a model without one: {self._no_image_token}",
            )
        body: dict[str, Any] = {
            "token_ids": list(input_ids),
            "sampling_params": vllm_sampling_params(sampling_params, return_logprob),
            "output_mode": "text",
            "return_token_ids": True,
        }
        if image_data:
            # vLLM's processor takes each image as a URL; a data: URI carries it without a path the server reads.
            try:
                urls = [as_data_uri(ref) for ref in image_data]
            except ImageError as e:
                raise EngineError(self.base_url, "/inference/v1/generate", str(e)) from e
            body["content_parts"] = [{"type": "image_url", "url": url} for url in urls]
        if rid is not None:
            body["request_id"] = rid
        answer = await self._request("POST", "/inference/v1/generate", json_body=body, timeout=timeout)
        if not isinstance(answer, dict) or not answer.get("choices"):
            raise EngineError(self.base_url, "/inference/v1/generate", f"unexpected answer: {str(answer)[:500]}")
        return check_finish_reason(sglang_shaped(answer), self.base_url)

    async def image_token_id(self) -> int | None:
        """The served VLM's image placeholder token (``image_token_id`` of the config.json of the folder ``/v1/models``
        names); None for a text model (no ``image_token_id`` there)."""
        if self._model_checked:
            return self._image_token_id
        try:
            models = await self._request("GET", "/v1/models")
        except EngineError as e:
            if e.status != 404:
                raise
            models = None  # not vLLM's server (a stand-in that answers generate only): no VLM to adapt to
        if models is None:
            self._model_checked = True
            return None
        try:
            root = str(models["data"][0]["root"])
        except (KeyError, IndexError, TypeError) as e:
            raise EngineError(self.base_url, "/v1/models", f"no served model in {str(models)[:300]}") from e
        try:
            self._image_token_id = image_token_of(root)
        except ValueError as e:  # a text model (or a folder this node cannot read: generate says so for images)
            self._image_token_id, self._no_image_token = None, str(e)
        self._model_checked = True
        return self._image_token_id

    async def model_info(self) -> dict[str, Any]:
        info = await self._request("GET", "/weight_info")
        return {"weight_version": as_version(info["weight_version"])}

    async def set_weight_version(self, version: int) -> None:
        await self._request("POST", "/update_weight_version", json_body={"new_version": str(int(version))})

    async def load(self) -> dict[str, Any]:
        return await self._request("GET", "/load")

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {sorted(PAUSE_MODES)}")
        return await self._request("POST", "/pause", params={"mode": PAUSE_MODES[mode]})

    async def resume(self) -> dict[str, Any]:
        return await self._request("POST", "/resume")

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> Any:
        if rid is None and not abort_all:
            raise ValueError("abort() needs a rid or abort_all=True")
        body = {} if abort_all else {"request_ids": [REQUEST_ID_PREFIX + rid]}
        return await self._request("POST", "/abort_requests", json_body=body)

    async def flush_cache(self) -> Any:
        return await self._request("POST", "/reset_prefix_cache")

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> dict[str, Any]:
        await self._request(
            "POST", "/collective_rpc", json_body={"method": "reload_hf_weights", "kwargs": {"weights_path": model_path}}
        )
        await self.flush_cache()
        if weight_version is not None:
            await self.set_weight_version(weight_version)
        return {"success": True, "message": f"reloaded {model_path}"}
