"""Red team: every route of the control API and of the embedded engine (its weight routes among them), listed from
each app's own route table when the test runs, tried as an attacker would try it; docs/security.md is the threat
model these tests hold the servers to.

One real run's worth of servers on loopback: an inference controller (a Ray actor on the tests' cluster) with one
embedded engine, and the control API driving it, as train_async.py wires them. Each route is tried without a
credential and with a wrong one, from a foreign ``Host``, with a cross-site content type (``text/plain``, a form),
with malformed JSON, with a body over the limit, and with path traversal in every field that names a file. Each
answer is a 4xx whose message names what was wrong, never a 5xx, and afterwards nothing changed: the engine's
weights (their checksums), weight version and pause state, and the run's pause, save and stop state. Then the
right credentials do work, so the refusals were the checks' and not broken routes'. SGLang's and vLLM's own
routes are tried in tests/engines/test_engine_servers.py (their servers start there once each).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import subprocess
import threading
import time
from dataclasses import replace
from urllib.parse import urlsplit

import pytest
import ray
import requests
from aiohttp import web

from miles_async.arguments import parse_args
from miles_async.config.control import ControlConfig, Secret
from miles_async.control.control import Control
from miles_async.control.engines import ControllerEngines
from miles_async.control.server import MAX_BODY_BYTES as CONTROL_MAX_BODY
from miles_async.control.server import TOKEN_FILE, ControlServer
from miles_async.control.state import ControlState
from miles_async.inference.auth import auth_headers, is_exempt
from miles_async.inference.embedded.server import MAX_BODY_BYTES, MAX_JSON_BYTES, RAW_BODY_ROUTES, ROUTES
from miles_async.ray.inference_controller import InferenceController
from miles_async.utils.api_key import ApiKey

WRONG = ApiKey("not-the-key")
FOREIGN_HOST = "attacker.example"
CROSS_SITE = {"text/plain": b'{"abort_all": true}', "application/x-www-form-urlencoded": b"abort_all=true"}
MALFORMED = {b"{not json": "invalid JSON", b"[1, 2]": "must be a JSON object"}
# The fields that name a file, per route, and what a traversal there must be refused naming.
TRAVERSALS = {
    "/update_weights_from_disk": [({"model_path": "../../../../../etc"}, "model_path")],
    "/stage_weights_from_shm": [
        ({"weight_version": 9, "segments": [{"path": "/dev/shm/../../etc/passwd", "tensors": []}]}, "segments[0]"),
        ({"weight_version": 9, "segments": [{"path": "/proc/1/fd/0", "tensors": []}]}, "segments[0]"),
    ],
}


def _routes(table) -> list[tuple[str, str]]:
    """(method, path) of every route of an aiohttp route table or router; HEAD is GET's, which aiohttp adds."""
    out = {(r.method, r.path if isinstance(r, web.RouteDef) else r.resource.canonical) for r in table}
    return sorted((m, p) for m, p in out if m != "HEAD")


def _assert_refused(r: requests.Response | tuple[int, str], status: int, says: str, what: str) -> None:
    code, text = (r.status_code, r.text) if isinstance(r, requests.Response) else r
    assert code == status and says.lower() in text.lower(), (what, code, text[:300])


def _oversized(url: str, method: str, path: str, headers: dict[str, str], length: int) -> tuple[int, str]:
    """What the server answers a request that declares ``length`` bytes of body, before any is sent."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest(method, path)
        for k, v in {**headers, "Content-Length": str(length)}.items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


# -- one run's servers ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cfg(tiny_model, tiny_task, tmp_path_factory):
    train, _ = tiny_task
    out = tmp_path_factory.mktemp("red_team")
    return parse_args(
        [
            "--use-tis", "--hf-checkpoint", str(tiny_model), "--prompt-data", str(train), "--rm-type", "first_integer",
            "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-num-threads", "1", "--rollout-dtype", "float32", "--output-dir", str(out),
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def controller(shared_ray, cfg):
    actor = ray.remote(InferenceController).options(num_cpus=0).remote(cfg.engine, cfg.tracking.output_dir)
    try:
        urls = ray.get(actor.start.remote(), timeout=120)
        yield actor, urls[0]
    finally:
        ray.get(actor.dispose.remote(), timeout=60)
        ray.kill(actor)


class Served:
    """A ControlServer on its own event loop thread, as the driver runs it beside the training loop."""

    def __init__(self, control: Control, api: ControlConfig, output_dir: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ControlServer(control, api, output_dir, None, 10)
        self.url = self.call(self.server.start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self.call(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def api(controller, cfg):
    """The control API with no token given (the run makes one), driving the controller's engine."""
    actor, _ = controller
    state = ControlState(time.monotonic, can_save=False, start_step=0)
    served = Served(Control(state, ControllerEngines(actor, timeout=30)), ControlConfig("127.0.0.1", 0, None),
                    cfg.tracking.output_dir)  # fmt: skip
    try:
        yield served
    finally:
        served.close()


def _engine_state(url: str, key: ApiKey) -> dict:
    h = auth_headers(key)
    info = requests.get(url + "/get_model_info", headers=h, timeout=30).json()
    load = requests.get(url + "/get_load", headers=h, timeout=30).json()
    sums = requests.get(url + "/weights_checksum", headers=h, timeout=30).json()
    return {"version": info["weight_version"], "paused": load["paused"], "checksums": sums}


def _run_state(served: Served) -> dict:
    s = served.server.control.state
    return {"paused": s.paused, "snapshot": {k: v for k, v in s.snapshot().items() if "seconds" not in k}}


# -- the embedded engine --------------------------------------------------------------------------------------
def test_every_engine_route_refuses_what_it_must_and_nothing_changes(controller, cfg):
    _, url = controller
    key = cfg.engine.api_key
    routes = _routes(ROUTES)
    assert ("POST", "/update_weights_from_tensor") in routes and len(routes) >= 15  # the table was read
    before = _engine_state(url, key)
    open_routes = []
    for method, path in routes:
        if is_exempt(method, path):
            open_routes.append((method, path))
            continue
        for headers, what in (({}, "no key"), (auth_headers(WRONG), "wrong key"), ({"Host": FOREIGN_HOST}, "host")):
            r = requests.request(method, url + path, headers=headers, json={"abort_all": True}, timeout=30)
            _assert_refused(r, 401, "requires 'Authorization: Bearer", f"{method} {path}: {what}")
    # Open to anyone: the probe, read-only (as SGLang's /health).
    assert open_routes == [("GET", "/health")]

    good = auth_headers(key)
    for method, path in routes:
        if method != "POST":
            continue
        raw = path in RAW_BODY_ROUTES
        for ctype, body in CROSS_SITE.items():
            r = requests.post(url + path, headers={**good, "Content-Type": ctype}, data=body, timeout=30)
            _assert_refused(r, 415, f"Content-Type '{ctype}'", f"{path}: {ctype}")
        limit = MAX_BODY_BYTES if raw else MAX_JSON_BYTES
        ctype = "application/octet-stream" if raw else "application/json"
        status = _oversized(url, "POST", path, {**good, "Content-Type": ctype}, limit + 1)
        _assert_refused(status, 413, "over this route's limit", f"{path}: oversized")
        if not raw:
            for body, says in MALFORMED.items():
                r = requests.post(
                    url + path, headers={**good, "Content-Type": "application/json"}, data=body, timeout=30
                )
                _assert_refused(r, 400, says, f"{path}: {body!r}")
    assert set(TRAVERSALS) <= {p for _, p in routes}
    for path, tries in TRAVERSALS.items():
        for body, field in tries:
            r = requests.post(url + path, headers=good, json=body, timeout=30)
            _assert_refused(r, 400, field, f"{path}: {body}")
    assert _engine_state(url, key) == before


# -- the control API ------------------------------------------------------------------------------------------
def test_without_a_token_the_control_api_makes_one_and_shows_only_its_path(controller, tmp_path, caplog):
    actor, _ = controller
    control = Control(ControlState(time.monotonic, can_save=False, start_step=0), ControllerEngines(actor, 30))
    with caplog.at_level(logging.INFO, "miles_async.control.server"):
        served = Served(control, ControlConfig("127.0.0.1", 0, None), str(tmp_path))
    try:
        path = served.server.token_path
        assert path == tmp_path / TOKEN_FILE and (path.stat().st_mode & 0o777) == 0o600
        token = path.read_text().strip()
        assert len(token) >= 32 and str(path) in caplog.text and token not in caplog.text
        info = served.server.api_path.read_text()
        assert json.loads(info)["token_file"] == str(path) and token not in info
        # An unauthenticated stop on loopback is refused; the token works.
        r = requests.post(served.url + "/stop", json={}, timeout=30)
        assert r.status_code == 401 and str(path) in r.json()["error"] and not control.state.stop_requested
        assert requests.get(served.url + "/status", headers={"Authorization": f"Bearer {token}"}, timeout=30).ok
    finally:
        served.close()
    assert not path.exists()  # gone with the run's API


def test_every_control_route_refuses_what_it_must_and_nothing_changes(api, controller, cfg):
    _, engine_url = controller
    token = api.server.token_path.read_text().strip()
    good = {"Authorization": f"Bearer {token}"}
    routes = _routes(api.server.app().router.routes())
    assert ("POST", "/stop") in routes and ("GET", "/status") in routes  # the router was read
    run_before, engine_before = _run_state(api), _engine_state(engine_url, cfg.engine.api_key)
    for method, path in routes:
        what = f"{method} {path}"
        json_ = {"Content-Type": "application/json"}
        for headers, why in (({}, "no token"), ({"Authorization": "Bearer nope"}, "wrong token")):
            r = requests.request(method, api.url + path, headers={**headers, **json_}, data=b"{}", timeout=30)
            _assert_refused(r, 401, "missing or wrong bearer token", f"{what}: {why}")
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        r = requests.request(method, api.url + path, headers={**good, **json_, "Host": FOREIGN_HOST}, timeout=30)
        _assert_refused(r, 403, f"Host '{FOREIGN_HOST}' is not one this API answers to", f"{what}: host")
        if method != "POST":
            continue
        for ctype, body in CROSS_SITE.items():
            r = requests.post(api.url + path, headers={**good, "Content-Type": ctype}, data=body, timeout=30)
            _assert_refused(r, 415, f"Content-Type '{ctype}'", f"{what}: {ctype}")
        r = requests.post(api.url + path, headers=good, timeout=30)  # no body, no type: a no-cors fetch's
        _assert_refused(r, 415, "takes application/json", f"{what}: untyped")
        for body, says in {**MALFORMED, b'{"mode": "abort"}': "takes no parameters"}.items():
            r = requests.post(api.url + path, headers={**good, **json_}, data=body, timeout=30)
            _assert_refused(r, 400, says, f"{what}: {body!r}")
        status = _oversized(api.url, "POST", path, {**good, **json_}, CONTROL_MAX_BODY + 1)
        _assert_refused(status, 413, "over the limit", f"{what}: oversized")
    assert _run_state(api) == run_before and _engine_state(engine_url, cfg.engine.api_key) == engine_before

    # The right token, JSON, and this API's own host: the commands act (so the refusals above were the checks').
    r = requests.post(api.url + "/pause", headers=good, json={}, timeout=60)
    assert (
        r.status_code == 200 and _run_state(api)["paused"] and _engine_state(engine_url, cfg.engine.api_key)["paused"]
    )
    assert requests.post(api.url + "/resume", headers=good, json={}, timeout=60).json() == {"paused": False}
    assert not _engine_state(engine_url, cfg.engine.api_key)["paused"]


def test_off_loopback_it_serves_https_with_a_certificate_and_warns_without_one(controller, tmp_path, caplog):
    actor, _ = controller
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    control = Control(ControlState(time.monotonic, can_save=False, start_step=0), ControllerEngines(actor, 30))
    token = {"Authorization": "Bearer users-own-token"}
    tls = ControlConfig("127.0.0.1", 0, Secret("users-own-token"), (), str(cert), str(key))
    served = Served(control, tls, str(tmp_path))
    try:
        assert served.url.startswith("https://127.0.0.1:") and served.server.token_path is None
        assert requests.get(served.url + "/status", headers=token, verify=str(cert), timeout=30).ok
        with pytest.raises(requests.ConnectionError):
            requests.get(served.url.replace("https", "http") + "/status", headers=token, timeout=30)
    finally:
        served.close()

    # On every interface, in clear: a warning; the Host it answers to is its own or one the flag adds.
    wide = replace(tls, host="0.0.0.0", ssl_certfile=None, ssl_keyfile=None, allowed_hosts=("node1.example",))
    with caplog.at_level(logging.WARNING, "miles_async.control.server"):
        served = Served(control, wide, str(tmp_path))
    try:
        assert "its bearer token travels in clear" in caplog.text and "users-own-token" not in caplog.text
        url = served.url.replace("0.0.0.0", "127.0.0.1")
        for host, status in (("node1.example:80", 200), ("127.0.0.1", 200), ("node2.example", 403)):
            r = requests.get(url + "/status", headers={**token, "Host": host}, timeout=30)
            assert r.status_code == status, (host, r.text)
    finally:
        served.close()
