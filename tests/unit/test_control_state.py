"""The control API's pure core (phase, step gauges, commands taken at the step boundary), the /metrics text it
renders, and the --api-server-* flags."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miles_async.arguments import ConfigError, parse_args
from miles_async.config.report import render as render_report
from miles_async.control.metrics import render as render_metrics
from miles_async.control.state import PHASES, CommandRefused, ControlState, StepCommands
from tests.flag_helpers import minimal_flags


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# A fully-async step's metrics, as the loop logs them (keys from rollout/batch.py and rollout/fully_async.py).
ASYNC_STEP = {
    "time/step_seconds": 2.0,
    "rollout/num_samples": 32,
    "rollout/response_len_mean": 5.0,
    "async/buffer_at_wait_start": 3,
    "async/staleness_mean": 0.5,
    "async/staleness_max": 1,
    "rollout/groups_kept_total": 6,
    "rollout/groups_dropped_total": 2,
}


def test_phase_changes_are_timed_by_the_clock_and_unknown_phases_refused():
    clock = Clock()
    state = ControlState(clock, can_save=True)
    assert state.snapshot()["phase"] == "starting"
    state.set_phase("training")
    clock.now += 3.0
    state.set_phase("training")  # the same phase again does not restart its time
    clock.now += 1.5
    snap = state.snapshot()
    assert (snap["phase"], snap["phase_seconds"]) == ("training", 4.5)
    state.set_phase("saving")
    assert state.snapshot()["phase_seconds"] == 0.0
    with pytest.raises(ValueError, match="unknown phase 'sleeping'"):
        state.set_phase("sleeping")


def test_step_gauges_come_from_the_step_metrics_and_missing_ones_stay_unknown():
    state = ControlState(Clock(), can_save=False, start_step=4)
    assert state.snapshot()["step"] == 4
    state.step_done(5, {"time/step_seconds": 4.0, "rollout/num_samples": 8, "rollout/response_len_mean": 3.0})
    snap = state.snapshot()
    assert snap["step"] == 5 and snap["step_seconds"] == 4.0 and snap["tokens_per_second"] == 6.0
    # One-step-off logs no async keys: no buffer, keep rate or staleness rather than a made-up 0.
    assert snap["buffer_groups"] is None and snap["keep_rate"] is None and snap["staleness_max"] is None
    state.step_done(6, ASYNC_STEP)
    snap = state.snapshot()
    assert snap["tokens_per_second"] == 80.0
    assert (snap["buffer_groups"], snap["keep_rate"], snap["staleness_mean"], snap["staleness_max"]) == (
        3.0,
        0.75,
        0.5,
        1.0,
    )
    state.step_done(7, {"time/step_seconds": 1.0})  # a step without them keeps the last known values
    assert state.snapshot()["keep_rate"] == 0.75 and state.snapshot()["step"] == 7


def test_a_save_request_is_taken_once_at_the_next_boundary():
    state = ControlState(Clock(), can_save=True)
    assert state.take_commands() == StepCommands(save=False, stop=False)
    state.request_save()
    assert state.snapshot()["save_requested"]
    taken = state.take_commands()
    assert (taken.save, taken.stop) == (True, False)
    assert not state.take_commands().save


def test_a_stop_saves_when_the_run_can_and_stays_requested():
    state = ControlState(Clock(), can_save=True)
    state.request_stop()
    first, second = state.take_commands(), state.take_commands()
    assert (first.save, first.stop) == (True, True) and second.stop
    no_save = ControlState(Clock(), can_save=False)
    no_save.request_stop()
    taken = no_save.take_commands()
    assert (taken.save, taken.stop) == (False, True)


def test_save_without_a_checkpoint_folder_is_refused_naming_the_flag():
    state = ControlState(Clock(), can_save=False)
    with pytest.raises(CommandRefused, match="needs --save"):
        state.request_save()
    assert not state.take_commands().save


def parse_exposition(text: str) -> dict[str, dict[str, float]]:
    """{family: {labels: value}} through prometheus_client's own parser (what a Prometheus scrape reads);
    asserts every family is a gauge. Labels are written back as '{name="value"}' ('' for none)."""
    families: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "gauge", family
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            families.setdefault(sample.name, {})[f"{{{labels}}}" if labels else ""] = sample.value
    return families


def test_metrics_show_one_phase_and_only_the_known_gauges():
    clock = Clock()
    state = ControlState(clock, can_save=True)
    state.set_phase("updating_weights")
    status = {**state.snapshot(), "engines": {"serving": 2, "quarantined": 1}, "last_save": None}
    got = parse_exposition(render_metrics(status))
    assert got["miles_async_phase"] == {f'{{phase="{p}"}}': float(p == "updating_weights") for p in PHASES}
    assert got["miles_async_engines_serving"] == {"": 2.0} and got["miles_async_engines_quarantined"] == {"": 1.0}
    assert "miles_async_step_seconds" not in got and "miles_async_last_save_rollout_id" not in got

    state.step_done(3, ASYNC_STEP)
    state.paused = True
    status = {**state.snapshot(), "engines": {"error": "timed out"}, "last_save": {"rollout_id": 2, "path": "x"}}
    got = parse_exposition(render_metrics(status))
    assert {k: v[""] for k, v in got.items() if k != "miles_async_phase"} == {
        "miles_async_step": 3.0,
        "miles_async_paused": 1.0,
        "miles_async_step_seconds": 2.0,
        "miles_async_tokens_per_second": 80.0,
        "miles_async_buffer_groups": 3.0,
        "miles_async_keep_rate": 0.75,
        "miles_async_staleness_mean": 0.5,
        "miles_async_staleness_max": 1.0,
        "miles_async_last_save_rollout_id": 2.0,
    }


# -- flags ----------------------------------------------------------------------------------------------
def run_flags(tmp_path) -> list[str]:
    return [*minimal_flags(tmp_path), "--num-rollout", "2"]


def test_without_a_token_the_server_makes_one_and_bad_tls_or_host_flags_are_refused(tmp_path, monkeypatch):
    """No token given: the config holds none and the server makes one at start (tests/integration/test_red_team.py),
    on loopback or not. The TLS files go in pairs and must exist; allowed hosts are bare names."""
    monkeypatch.delenv("MILES_ASYNC_API_TOKEN", raising=False)
    base = [*run_flags(tmp_path), "--api-server-port", "0"]
    assert parse_args([*base, "--api-server-host", "0.0.0.0"]).control.token is None
    assert not parse_args([*run_flags(tmp_path), "--api-server-host", "0.0.0.0"]).control.enabled
    cert = tmp_path / "cert.pem"
    cert.write_text("-")
    with pytest.raises(ConfigError, match="^--api-server-ssl-certfile and --api-server-ssl-keyfile go together"):
        parse_args([*base, "--api-server-ssl-certfile", str(cert)])
    with pytest.raises(ConfigError, match="^--api-server-ssl-keyfile: file not found: .*missing.pem"):
        parse_args(
            [*base, "--api-server-ssl-certfile", str(cert), "--api-server-ssl-keyfile", str(tmp_path / "missing.pem")]
        )
    with pytest.raises(ConfigError, match="^--api-server-allowed-hosts: 'http://node1' is not a host name"):
        parse_args([*base, "--api-server-allowed-hosts", "node1.example", "http://node1"])
    assert parse_args([*base, "--api-server-allowed-hosts", "node1.example", "10.0.0.7"]).control.allowed_hosts == (
        "node1.example",
        "10.0.0.7",
    )


def test_the_token_comes_from_the_environment_or_a_file_and_never_shows(tmp_path, monkeypatch):
    base = [*run_flags(tmp_path), "--api-server-port", "0", "--api-server-host", "0.0.0.0"]
    monkeypatch.setenv("MILES_ASYNC_API_TOKEN", "from-env-7f3a")
    cfg = parse_args(base)
    assert cfg.control.token.value == "from-env-7f3a" and cfg.control.port == 0
    assert "from-env-7f3a" not in render_report(cfg)
    token_file = tmp_path / "token"
    token_file.write_text("from-file-91c2\n")
    assert parse_args([*base, "--api-server-token-file", str(token_file)]).control.token.value == "from-file-91c2"
    with pytest.raises(ConfigError, match="^--api-server-token-file: file not found"):
        parse_args([*base, "--api-server-token-file", str(tmp_path / "missing")])
    token_file.write_text("  \n")
    with pytest.raises(ConfigError, match="^--api-server-token-file: .* is empty"):
        parse_args([*base, "--api-server-token-file", str(token_file)])


def test_the_port_must_be_a_port(tmp_path):
    with pytest.raises(ConfigError, match=r"^--api-server-port must lie in \[0, 65535\]"):
        parse_args([*run_flags(tmp_path), "--api-server-port", "70000"])
