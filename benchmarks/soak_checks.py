"""The fault-injection soak's pure parts: the seeded kill plan, the trained-prompt lineage across resumes and its
exactly-once check, and what a complete checkpoint folder holds (``benchmarks/soak.py`` runs them)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from miles_async.ray.rollout_executor import STATE_FILE
from miles_async.utils.checkpoint import POINTER, iteration_dir

TARGETS = ("driver", "train_worker", "engine", "executor")
MOMENTS = ("mid-save", "timed")
MODES = ("one-step-off", "fully-async")


@dataclass(frozen=True)
class KillPlan:
    """One run's fault: SIGKILL ``target`` once ``after_step`` steps are logged, then ``delay_s`` seconds later
    (``timed``) or at the first checkpoint folder seen without its COMPLETE marker (``mid-save``). ``pick`` chooses
    among the target's processes (training ranks, engines) modulo their number."""

    run: int
    seed: int
    mode: str
    target: str
    moment: str
    after_step: int
    delay_s: float
    pick: int

    def describe(self) -> str:
        when = "at the next save in progress" if self.moment == "mid-save" else f"+{self.delay_s:.2f}s"
        return f"{self.target}#{self.pick} after step {self.after_step} {when}"

    def to_dict(self) -> dict:
        return asdict(self)


def plan_runs(seed: int, runs: int, num_rollout: int) -> list[KillPlan]:
    """Run ``i``'s plan depends only on (``seed``, ``i``), so ``--seed S --only i`` replays it. Each block of
    ``len(TARGETS)`` runs kills every target once, half of them mid-save, in a seeded order."""
    plans = []
    for i in range(runs):
        block = random.Random(f"soak-block/{seed}/{i // len(TARGETS)}")
        targets = list(TARGETS)
        block.shuffle(targets)
        moments = [MOMENTS[j % len(MOMENTS)] for j in range(len(TARGETS))]
        block.shuffle(moments)
        rng = random.Random(f"soak-run/{seed}/{i}")
        plans.append(
            KillPlan(
                run=i,
                seed=seed,
                mode=MODES[rng.randrange(len(MODES))],
                target=targets[i % len(TARGETS)],
                moment=moments[i % len(TARGETS)],
                # A save follows every step (--save-interval 1), so a mid-save kill needs one still to come.
                after_step=rng.randrange(0, max(1, num_rollout - 1)),
                delay_s=round(rng.uniform(0.0, 1.0), 2),
                pick=rng.randrange(1000),
            )
        )
    return plans


# -- checkpoints ---------------------------------------------------------------------------------------------------


def expected_parts(num_train_workers: int, roles: tuple[str, ...] = ("actor",)) -> list:
    """The files a complete torch-backend iteration folder holds (``backends/fsdp/worker.py`` ``save``,
    ``ray/rollout_executor.py`` ``save``), relative to the folder."""
    parts = ["COMPLETE", STATE_FILE]
    for role in roles:
        # backends/fsdp/checkpoint.py: DCP's metadata and one shard file per rank (optimizer state included).
        parts += [f"{role}/dcp/.metadata", f"{role}/train_state.pt"]
        parts += [f"{role}/dcp/__{r}_0.distcp" for r in range(num_train_workers)]
        parts += [f"{role}/rng_rank{r}.pt" for r in range(num_train_workers)]
    return parts


def read_pointer(save_dir: str | Path) -> int | None:
    """The iteration the pointer names, or None when there is none (yet)."""
    try:
        text = (Path(save_dir) / POINTER).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else -1  # -1: unreadable, reported by pointer_problem


def pointer_problem(save_dir: str | Path, parts: list[str]) -> str | None:
    """What is wrong with the checkpoint the pointer names (None: no pointer, or a complete folder)."""
    rollout_id = read_pointer(save_dir)
    if rollout_id is None:
        return None
    if rollout_id < 0:
        return f"{POINTER} does not hold an iteration number"
    folder = iteration_dir(save_dir, rollout_id)
    missing = [p for p in parts if not (folder / p).is_file() or ((folder / p).stat().st_size == 0 and p != "COMPLETE")]
    if missing:
        return f"pointer names {rollout_id}, whose folder {folder.name} lacks {', '.join(missing)}"
    return None


def saves_in_progress(save_dir: str | Path) -> list[str]:
    """Iteration folders without their COMPLETE marker: a save under way (or one a kill cut short)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    return sorted(p.name for p in save_dir.glob("iter_*") if p.is_dir() and not (p / "COMPLETE").exists())


# -- the trained prompts -----------------------------------------------------------------------------------------------


def lineage(attempts: list[list[dict]], loaded: list[int | None]) -> list[dict]:
    """The rollouts the finished model was trained on: from each attempt those up to the checkpoint the next attempt
    loaded (none when it started from scratch), then all of the last attempt's. ``attempts[k]`` is attempt ``k``'s
    rollouts.jsonl, ``loaded[k]`` the iteration it resumed from (None: from scratch)."""
    rows = []
    for k, rollouts in enumerate(attempts):
        if k + 1 < len(attempts):
            upto = loaded[k + 1]
            rows += [r for r in rollouts if upto is not None and r["rollout_id"] <= upto]
        else:
            rows += rollouts
    return rows


def exactly_once_problems(rows: list[dict], num_rollout: int, batch_size: int, num_prompts: int) -> list[str]:
    """Empty when the lineage trained rollouts 0..num_rollout-1 once each and every prompt of each epoch once, with
    no epoch before the last one seen left incomplete. One-step-off logs no epochs: its epoch follows from the
    rollout id (drop_last batches)."""
    problems = []
    ids = [r["rollout_id"] for r in rows]
    if sorted(ids) != list(range(num_rollout)):
        counts = Counter(ids)
        missing = [i for i in range(num_rollout) if i not in counts]
        twice = sorted(i for i, c in counts.items() if c > 1)
        problems.append(f"rollout ids: missing {missing}, trained twice {twice}")
    per_epoch_rollouts = num_prompts // batch_size
    trained = []
    for r in rows:
        epochs = r.get("epochs") or [None] * len(r["uids"])
        trained += [
            (e if e is not None else r["rollout_id"] // per_epoch_rollouts, u) for e, u in zip(epochs, r["uids"])
        ]
    twice = sorted({k for k, c in Counter(trained).items() if c > 1})
    if twice:
        problems.append(f"{len(twice)} (epoch, prompt) trained more than once, e.g. {twice[:3]}")
    if len(trained) != num_rollout * batch_size:
        problems.append(f"{len(trained)} prompts trained, expected {num_rollout * batch_size}")
    per_epoch = Counter(e for e, _ in trained)
    short = {e: per_epoch[e] for e in range(max(per_epoch, default=0)) if per_epoch[e] != num_prompts}
    if short:
        problems.append(f"epochs left incomplete (epoch: prompts trained of {num_prompts}): {short}")
    return problems


def replay_problems(attempts: list[list[dict]], loaded: list[int | None]) -> list[str]:
    """One-step-off draws each rollout's prompts as a pure function of its id, so a rollout that an attempt generated
    past the checkpoint the next attempt loaded must come back with the same prompts (a resume that skipped or
    repeated a batch of the data shifts them). Not for --fully-async, whose batches follow completion order."""
    problems = []
    for k in range(1, len(attempts)):
        before = {r["rollout_id"]: r["uids"] for r in attempts[k - 1]}
        for r in attempts[k]:
            if r["rollout_id"] in before and sorted(before[r["rollout_id"]]) != sorted(r["uids"]):
                problems.append(
                    f"rollout {r['rollout_id']} regenerated by attempt {k} (loaded {loaded[k]}) drew other prompts "
                    f"than attempt {k - 1}: {r['uids']} != {before[r['rollout_id']]}"
                )
    return problems
