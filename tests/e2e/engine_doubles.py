"""Engine doubles for end-to-end tests: the embedded engine with one timing made certain.

The engine server runs one when ``$MILES_ASYNC_ENGINE_CLASS`` names it (see
``miles_async.inference.embedded.server``); a test sets that variable for its own run only.
(A set cost per decode step is ``benchmarks.engine_doubles.FixedStepCost``.)
"""

from __future__ import annotations

from typing import Any

from miles_async.inference.embedded.engine import Engine


class HoldOneRequestUntilAbort(Engine):
    """The embedded engine, except that the first request to come one token short of its
    ``max_new_tokens`` is set aside until something aborts it (an abort pause before a weight
    update, or an abort of that request).

    Its KV rows are dropped the way a retract pause drops them, and the other requests are
    re-admitted and decode on. The abort then always lands mid-generation: the request returns
    all but one of its tokens, and the one left is generated at the first step after it resumes,
    before any request submitted after the abort can finish (those need a prefill and at least
    ``min_new_tokens`` steps).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.held = None  # one request, once per engine process

    def _sample_and_append(self, seqs: list, logits: Any) -> None:
        super()._sample_and_append(seqs, logits)
        if self.held is not None:
            return
        self.held = next((s for s in self._batch.rows if len(s.output) == s.params.max_new_tokens - 1 >= 1), None)
        if self.held is not None:
            self._flush()  # every row back to the queue without KV; the others are re-admitted next step
            self._waiting.remove(self.held)  # still live: an abort finishes it with its partial output
