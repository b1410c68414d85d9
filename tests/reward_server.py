"""A real reward server for the tests of --rm-url: an aiohttp app on a port the kernel picks (port 0; ``port`` and
``url`` are set once it listens), in a thread of its own.

It scores "answer equals label" -- the first integer of the response against the label -- as ``right`` or
``wrong`` (values no built-in reward gives, so a test can tell the server's rewards apart), and records what
it saw: the size of every request (1 for Miles' single-object body), the most requests it held at once, and
how many it got. ``fail_first`` requests are answered 503 and ``drop_first`` lose their connection before
any reply; every request waits ``delay`` seconds first (a ``delay`` past the client's timeout is a server
that hangs). ``refuse_with`` answers every request with that status and a body that echoes its path and query;
``redirect_to`` answers every request with a 307 to that URL. Each request's Authorization header is recorded.
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field

from aiohttp import web

_INT = re.compile(r"-?\d+")


def answer_equals_label(item: dict, right: float, wrong: float) -> float:
    found = _INT.findall(item["response"])
    return right if found and found[0] == str(item["label"]).strip() else wrong


@dataclass
class RewardServer:
    right: float = 1.0
    wrong: float = 0.0
    fail_first: int = 0
    drop_first: int = 0
    delay: float = 0.0
    reward_key: str | None = None  # answer {reward_key: reward} instead of a bare number
    refuse_with: int | None = None
    redirect_to: str | None = None
    authorizations: list = field(default_factory=list)  # per request: its Authorization header, or None
    batch_sizes: list[int] = field(default_factory=list)  # per answered request; 1 for a single object
    bodies: list = field(default_factory=list)
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0

    def __post_init__(self) -> None:
        self.port: int | None = None
        self.url: str | None = None
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="reward-server")

    def __enter__(self) -> RewardServer:
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("the test reward server did not start in 30 s")
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/reward", self._handle)
        # A request still waiting out a long ``delay`` is cut off at exit instead of held for a minute.
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", 0).start())
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}/reward"
        self._started.set()
        self._loop.run_forever()

    def _score(self, item: dict):
        reward = answer_equals_label(item, self.right, self.wrong)
        return {self.reward_key: reward} if self.reward_key else reward

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        number = self.requests
        self.authorizations.append(request.headers.get("Authorization"))
        if self.redirect_to is not None:
            return web.Response(status=307, headers={"Location": self.redirect_to})
        if self.refuse_with is not None:
            return web.Response(status=self.refuse_with, text=f"no access for {request.path_qs}")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            body = await request.json()
            if self.delay:
                await asyncio.sleep(self.delay)
            if number <= self.drop_first:
                request.transport.close()  # the connection dies with no reply
                return web.Response(status=500)
            if number <= self.drop_first + self.fail_first:
                return web.Response(status=503, text="busy")
            self.bodies.append(body)
            if isinstance(body, list):
                self.batch_sizes.append(len(body))
                return web.json_response([self._score(item) for item in body])
            self.batch_sizes.append(1)
            return web.json_response(self._score(body))
        finally:
            self.in_flight -= 1
