"""TRL's GRPOTrainer on the quickstart task, run by the TRL environment's python (scripts/setup_trl_env.sh).

    $TRL_ENV/bin/python benchmarks/trl_grpo_runner.py --model M --train train.jsonl --eval eval.jsonl \\
        --steps 30 --eval-interval 10 --lr 1e-5 --seed 1234 --out DIR

``benchmarks/trl_peer.py`` derives every setting from the quickstart launcher
(scripts/run-smollm2-cpu-async.sh) and passes it here; the defaults below are the quickstart's own.
PYTHONPATH must hold the repository root: the reward is the project's ``integer_reward``
(miles_async/algorithms/reward_types.py, which imports only the standard library at the top).

Settings as ours: 8 prompts x 8 completions per step, one optimizer step per generation batch
(num_iterations=1, so PPO's ratio is 1 and clipping at epsilon=0.2 never binds, as in our
first pass over a batch), max 8 new tokens, temperature 1.0, top-p 1, no top-k, no KL (beta=0,
our --kl-loss-coef default), GRPO advantages normalised by the group std, the token-level loss
mean over the whole step (loss_type="dapo" = our --loss-agg-mode token_mean with one step per
rollout), AdamW with our betas (0.9, 0.98), eps 1e-8, no weight decay, our learning-rate schedule
(constant, or cosine down to --min-lr over --lr-decay-iters steps, by default the run), no warm-up,
gradient clipping at 1.0, no dropout, no gradient checkpointing, our run's precision (``--precision``:
bf16 = our --bf16, autocast with float32 weights and optimizer, where the CPU computes bf16 natively;
float32 where our run falls back to it), the chat template applied to the user message with the generation
prompt (TRL's conversational prompts = our --apply-chat-template).

What differs, because TRL does not offer ours:

- On-policy and synchronous: TRL generates with the weights it then trains (transformers
  ``generate`` in the trainer's process); ours trains step N while the engine generates rollout
  N+1 with weights one version old, corrected by truncated importance sampling (--use-tis,
  clip 2.0). TRL therefore needs no TIS.
- Advantage epsilon: TRL divides by (std + 1e-4), ours by (std + 1e-6): the same for any group
  whose rewards differ (0/1 rewards in a group of 8 have std >= 0.35).
- Data order: with ``--in-order`` (as ``benchmarks/trl_peer.py`` runs it) ``--train`` holds our run's
  prompts in the order our data source hands them out (--rollout-seed), and TRL takes them as they come,
  so step k of both trains on the same 8 prompts. Without it TRL shuffles them with its own sampler
  and --seed, and the prompts of step k differ.
- Generation precision: in bf16 our engine holds bf16 weights; TRL generates with the trainer's float32
  weights under bf16 autocast.
- Evaluation: ours runs in the background on the engine while training goes on; here it runs
  in-process between steps (the model's ``generate``, same protocol: every held-out prompt x 4
  samples, temperature 1.0, max 8 new tokens, the same reward), and its time is taken out of
  TRL's training clock, so TRL is not charged for it.

Output in --out: ``steps.jsonl`` (one row per optimizer step: step, step_seconds, reward_mean,
train_seconds = training wall time since the first step began, evaluations excluded, prompts = the
step's user messages in the order TRL drew them, and TRL's logged grad_norm, learning_rate and entropy) and
``evals.jsonl`` (step, accuracy, train_seconds when that eval's weights were ready, eval_seconds,
num_samples), both written as they happen.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the HF model folder")
    p.add_argument("--train", type=Path, required=True, help="train.jsonl ({prompt, label} per line)")
    p.add_argument("--eval", type=Path, required=True, help="held-out eval.jsonl")
    p.add_argument("--out", type=Path, required=True, help="output folder (steps.jsonl, evals.jsonl)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (our --num-rollout)")
    p.add_argument("--eval-interval", type=int, default=10, help="held-out eval every this many steps")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--lr-schedule", choices=("constant", "cosine"), default="cosine", help="our --lr-decay-style (no warm-up)"
    )
    p.add_argument("--min-lr", type=float, default=1e-6, help="our --min-lr: where the cosine ends")
    p.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="our --lr-decay-iters: the steps the cosine spans (default --steps); at least --steps",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--in-order",
        action="store_true",
        help="train on --train's prompts in file order, --prompts-per-step per step (our run's order), not shuffled",
    )
    p.add_argument("--prompts-per-step", type=int, default=8, help="our --rollout-batch-size")
    p.add_argument("--num-generations", type=int, default=8, help="our --n-samples-per-prompt")
    p.add_argument("--max-completion-length", type=int, default=8, help="our --rollout-max-response-len")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off (our -1)")
    p.add_argument("--epsilon", type=float, default=0.2, help="our --eps-clip")
    p.add_argument("--epsilon-high", type=float, default=None, help="our --eps-clip-high")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (our --kl-loss-coef)")
    p.add_argument("--entropy-coef", type=float, default=0.0)
    p.add_argument("--scale-rewards", choices=("group", "none"), default="group", help="none: Dr. GRPO")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="our --clip-grad")
    p.add_argument("--adam-beta1", type=float, default=0.9)
    p.add_argument("--adam-beta2", type=float, default=0.98)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--precision",
        choices=("bf16", "float32"),
        default="bf16",
        help="bf16: mixed precision (our --bf16: autocast, float32 weights); float32: our run without bf16",
    )
    p.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=8192,
        help="our --max-tokens-per-gpu: a step's rows go through the trainer in micro-batches of at most this many "
        "tokens (gradient accumulation, still one optimizer step); 0: all in one",
    )
    p.add_argument("--eval-samples", type=int, default=4, help="our --n-samples-per-eval-prompt")
    p.add_argument("--eval-temperature", type=float, default=1.0)
    p.add_argument("--eval-top-p", type=float, default=1.0)
    p.add_argument("--eval-max-new-tokens", type=int, default=8, help="our --eval-max-response-len")
    p.add_argument("--eval-batch-size", type=int, default=64, help="sequences per eval generate call")
    return p


def check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "eval_interval", "prompts_per_step", "num_generations", "max_completion_length"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
    if args.num_generations < 2:
        raise SystemExit("--num-generations must be at least 2: GRPO needs a group to compare against")
    if args.lr_decay_iters is not None and args.lr_decay_iters < args.steps:
        # HF's cosine climbs back past its span where ours holds --min-lr: only a span that outlasts the run matches.
        raise SystemExit(f"--lr-decay-iters {args.lr_decay_iters} must be at least --steps {args.steps}")
    for path in (args.model, args.train, args.eval):
        if not path.exists():
            raise SystemExit(f"{path} does not exist")


def decay_span(args: argparse.Namespace) -> int:
    """The optimizer steps the cosine spans: --lr-decay-iters, else the whole run."""
    return args.lr_decay_iters if args.lr_decay_iters is not None else args.steps


def micro_batch_rows(rows: int, longest: int, budget: int) -> int:
    """Rows per micro-batch: the most that divide the step's ``rows`` and fit ``budget`` tokens at ``longest``
    tokens a row (as our --max-tokens-per-gpu packs padded rows); all of them without a budget."""
    if budget <= 0:
        return rows
    fit = [d for d in range(1, rows + 1) if rows % d == 0 and d * longest <= budget]
    return max(fit, default=1)


def grpo_config_kwargs(args: argparse.Namespace, longest_prompt: int = 0) -> dict[str, Any]:
    """GRPOConfig's keyword arguments for our quickstart's settings (see the module docstring); ``longest_prompt``:
    the train set's longest prompt in tokens, for the micro-batches' token budget."""
    rows = args.prompts_per_step * args.num_generations
    per_device = micro_batch_rows(rows, longest_prompt + args.max_completion_length, args.max_tokens_per_micro_batch)
    return {
        "output_dir": str(args.out / "trl"),
        "max_steps": args.steps,
        # One generation batch = one optimizer step = prompts x generations completions, in micro-batches of our
        # token budget (TRL's steps_per_generation follows gradient_accumulation_steps: one generation a step). In
        # one micro-batch, 64 rows of ~330 tokens held ~20 GB of activations on a 24 GB machine.
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": rows // per_device,
        "num_generations": args.num_generations,
        "num_iterations": 1,
        "max_completion_length": args.max_completion_length,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "beta": args.beta,
        "epsilon": args.epsilon,
        "epsilon_high": args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        "entropy_coef": args.entropy_coef,
        "scale_rewards": args.scale_rewards,
        "loss_type": "dapo",
        "mask_truncated_completions": False,
        "learning_rate": args.lr,
        # HF's cosine_with_min_lr is ours: min + (lr - min) * (1 + cos(2 pi cycles * step / steps)) / 2, where
        # cycles = steps / (2 span) makes it cos(pi * step / span): our cosine over --lr-decay-iters.
        "lr_scheduler_type": "cosine_with_min_lr" if args.lr_schedule == "cosine" else "constant",
        **(
            {"lr_scheduler_kwargs": {"min_lr": args.min_lr, "num_cycles": 0.5 * args.steps / decay_span(args)}}
            if args.lr_schedule == "cosine"
            else {}
        ),
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "adam_beta1": args.adam_beta1,
        "adam_beta2": args.adam_beta2,
        "adam_epsilon": args.adam_eps,
        "weight_decay": args.weight_decay,
        "max_grad_norm": args.max_grad_norm,
        "disable_dropout": True,
        "gradient_checkpointing": False,
        "bf16": args.precision == "bf16",
        "fp16": False,
        "use_cpu": True,
        "seed": args.seed,
        "data_seed": args.seed,
        "shuffle_dataset": not args.in_order,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "eval_strategy": "no",
        "log_completions": False,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def longest_prompt(tokenizer: Any, rows: list[dict]) -> int:
    """The longest of the conversational ``rows``' prompts in tokens, with the chat template's generation prompt."""
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    return max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)


def eval_due(step: int, interval: int, last_step: int) -> bool:
    """Our schedule: before training (step 0), every ``interval`` steps and after the last step."""
    return step == 0 or step % interval == 0 or step == last_step


def read_records(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise SystemExit(f"{path}:{n}: not JSON ({e})") from e
        if "prompt" not in row or "label" not in row:
            raise SystemExit(f"{path}:{n}: needs 'prompt' and 'label'")
        rows.append(row)
    if not rows:
        raise SystemExit(f"{path} holds no records")
    return rows


def score(response: str, label: Any) -> float:
    from miles_async.algorithms.reward_types import integer_reward

    return integer_reward(response, label)


def integer_reward_func(completions: list, label: list, **_: Any) -> list[float]:
    """TRL's reward-function shape around our ``integer_reward``."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [score(t, lab) for t, lab in zip(texts, label, strict=True)]


class Recorder:
    """TRL callback: the training clock (evaluations excluded), per-step rows and the held-out evals."""

    def __init__(self, args: argparse.Namespace, eval_records: list[dict], tokenizer: Any) -> None:
        self.args = args
        self.eval_records = eval_records
        self.tokenizer = tokenizer
        self.t0: float | None = None
        self.excluded = 0.0
        self.last_step_end = 0.0
        self.pending: dict[int, dict] = {}
        self.step_prompts: list[str] = []
        args.out.mkdir(parents=True, exist_ok=True)
        self.steps_file = (args.out / "steps.jsonl").open("w")
        self.evals_file = (args.out / "evals.jsonl").open("w")

    def reward_func(self) -> Any:
        """``integer_reward_func`` that also keeps the step's prompts (user messages, in order) for steps.jsonl."""

        def integer_reward(completions: list, label: list, prompts: list | None = None, **_: Any) -> list[float]:
            if prompts is not None:
                texts = (p[-1]["content"] if isinstance(p, list) else p for p in prompts)
                self.step_prompts = list(dict.fromkeys(texts))  # each prompt once, num_generations in a row
            return integer_reward_func(completions, label)

        return integer_reward

    def train_seconds(self) -> float:
        return time.perf_counter() - self.t0 - self.excluded

    def evaluate(self, model: Any, step: int) -> None:
        import torch

        ready = 0.0 if self.t0 is None else self.train_seconds()
        t = time.perf_counter()
        tok = self.tokenizer
        texts, labels = [], []
        for r in self.eval_records:
            msgs = [{"role": "user", "content": r["prompt"]}]
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            texts += [text] * self.args.eval_samples
            labels += [r["label"]] * self.args.eval_samples
        rewards = []
        was_training = model.training
        model.eval()
        # A forked RNG: the evals neither use nor move the training's random stream.
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.args.precision == "bf16")
        with torch.random.fork_rng(), torch.no_grad(), bf16:
            torch.manual_seed(self.args.seed + step)
            bs = self.args.eval_batch_size
            for i in range(0, len(texts), bs):
                batch = texts[i : i + bs]
                enc = tok(batch, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
                out = model.generate(
                    **enc,
                    do_sample=True,
                    temperature=self.args.eval_temperature,
                    top_p=self.args.eval_top_p,
                    top_k=0,
                    max_new_tokens=self.args.eval_max_new_tokens,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
                for ids, lab in zip(out[:, enc["input_ids"].shape[1] :], labels[i : i + bs], strict=True):
                    rewards.append(score(tok.decode(ids, skip_special_tokens=True), lab))
        model.train(was_training)
        seconds = time.perf_counter() - t
        if self.t0 is not None:
            self.excluded += seconds
        row = {
            "step": step,
            "accuracy": sum(rewards) / len(rewards),
            "train_seconds": ready,
            "eval_seconds": seconds,
            "num_samples": len(rewards),
        }
        self.evals_file.write(json.dumps(row) + "\n")
        self.evals_file.flush()
        print(f"[trl] eval step {step}: accuracy {row['accuracy']:.3f} ({seconds:.1f} s)", file=sys.stderr, flush=True)

    def callback(self) -> Any:
        from transformers import TrainerCallback

        rec = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kw):
                rec.evaluate(model, 0)
                rec.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, model=None, **kw):
                now = rec.train_seconds()
                step = state.global_step
                rec.pending[step] = {
                    "step": step,
                    "step_seconds": now - rec.last_step_end,
                    "train_seconds": now,
                    "prompts": rec.step_prompts,
                }
                rec.last_step_end = now
                if eval_due(step, rec.args.eval_interval, rec.args.steps):
                    rec.evaluate(model, step)

            def on_log(self, args, state, control, logs=None, **kw):
                row = rec.pending.pop(state.global_step, None)
                if row is None or not logs or "reward" not in logs:
                    return
                row["reward_mean"] = logs["reward"]
                row["completion_mean_length"] = logs.get("completions/mean_length")
                # What the update was, beside what it earned: the per-step learning of the two sides compared.
                row["grad_norm"] = logs.get("grad_norm")
                row["learning_rate"] = logs.get("learning_rate")
                row["entropy"] = logs.get("entropy")
                rec.steps_file.write(json.dumps(row) + "\n")
                rec.steps_file.flush()
                print(
                    f"[trl] step {row['step']}: {row['step_seconds']:.1f} s, reward {row['reward_mean']:.3f}",
                    file=sys.stderr,
                    flush=True,
                )

        return _Callback()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    train, held_out = read_records(args.train), read_records(args.eval)
    if args.in_order and len(train) < args.steps * args.prompts_per_step:
        # TRL would start over at the top of the file, where our run draws a new epoch.
        raise SystemExit(
            f"--in-order: {args.train} holds {len(train)} prompts, fewer than --steps x --prompts-per-step "
            f"({args.steps} x {args.prompts_per_step})"
        )
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    # Conversational prompts: TRL applies the chat template with the generation prompt, as --apply-chat-template.
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "label": str(r["label"])} for r in train]
    dataset = Dataset.from_list(rows)
    recorder = Recorder(args, held_out, tokenizer)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[recorder.reward_func()],
        args=GRPOConfig(**grpo_config_kwargs(args, longest_prompt(tokenizer, rows))),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[recorder.callback()],
    )
    trainer.train()
    recorder.steps_file.close()
    recorder.evals_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
