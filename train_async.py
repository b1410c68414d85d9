"""Asynchronous RL training: rollout N+1 is generated while the policy trains on rollout N."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from tqdm import tqdm

from miles_async.arguments import ConfigError, parse_args
from miles_async.config import Config
from miles_async.control import Control, control_api
from miles_async.control.signals import StopSignals
from miles_async.ray.eval_dispatcher import EvalDispatcher, EvalsFailed
from miles_async.ray.trainer_recovery import TrainerDied, TrainerFailed
from miles_async.run import Run
from miles_async.utils.misc import should_run_periodic_action
from miles_async.utils.tracking import Tracker

logger = logging.getLogger("train_async")


async def train(
    cfg: Config,
    run: Run,
    tracker: Tracker,
    evals: EvalDispatcher,
    start_rollout_id: int,
    control: Control,
    signals: StopSignals,
) -> None:
    """Rollouts ``start_rollout_id`` (--load's next, or after a trainer restart the restored checkpoint's next)
    to --num-rollout."""
    loop, ckpt = cfg.loop, cfg.checkpoint
    # Always push weights first, so the engines serve exactly what the trainer holds.
    await run.update_weights(weight_version=start_rollout_id)

    if loop.eval_interval is not None and start_rollout_id == 0 and not cfg.eval.skip_before_train:
        await evals.dispatch(0)
        if loop.synchronous:
            await evals.drain()  # --synchronous takes turns: an eval, like a rollout, overlaps no training

    # One-step-off and --synchronous generate each rollout when asked; the fully-async
    # producer generates all along, and each ask drains its next batch.
    generate = run.drain if loop.fully_async else run.generate
    next_rollout = asyncio.ensure_future(generate(start_rollout_id))
    current = None
    try:
        for rollout_id in tqdm(
            range(start_rollout_id, loop.num_rollout),
            desc="train",
            unit="step",
            initial=start_rollout_id,
            total=loop.num_rollout,
        ):
            signals.check()  # Ctrl-C or SIGTERM came, and its cancellation was lost on the way
            t_wait = time.time()
            control.phase("generating")
            if next_rollout is not None:
                current = await next_rollout
            metrics = {**current["metrics"], "time/wait_rollout_seconds": time.time() - t_wait}
            has_next = rollout_id + 1 < loop.num_rollout
            weight_update_due = (rollout_id + 1) % loop.update_weights_interval == 0
            # The fully-async producer generates without a pending drain; when the weights are
            # about to change, the next drain waits for them so it is measured against them.
            # --synchronous always waits: no generation overlaps training.
            defer_next_drain = has_next and (loop.synchronous or (loop.fully_async and weight_update_due))
            next_rollout = (
                asyncio.ensure_future(generate(rollout_id + 1)) if has_next and not defer_next_drain else None
            )

            control.phase("training")
            metrics.update(await run.train_step(rollout_id, current["data"][0]))
            run.check_save()  # a checkpoint written in the background that failed stops the run here

            commands = control.take_commands()  # POST /save and /stop (control API): honoured here, as the sentinel
            external_save = ckpt.save_trigger_sentinel is not None and os.path.exists(ckpt.save_trigger_sentinel)
            if (
                external_save
                or commands.save
                or should_run_periodic_action(
                    rollout_id, ckpt.save_interval, loop.num_rollout_per_epoch, loop.num_rollout
                )
            ):
                t_save = time.time()
                control.phase("saving")
                # Interval saves are written in the background (--async-save); sentinel, control-API and final
                # ones block.
                await run.save(
                    rollout_id, force_sync=external_save or commands.save or rollout_id + 1 == loop.num_rollout
                )
                metrics["time/save_seconds"] = time.time() - t_save
                if external_save:
                    os.remove(ckpt.save_trigger_sentinel)
                    logger.info("saved rollout %d on the sentinel %s", rollout_id, ckpt.save_trigger_sentinel)

            await control.hold_while_paused()  # POST /pause holds the run here, before the weights change
            if weight_update_due:
                # One-step-off: let the in-flight rollout finish on the old weights before they change.
                if next_rollout is not None and not loop.fully_async:
                    control.phase("generating")
                    t_drain = time.time()
                    current, next_rollout = await next_rollout, None
                    metrics["time/wait_rollout_seconds"] += time.time() - t_drain
                control.phase("updating_weights")
                metrics.update(await run.update_weights(weight_version=rollout_id + 1))
                await control.reassert_pause()
            eval_due = should_run_periodic_action(
                rollout_id, loop.eval_interval, loop.num_rollout_per_epoch, loop.num_rollout
            )
            if eval_due and loop.synchronous:
                # Taking turns: on one machine a background eval would share the cores with the next rollout and
                # the step (4 threads on 2 cores tripled the steps it overlapped).
                control.phase("evaluating")
                t_eval = time.time()
                await evals.dispatch(rollout_id + 1)
                await evals.drain()
                metrics["time/eval_seconds"] = time.time() - t_eval
            if defer_next_drain:
                next_rollout = asyncio.ensure_future(generate(rollout_id + 1))

            if eval_due and not loop.synchronous:
                control.phase("evaluating")
                await evals.dispatch(rollout_id + 1)
            metrics["time/step_seconds"] = time.time() - t_wait
            metrics.update(await run.health(metrics["time/step_seconds"]))
            tracker.log(rollout_id + 1, metrics)
            control.step_done(rollout_id + 1, metrics)
            if commands.stop:
                logger.info("stopped by POST /stop after rollout %d", rollout_id)
                break
            if (
                loop.debug_exit_after_rollout is not None
                and rollout_id - start_rollout_id + 1 >= loop.debug_exit_after_rollout
            ):
                logger.info(
                    "--debug-exit-after-rollout %d reached at rollout %d", loop.debug_exit_after_rollout, rollout_id
                )
                break
    finally:
        if next_rollout is not None:
            next_rollout.cancel()
            # A rollout that already failed is reported by the exception in flight, not as
            # "exception never retrieved" noise.
            next_rollout.add_done_callback(lambda f: f.cancelled() or f.exception())
    await run.wait_save()  # the last interval save, if still being written, is complete (or its failure raised)
    control.phase("evaluating")
    await evals.drain()
    if ckpt.save_hf:
        control.phase("saving")
        await run.save_hf(ckpt.save_hf)


async def main(cfg: Config) -> None:
    # Ctrl-C and SIGTERM (Slurm, docker stop, kill) cancel the loop, and leaving the Run stops every actor and
    # engine. Installed after Run() starts Ray, which sets its own SIGTERM handler (a bare sys.exit).
    run = Run(cfg)
    loop, signals = asyncio.get_running_loop(), StopSignals()
    signals.install(loop, asyncio.current_task())
    tracker = Tracker(cfg)
    # One for the whole run, trainer restarts included: its failures are the run's (EvalDispatcher.check).
    evals = EvalDispatcher(
        run.evaluate,
        lambda step, m: tracker.log(step, m, kind="eval"),
        cfg.eval.max_in_flight,
        timeout=cfg.rollout.timeout,
        failures_allowed=cfg.eval.failures_allowed,
    )
    try:
        async with run, control_api(cfg, run) as control:
            start, death = cfg.loop.start_rollout_id, None
            while True:
                signals.check()
                try:
                    if death is not None:
                        # TrainerFailed without --use-fault-tolerance or past --max-trainer-restarts; else the
                        # trainers and the rollout side are back at the last checkpoint (a worker that dies
                        # while they are rebuilt is one more death).
                        start, death = await run.recover_trainers(death), None
                    await run.watch_trainers(train(cfg, run, tracker, evals, start, control, signals))
                    break
                except TrainerDied as e:
                    death = e
    finally:
        signals.uninstall(loop)
        tracker.close()
    plot = None
    if cfg.tracking.plot:
        from miles_async.utils.plots import plot_run

        plot = plot_run(cfg.tracking.output_dir)
    print(
        f"[miles-async] done. metrics: {tracker.metrics_path} eval: {tracker.eval_path}"
        + (f" plot: {plot}" if plot else "")
        + (f" checkpoint: {cfg.checkpoint.save}" if cfg.checkpoint.save else "")
        + (f" hf: {cfg.checkpoint.save_hf}" if cfg.checkpoint.save_hf else ""),
        flush=True,
    )
    evals.check()  # more failed than allowed: cli prints the list and exits 1
    if evals.failures:
        logger.warning("%s", evals.summary())


def cli(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("MILES_ASYNC_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        cfg = parse_args(argv)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.check_config:
        from miles_async.config.report import render

        print(render(cfg), flush=True)
        return 0
    import ray

    try:
        asyncio.run(main(cfg))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted; all workers and engines were stopped", file=sys.stderr)
        return 130
    except TrainerFailed as e:  # the worker is named; a traceback of the driver would only hide it
        print(f"error: {e}; all workers and engines were stopped", file=sys.stderr)
        return 1
    except EvalsFailed as e:  # the run finished; its failed evals are listed, one per line
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
