"""Ctrl-C and SIGTERM: a stop that cannot be lost, and a stop that cannot stall silently.

The first signal cancels the driver's main task (leaving ``Run`` then stops every actor and engine) and marks
the run stopped. The mark is what makes the stop stick: on Python 3.11 a cancellation that lands just as the
awaited future completes is swallowed (``asyncio.wait_for`` returns the result instead, fixed in 3.12 by
gh-96764), and the loop would train on; the loop checks the mark at every step (``check``), so such a run stops
at its next step boundary instead. A second signal cancels again, which cuts the clean-up short (Ray is still
shut down on the way out, see train_async.cli).

If the process still runs ``report_after`` seconds after the first signal, the stacks of its threads and of
its asyncio tasks go to stderr: whatever the stop waits on is named, never a silent hang.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import signal
import sys
import threading

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPORT_AFTER = 60.0


class StopSignals:
    """Installed on the running loop for the main task ``task``; ``received`` names the first signal."""

    def __init__(self, report_after: float = REPORT_AFTER):
        self.report_after = report_after
        self.received: str | None = None

    def install(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        # Replaces asyncio.run's own Ctrl-C handler (it cancels once, then raises KeyboardInterrupt wherever the
        # loop happens to be) and Ray's SIGTERM handler (a bare sys.exit).
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig, loop, task)

    def check(self) -> None:
        """Raise ``CancelledError`` once a signal came: the loop's step boundary, past any swallowed cancel."""
        if self.received is not None:
            raise asyncio.CancelledError(f"stopped by {self.received}")

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        """Back to the default handlers once the main task is over: a signal while asyncio.run winds down the
        leftover tasks, or while Ray shuts down, then ends the process. The report timer keeps running."""
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        if self.received is None:
            self.received = sig.name
            logger.warning(
                "%s: stopping the run, its workers and its engines (send it again to cut the clean-up short)",
                sig.name,
            )
            timer = threading.Timer(self.report_after, self._report, args=(loop,))
            timer.daemon = True
            timer.start()
        else:
            logger.warning("%s again: cutting the clean-up short", sig.name)
        task.cancel()

    def _report(self, loop: asyncio.AbstractEventLoop) -> None:
        print(
            f"[miles-async] still stopping {self.report_after:.0f}s after {self.received}; its threads:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            loop.call_soon_threadsafe(_print_tasks, loop)
        except RuntimeError:  # the loop is closed already: the threads above are all there is
            pass


def _print_tasks(loop: asyncio.AbstractEventLoop) -> None:
    out = io.StringIO()
    for t in asyncio.all_tasks(loop):
        print(f"--- {t!r}", file=out)
        t.print_stack(file=out)
    print(f"[miles-async] its asyncio tasks:\n{out.getvalue()}", file=sys.stderr, flush=True)
