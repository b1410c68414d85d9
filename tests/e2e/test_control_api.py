"""The control API on a real run (train_async.py, tiny model, one embedded engine, real Ray), driven over HTTP as an
operator would: status with a rising step, Prometheus metrics, the token, save, pause and resume, stop. While it
runs, no process of the machine but the driver holds one of the run's secrets (the control API's token, the
engines' key, a WANDB_API_KEY) in its command line or environment (``ps``, /proc: what other users can read).
Every route's refusals are tests/integration/test_red_team.py's."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import requests

from miles_async.control.state import PHASES
from miles_async.utils.checkpoint import POINTER, iteration_dir
from tests.e2e.runner import (
    ENGINE_AUTH,
    ENGINE_KEY,
    Run,
    all_pids,
    drain,
    start_train,
    tiny_args,
    wait_all_dead,
    wait_api_file,
)
from tests.unit.test_control_state import parse_exposition

TOKEN = "e2e-token-5d1c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Api:
    def __init__(self, url: str, proc, output: list[str]):
        self.url, self.proc, self.output = url, proc, output

    def get(self, path: str) -> requests.Response:
        return requests.get(self.url + path, headers=AUTH, timeout=30)

    def post(self, path: str) -> requests.Response:
        return requests.post(self.url + path, headers=AUTH, json={}, timeout=30)

    def status(self) -> dict:
        r = self.get("/status")
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict[str, dict[str, float]]:
        r = self.get("/metrics")
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.text
        return parse_exposition(r.text)

    def wait_status(self, until: Callable[[dict], bool], what: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if until(status):
                return status
            assert self.proc.poll() is None, "".join(self.output)[-5000:]
            assert time.monotonic() < deadline, f"{what}: last status {status}"
            time.sleep(0.2)


def _holding(secrets: dict[str, str], exempt: set[int]) -> list[str]:
    """Every process whose command line or environment holds one of ``secrets`` (by name), but ``exempt``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in exempt:
            continue
        for part in ("cmdline", "environ"):
            try:
                raw = Path(f"/proc/{entry}/{part}").read_bytes()
            except OSError:  # gone meanwhile, or another user's
                continue
            found += [
                f"{name} in /proc/{entry}/{part}: {raw[:200]!r}" for name, v in secrets.items() if v.encode() in raw
            ]
    return found


def test_the_control_api_watches_saves_pauses_and_stops_a_run(tiny_model, tiny_task, tmp_path):
    save = tmp_path / "ckpt"
    args = tiny_args(
        tiny_model, tiny_task, tmp_path, "--num-rollout", "5000", "--save", str(save), "--api-server-port", "0"
    )
    wandb_key = "wandb-" + uuid.uuid4().hex  # never used (no --use-wandb): a secret of the driver's environment
    proc = start_train(args, extra_env={"MILES_ASYNC_API_TOKEN": TOKEN, "WANDB_API_KEY": wandb_key})
    output: list[str] = []
    reader = drain(proc, output)
    try:
        info = wait_api_file(tmp_path / "api.json", proc, output)
        assert info["token_file"] is None and info["url"] == f"http://127.0.0.1:{info['port']}"  # the user's token
        api = Api(info["url"], proc, output)

        # Every endpoint needs the token.
        for method, path in (("GET", "/status"), ("GET", "/metrics"), ("POST", "/save"), ("POST", "/stop")):
            r = requests.request(method, api.url + path, timeout=30)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), (path, r.text)
        wrong = {"Authorization": "Bearer nope"}
        assert requests.get(api.url + "/status", headers=wrong, timeout=30).status_code == 401

        # The step rises while the run trains; the engine serves.
        first = api.wait_status(lambda s: s["step"] >= 1, "a first step")
        later = api.wait_status(lambda s: s["step"] > first["step"], "a rising step")
        assert later["num_rollout"] == 5000 and later["phase"] in PHASES and later["paused"] is False
        engines = later["engines"]
        assert (engines["serving"], engines["quarantined"]) == (1, 0)
        assert [e["state"] for e in engines["engines"]] == ["serving"]
        assert later["last_save"] is None  # no --save-interval: only the API saves here

        m = api.metrics()
        phases = m["miles_async_phase"]
        assert sorted(phases) == sorted(f'{{phase="{p}"}}' for p in PHASES)
        assert sorted(phases.values()) == [0.0] * (len(PHASES) - 1) + [1.0]
        assert m["miles_async_step_seconds"][""] > 0 and m["miles_async_engines_serving"] == {"": 1.0}
        assert m["miles_async_step"][""] >= later["step"]

        # Pause: the loop waits, for the paused engines' next rollout or at its step boundary, and the step stops
        # rising; /status still answers.
        assert api.post("/pause").json() == {"paused": True}
        held = api.wait_status(
            lambda s: s["phase"] in ("generating", "paused") and s["phase_seconds"] > 2, "the loop to wait", 60
        )
        engine = requests.get(engines["engines"][0]["url"] + "/get_load", headers=ENGINE_AUTH, timeout=30).json()
        time.sleep(3)
        still = api.status()
        assert (still["step"], still["phase"], still["paused"]) == (held["step"], held["phase"], True)
        assert api.metrics()["miles_async_paused"] == {"": 1.0}
        # The engine itself is paused and did no forward pass meanwhile.
        engine_after = requests.get(engines["engines"][0]["url"] + "/get_load", headers=ENGINE_AUTH, timeout=30).json()
        assert engine["paused"] and engine_after["paused"]
        assert engine_after["busy_seconds"] == engine["busy_seconds"]
        # Every process of the run is up (engine, executor, controller, trainer): none but the driver, which the
        # user gave them to, holds a secret. (The test's own process holds them in memory only.)
        secrets = {"token": TOKEN, "engine key": ENGINE_KEY.reveal(), "WANDB_API_KEY": wandb_key}
        assert _holding(secrets, exempt={proc.pid}) == []
        # The scan does see them where they are: all three in the driver's environment.
        assert len([x for x in _holding(secrets, exempt=set()) if f"/proc/{proc.pid}/environ" in x]) == 3
        assert api.post("/resume").json() == {"paused": False}
        api.wait_status(lambda s: s["step"] > held["step"] + 1, "the step to rise again after /resume")

        # Save: a complete checkpoint of the step that was training when it was asked for.
        r = api.post("/save")
        assert r.status_code == 202, r.text
        saved = api.wait_status(lambda s: s["last_save"] is not None, "the checkpoint asked for by /save", 60)
        rollout_id = saved["last_save"]["rollout_id"]
        assert saved["last_save"]["path"] == str(iteration_dir(save, rollout_id))
        assert (iteration_dir(save, rollout_id) / "COMPLETE").is_file()
        # Taken at the step boundary after the request (or the next one, if that boundary was already past).
        assert rollout_id + 1 in (r.json()["after_step"], r.json()["after_step"] + 1)

        # Stop: a last checkpoint of the last step, a clean exit, nothing left running.
        assert api.post("/stop").status_code == 202
        proc.wait(timeout=180)
        reader.join(timeout=30)
        run = Run(proc.returncode, "".join(output), tmp_path)
        assert run.returncode == 0, run.output[-5000:]
        assert "stopped by POST /stop" in run.output
        last_step = run.metrics[-1]["step"]
        assert 2 < last_step < 5000
        assert (save / POINTER).read_text().strip() == str(last_step - 1)
        assert (iteration_dir(save, last_step - 1) / "COMPLETE").is_file()
        assert not (tmp_path / "api.json").exists()
        assert wait_all_dead(all_pids(run.processes())) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
