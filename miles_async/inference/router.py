"""Spread requests over engines: least outstanding requests first."""

from __future__ import annotations

from typing import Any

from miles_async.inference.client import EngineClient


class Router:
    def __init__(self, urls: list[str], timeout: float):
        if not urls:
            raise ValueError("Router needs at least one engine URL")
        self.clients = [EngineClient(u, timeout=timeout) for u in urls]
        self.outstanding = [0] * len(self.clients)

    def _pick(self) -> int:
        return min(range(len(self.clients)), key=lambda i: self.outstanding[i])

    async def generate(self, input_ids: list[int], sampling_params: dict, return_logprob: bool = True,
                       rid: str | None = None) -> dict[str, Any]:
        i = self._pick()
        self.outstanding[i] += 1
        try:
            return await self.clients[i].generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid)
        finally:
            self.outstanding[i] -= 1

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
