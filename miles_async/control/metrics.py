"""GET /metrics: the run's gauges for Prometheus, through prometheus_client.

Each scrape renders the current ``/status`` answer through a collector on the server's own registry (never the
process-global one, which Ray and other libraries may also use). A gauge whose value is not known yet (no step
finished, staleness without --fully-async, engines unreachable) is left out rather than shown as 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from miles_async.control.state import PHASES

# The text format every Prometheus server reads (2.x included); generate_latest writes it for these plain names.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
PREFIX = "miles_async_"

# name (without PREFIX) -> help; the order /metrics lists them in. The README names every one.
HELP = {
    "phase": "1 for the loop's current phase, 0 for the others",
    "step": "rollouts trained so far (the step metrics.jsonl logs)",
    "paused": "1 while generation is paused through the control API",
    "step_seconds": "wall seconds of the last step",
    "tokens_per_second": "response tokens of the last step's rollout per second of that step",
    "buffer_groups": "groups buffered when the last batch was asked for (--fully-async)",
    "keep_rate": "groups the dynamic-sampling filter kept over all it judged since the run began, the steps before "
    "a --load included (1 without a filter)",
    "staleness_mean": "mean staleness, in weight versions, of the last batch's samples (--fully-async)",
    "staleness_max": "largest staleness, in weight versions, of the last batch's samples (--fully-async)",
    "engines_serving": "inference engines serving (in the router)",
    "engines_quarantined": "inference engines out of the router (failed, restarting or given up on)",
    "last_save_rollout_id": "rollout id of the latest complete checkpoint in --save",
}


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, HELP[name], value=float(value))


def families(status: dict) -> Iterator[GaugeMetricFamily]:
    """The gauges of a GET /status answer (``server.ControlServer.status``)."""
    phase = GaugeMetricFamily(PREFIX + "phase", HELP["phase"], labels=["phase"])
    for p in PHASES:
        phase.add_metric([p], float(p == status["phase"]))
    yield phase
    yield _gauge("step", status["step"])
    yield _gauge("paused", float(status["paused"]))
    for name in ("step_seconds", "tokens_per_second", "buffer_groups", "keep_rate", "staleness_mean", "staleness_max"):
        if status.get(name) is not None:
            yield _gauge(name, status[name])
    engines = status.get("engines") or {}
    if "serving" in engines:
        yield _gauge("engines_serving", engines["serving"])
        yield _gauge("engines_quarantined", engines["quarantined"])
    if status.get("last_save") is not None:
        yield _gauge("last_save_rollout_id", status["last_save"]["rollout_id"])


class _StatusCollector(Collector):
    def __init__(self, status: Callable[[], dict]):
        self._status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from families(self._status())


def render(status: dict) -> str:
    """The exposition text of one ``/status`` answer."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(lambda: status))
    return generate_latest(registry).decode()
