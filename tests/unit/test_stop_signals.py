"""Ctrl-C and SIGTERM as train_async.py's main task sees them (``control/signals.py``), with real signals sent to
this process and a real event loop."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from miles_async.control.signals import StopSignals


def _loop_until_stopped(sig: signal.Signals, swallow_first_cancel: bool, report_after: float = 60.0) -> dict:
    """A stand-in for the training loop: ``check`` at each step, one awaited step after another; ``sig`` is sent
    at step 3. With ``swallow_first_cancel`` the step that the cancel lands in returns as if it had finished, as
    ``asyncio.wait_for`` does on Python 3.11 when the awaited future completes in the same pass (gh-96764)."""
    seen = {"steps": 0, "swallowed": 0, "received": None}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        signals = StopSignals(report_after=report_after)
        signals.install(loop, asyncio.current_task())
        try:
            while True:
                signals.check()
                if seen["steps"] == 3:
                    os.kill(os.getpid(), sig)
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    if not swallow_first_cancel or seen["swallowed"]:
                        raise
                    seen["swallowed"] += 1
                    asyncio.current_task().uncancel()
                seen["steps"] += 1
                assert seen["steps"] < 100, "the loop never stopped"
        finally:
            seen["received"] = signals.received
            signals.uninstall(loop)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    return seen


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_cancels_the_loop_where_it_waits(sig):
    seen = _loop_until_stopped(sig, swallow_first_cancel=False)
    assert seen == {"steps": 3, "swallowed": 0, "received": sig.name}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_swallowed_cancel_still_stops_the_loop_at_its_next_step(sig):
    seen = _loop_until_stopped(sig, swallow_first_cancel=True)
    # The step the cancel was lost in finished; the loop's next check stopped it.
    assert seen == {"steps": 4, "swallowed": 1, "received": sig.name}


def test_the_default_handlers_are_back_once_the_main_task_is_over():
    _loop_until_stopped(signal.SIGTERM, swallow_first_cancel=False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_stop_that_outlasts_the_report_delay_names_what_it_waits_on(capfd):
    async def main() -> None:
        loop = asyncio.get_running_loop()
        signals = StopSignals(report_after=0.3)
        signals.install(loop, asyncio.current_task())
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            # A clean-up that takes its time: the report names the threads and this task's stack.
            await asyncio.shield(asyncio.sleep(1.0))
            raise
        finally:
            signals.uninstall(loop)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    err = capfd.readouterr().err
    assert "still stopping 0s after SIGTERM; its threads:" in err
    assert "Current thread" in err or "Thread 0x" in err  # faulthandler's dump of the threads
    assert "its asyncio tasks:" in err and "test_stop_signals.py" in err  # the task's stack, with this file
