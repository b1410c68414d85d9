"""Flags that Miles', slime's and Megatron-LM's launchers pass and that do not take effect here.

Each parses, so a launcher never stops at "unrecognized arguments". A flag that is harmless to drop (logging,
memory management, kernel switches, colocated-mode offload) is accepted and named once in a warning that says
why it does nothing (``declare.flag(..., ignored=...)``). A flag that changes what Miles computes and has no
implementation here is refused when given, with what is missing or what to use instead (``refused=...``):
silently dropping it would train something else. ``--colocate`` is refused too: asynchronous training cannot
share GPUs between the trainer and the engines, as Miles' train_async.py says.
"""

from __future__ import annotations

from typing import Any

from miles_async.config.declare import Flag, When, flag, group

MOE_ROUTER = (
    "where the router's softmax sits is config.json's (norm_topk_prob false: before the top-k, as "
    "--moe-router-pre-softmax; true, and Mixtral: over the top-k)"
)
OFFLOAD = "Miles' colocated-mode memory management; here the trainer and the engines never share a GPU"
PACKING = "micro-batches are packed to --max-tokens-per-gpu tokens (Miles' --use-dynamic-batch-size)"
FUSION = "a Megatron-LM kernel-fusion switch; the backend sets its own fusions"
WANDB = "log in with `wandb login` or WANDB_API_KEY / WANDB_BASE_URL / WANDB_ENTITY"


def _refuse_colocate(name: str, value: bool) -> str | None:
    return (
        (
            f"{name} is not supported for asynchronous training: the engines generate rollout N+1 while the trainer "
            f"trains on rollout N, so they cannot share GPUs (Miles' train_async.py refuses it too). Drop {name} "
            f"and give the engines their own GPUs (--rollout-num-gpus)"
        )
        if value
        else None
    )


def _switch(name: str, why: str):
    return flag(name, action="store_true", ignored=why)


def _value(name: str, why: str, type_: Any = str, nargs: str | None = None):
    options: dict[str, Any] = {"type": type_, "default": None}
    if nargs:
        options["nargs"] = nargs
    return flag(name, ignored=why, **options)


def _spelled(spec: str) -> tuple[str, dict[str, Any]]:
    """``--name`` a switch, ``--name=`` one value, ``--name+`` / ``--name*`` / ``--name?`` argparse's nargs."""
    if spec[-1] in "=+*?":
        name, nargs = spec[:-1], spec[-1]
        options: dict[str, Any] = {"default": None}
        if nargs != "=":
            options["nargs"] = nargs
        return name, options
    return spec, {"action": "store_true"}


def ignored(why: str, *specs: str) -> tuple[Flag, ...]:
    """Flags accepted with a warning naming ``why`` they do nothing here."""
    return tuple(flag(name, ignored=why, **options) for name, options in map(_spelled, specs))


def refused(why: str, *specs: str) -> tuple[Flag, ...]:
    """Flags that parse and are refused when given, saying ``why``."""
    return tuple(flag(name, refused=why, **options) for name, options in map(_spelled, specs))


NOT_YET = "not implemented here yet: "
MODEL = NOT_YET + "{} (a model-family feature this project does not build)"
DELTA = (
    NOT_YET + "delta weight transfer (only changed tensors, through disk); the engines take the whole policy "
    "each update here (--weight-update-method)"
)
OPD = NOT_YET + "on-policy distillation (a teacher's log-probs in the advantage or the loss)"
EVAL = (
    NOT_YET + "{}; evaluation here is --eval-prompt-data with --eval-interval, --n-samples-per-eval-prompt and "
    "--eval-max-response-len, read with --input-key / --label-key"
)
LOW_PRECISION = NOT_YET + "FP8/FP4 training (the trainer computes in --bf16 or float32)"
LORA = (
    NOT_YET + "LoRA on the megatron backend and Miles' LoRA serving; the torch backend trains adapters with "
    "--lora-rank, --lora-alpha and --lora-target-modules"
)
AGENT = NOT_YET + "Miles' agentic generate functions and session server; give --custom-generate-function-path"
LR = NOT_YET + "{}; the schedule is --lr-warmup-iters, --lr-decay-style and --lr-decay-iters"
DEBUG_DATA = NOT_YET + "saving and replaying rollout data for debugging (--debug-exit-after-rollout stops early)"
PLUGIN = NOT_YET + "the {} plugin point{}"
FT = "fault tolerance here is --use-fault-tolerance (engines restarted and reseeded), with --max-engine-restarts"
MEMORY = "a memory-saving switch; the trainer's memory here is set by --max-tokens-per-gpu and its offload flags"
KERNEL = (
    "a kernel or communication-layout switch; the backend picks its own kernels, and the result is the same up to "
    "rounding"
)
CHECKS = "one of Miles' CI self-checks; this project's checks are its test suite and --check-weight-update-equal"
PROFILE = "Miles' profiling and memory-recording hooks; none here (run py-spy or torch.profiler outside)"
DUMP = "Miles' tensor and data dumps for post-hoc analysis; none are written here (metrics go to --output-dir)"
TELEMETRY = "a dashboard or metrics exporter this project does not run (metrics go to W&B, TensorBoard, --output-dir)"
ROUTER = (
    "a setting of Miles' SGLang router; here --rollout-router routes, and the policy decides only which engine "
    "serves a request, not what it generates"
)
ROPE = (
    "rope positions come from --position-embedding-type rope and add no learned position table, so there is "
    "none to leave out"
)


def _rope(ns: Any) -> bool:
    return ns.position_embedding_type == "rope" or bool(ns.use_rotary_position_embeddings)


def _transfer_mode(name: str, value: str | None) -> str | None:
    if value in (None, "broadcast"):
        return None
    return f"{name} {value} is refused: " + (DELTA if "delta" in value else NOT_YET + "peer-to-peer weight transfer")


def _loss_type(name: str, value: str | None) -> str | None:
    if value in (None, "policy_loss"):
        return None
    if value == "sft_loss":
        return f"{name} sft_loss is refused: {NOT_YET}supervised fine-tuning through the RL loop"
    return f"{name} {value} is refused: {PLUGIN.format('custom loss function', '')}"


# One --help heading for both: what Miles', slime's and Megatron-LM's launchers pass that does not take effect here.
TITLE = "from Miles, slime and Megatron-LM launchers: accepted without effect, or refused with the reason"
REFUSED = group(
    TITLE,
    flag(
        "--update-weight-transfer-mode",
        choices=("broadcast", "p2p", "disk-delta"),
        default=None,
        check=_transfer_mode,
        help="Miles' spelling of how weights reach the engines; slime's is --update-weight-mode with "
        "--update-weight-transport (disk-delta = delta over disk). Here: broadcast is accepted with a warning, p2p "
        "and disk-delta are refused",
        ignored="broadcast is how --weight-update-method distributed sends weights; p2p and disk-delta are refused",
    ),
    flag(
        "--update-weight-mode",
        choices=("full", "delta"),
        default=None,
        check=lambda name, v: f"{name} delta is refused: {DELTA}" if v == "delta" else None,
        help="slime's spelling (with --update-weight-transport) of Miles' --update-weight-transfer-mode. Here: full "
        "is accepted with a warning, delta is refused",
        ignored="full updates are the only kind here (slime's spelling; delta is refused)",
    ),
    flag(
        "--update-weight-transport",
        choices=("nccl", "disk"),
        default=None,
        help="slime's transport of --update-weight-mode (Miles' --update-weight-transfer-mode); accepted with a "
        "warning",
        ignored="slime's transport: here it is --weight-update-method (distributed is NCCL, disk is disk)",
    ),
    *refused(
        DELTA,
        "--update-weight-delta-checksum=",
        "--update-weight-delta-encoding=",
        "--update-weight-disk-dir=",
        "--update-weight-local-checkpoint-dir=",
        "--custom-update-weight-post-write-path=",
    ),
    *ignored(
        "only with --update-weight-transfer-mode p2p, which is refused",
        "--p2p-transfer-num-workers=",
        "--p2p-transfer-timeout=",
    ),
    flag(
        "--loss-type",
        choices=("policy_loss", "sft_loss", "custom_loss"),
        default=None,
        check=_loss_type,
        ignored="policy_loss is the only loss here; sft_loss and custom_loss are refused",
    ),
    flag(
        "--no-position-embedding",
        action="store_true",
        needs=When("--position-embedding-type rope (a learned position table cannot be left out here)", _rope),
        ignored=ROPE,
    ),
    *refused(
        OPD,
        "--use-opd",
        "--opd-type=",
        "--opd-kl-coef=",
        "--opd-teacher-load=",
        "--opd-teacher-ckpt-step=",
        "--opd-log-prob-top-k=",
        "--opd-reward-weight-mode=",
        "--opd-teacher-key=",
        "--opd-teacher-urls+",
        "--opd-top-k-strategy=",
        "--opd-topk-per-position",
    ),
    *refused(EVAL.format("Miles' YAML of eval datasets"), "--eval-config="),
    *refused(
        EVAL.format("Miles' per-dataset eval settings"),
        "--eval-function-path=",
        "--eval-input-key=",
        "--eval-label-key=",
        "--eval-tool-key=",
        "--eval-reward-key=",
        "--eval-top-k=",
        "--eval-max-prompt-len=",
        "--eval-max-context-len=",
        "--eval-min-new-tokens=",
    ),
    *refused(
        EVAL.format("a dedicated eval engine fleet (evals run on the rollout engines)"),
        "--eval-num-gpus=",
        "--eval-num-gpus-per-engine=",
        "--eval-hf-dir=",
        "--eval-keep-snapshots=",
    ),
    flag(
        "--eval-overflow-policy",
        choices=("backpressure", "skip"),
        default=None,
        check=lambda name, v: f"{name} skip is refused: {NOT_YET}skipping a due eval" if v == "skip" else None,
        ignored="a due eval waits for a slot of --max-in-flight-evals here (backpressure); skip is refused",
    ),
    *refused("use --async-max-concurrent-groups (groups of --n-samples-per-prompt)", "--async-max-concurrent-samples="),
    *refused("use --api-server-port (the control API here)", "--control-server-port="),
    *refused("use --max-staleness-steps (how far generation may run ahead)", "--async-data-buffer-capacity-factor="),
    *refused("use --rollout-stop-token-ids (stop strings are not matched here)", "--rollout-stop+"),
    *refused(NOT_YET + "starting at a given rollout (a resume starts after --load's)", "--start-rollout-id="),
    *refused(NOT_YET + "rollouts without training", "--debug-rollout-only"),
    *refused(NOT_YET + "training without engines", "--debug-train-only"),
    *refused(
        DEBUG_DATA,
        "--save-debug-rollout-data=",
        "--load-debug-rollout-data=",
        "--load-debug-rollout-data-subsample=",
        "--load-forge-rollout-data=",
    ),
    *refused(
        NOT_YET + "injecting recorded rollout data",
        "--ci-inject-rollout-data-path=",
        "--ci-inject-rollout-data-min-match-ratio=",
        "--ci-inject-rollout-data-start-rollout-id=",
    ),
    *refused(NOT_YET + "engines started by someone else", "--rollout-external", "--rollout-external-engine-addrs+"),
    *refused(
        NOT_YET + "an external rollout buffer service", "--rollout-buffer-url=", "--fetch-trajectory-retry-times="
    ),
    *refused(NOT_YET + "SGLang prefill/decode disaggregation", "--prefill-num-servers="),
    *refused(
        FT,
        "--ft-components+",
        "--mini-ft-controller-enable",
        "--mini-ft-controller-poll-interval=",
        "--mini-ft-controller-resume-delay=",
        "--ci-ft-test-actions=",
    ),
    *refused(
        NOT_YET
        + "turning rewards normalization off (rewards are normalized per group as --advantage-estimator defines)",
        "--disable-rewards-normalization",
    ),
    *refused(
        NOT_YET + "Miles' unbiased (importance-weighted) KL; --kl-loss-type chooses the estimator here",
        "--use-unbiased-kl",
    ),
    *refused(NOT_YET + "fp16 training with loss scaling; use --bf16", "--fp16"),
    *refused(NOT_YET + "true on-policy mode (bitwise-matching engine and trainer kernels)", "--true-on-policy-mode"),
    *refused(NOT_YET + "deterministic kernels in the engines and the trainer", "--deterministic-mode"),
    *refused(
        NOT_YET + "off-policy sequence masking (OPSM); --use-tis corrects the gap here", "--use-opsm", "--opsm-delta="
    ),
    *refused(
        NOT_YET + "replaying the log-prob pass's routing in training; --use-rollout-routing-replay replays "
        "the engines' routing",
        "--use-routing-replay",
    ),
    *refused(
        NOT_YET + "DSA indexer replay and freezing",
        "--use-indexer-replay",
        "--use-rollout-indexer-replay",
        "--freeze-indexer",
    ),
    *refused(
        NOT_YET + "SFT and reward-free updates (advantages are always computed)",
        "--disable-compute-advantages-and-returns",
    ),
    *refused(NOT_YET + "resetting the optimizer each rollout", "--reset-optimizer-states"),
    *refused(
        NOT_YET + "refreshing or choosing the reference model's checkpoint step; the reference is --ref-load, "
        "else --hf-checkpoint",
        "--ref-update-interval=",
        "--ref-ckpt-step=",
    ),
    *refused(
        NOT_YET + "a partial last step, dynamic global batch sizes and batch collection ratios "
        "(each step is --global-batch-size samples)",
        "--allow-partial-train-step",
        "--use-dynamic-global-batch-size",
        "--min-batch-collection-ratio=",
        "--disable-rollout-trim-samples",
        "--rollout-submission-granularity=",
        "--async-unused-samples-handler=",
    ),
    *refused(
        NOT_YET + "sampling prompts from several datasets without the global dataset",
        "--disable-rollout-global-dataset",
    ),
    *refused(NOT_YET + "independent data-parallel Megatron instances", "--indep-dp"),
    *refused(
        NOT_YET + "a context-length cap on the engines (prompts are cut at --rollout-max-prompt-len, responses "
        "at --rollout-max-response-len)",
        "--rollout-max-context-len=",
    ),
    *refused(
        NOT_YET + "recomputing rollout log-probs by prefill, or skipping the trainer's forward-only pass",
        "--recompute-logprobs-via-prefill",
        "--skip-actor-forward-only",
    ),
    *refused(
        NOT_YET + "dropping zero-reward samples; --dynamic-sampling-filter-path takes a filter function",
        "--filter-zero-reward-samples",
    ),
    *refused(
        NOT_YET + "environment variables for the trainer alone. The Ray cluster a run starts gives its workers "
        "train_async.py's environment (set them there); a cluster it joins (--ray-address) gives them its `ray start` "
        "environment",
        "--train-env-vars=",
    ),
    *refused(NOT_YET + "a custom chat template file (the tokenizer's own template applies)", "--chat-template-path="),
    *refused(NOT_YET + "tools read from the dataset; give --tools-path", "--tool-key=", "--tito-model="),
    *refused(NOT_YET + "keeping special tokens out of responses", "--rollout-skip-special-tokens"),
    *refused(NOT_YET + "a separate critic save folder (the critic is saved with --save)", "--critic-save="),
    *refused(
        LR.format("warmup as a fraction, warmup from an initial LR, and WSD decay"),
        "--lr-warmup-fraction=",
        "--lr-warmup-init=",
        "--lr-wsd-decay-iters=",
        "--lr-wsd-decay-style=",
        "--warmup-ratio=",
    ),
    *refused(
        NOT_YET + "overriding the LR schedule a checkpoint carries (a resume continues it)",
        "--use-checkpoint-lr-scheduler",
        "--override-lr-scheduler",
    ),
    *refused(
        NOT_YET + "Megatron-LM's finetune start and partial loads; --load resumes model, optimizer and RNG "
        "together, and an empty --load folder starts fresh",
        "--finetune",
        "--no-load-optim",
        "--no-load-rng",
    ),
    *refused(NOT_YET + "the Muon optimizer (--optimizer adam or sgd)", "--muon-momentum="),
    *refused(PLUGIN.format("custom loss function", ""), "--custom-loss-function-path="),
    *refused(
        PLUGIN.format("advantage function", "; --advantage-estimator chooses it here"),
        "--custom-advantage-function-path=",
    ),
    *refused(PLUGIN.format("per-sample rollout hook", ""), "--rollout-sample-hook-path+"),
    *refused(NOT_YET + "a structured YAML of Megatron roles; give the flags (or --config)", "--megatron-config-path="),
    *refused(
        NOT_YET + "debug runs without an optimizer or without weight updates",
        "--debug-disable-optimizer",
        "--debug-skip-weight-update",
    ),
    *refused(
        NOT_YET + "a stateless Adam and Adam moments stored below fp32 (they stay fp32 here)",
        "--use-stateless-adam",
        "--stream-optimizer-state-moment-dtype=",
    ),
    *refused(
        "the gradient-reduction dtype is --accumulate-allreduce-grads-in-fp32's choice here", "--grad-reduce-in-bf16"
    ),
    *refused(
        PLUGIN.format("TIS/RS function", "; --use-tis with --tis-mode and --tis-level correct the gap here"),
        "--custom-tis-function-path=",
    ),
    *refused(
        PLUGIN.format("pg-loss reducer", "; --loss-agg-mode chooses the reduction here"),
        "--custom-pg-loss-reducer-function-path=",
    ),
    *refused(PLUGIN.format("samples-to-train-data", ""), "--custom-convert-samples-to-train-data-path="),
    *refused(
        PLUGIN.format(
            "reward post-process", "; --disable-grpo-std-normalization and --normalize-advantages shape the advantage"
        ),
        "--custom-reward-post-process-path=",
    ),
    *refused(
        PLUGIN.format("sample filter", "; --dynamic-sampling-filter-path takes a group filter here"),
        "--rollout-sample-filter-path=",
        "--rollout-all-samples-process-path=",
        "--buffer-filter-path=",
    ),
    *refused(PLUGIN.format("rollout-data post-process", ""), "--rollout-data-postprocess-path="),
    *refused(
        PLUGIN.format("rollout log function", ""),
        "--custom-rollout-log-function-path=",
        "--custom-eval-rollout-log-function-path=",
    ),
    *refused(PLUGIN.format("data buffer", ""), "--custom-async-data-buffer-path="),
    *refused(
        PLUGIN.format("Megatron init, hook and model-provider", ""),
        "--custom-megatron-init-path=",
        "--custom-megatron-before-log-prob-hook-path=",
        "--custom-megatron-before-train-step-hook-path=",
        "--custom-megatron-post-save-hook-path=",
        "--custom-model-provider-path=",
    ),
    *refused(
        NOT_YET + "Miles' YAML that overrides flags and adds its plugins' settings; --config takes a YAML of this "
        "project's flags (the command line wins over it)",
        "--custom-config-path=",
    ),
    *refused(
        AGENT,
        "--custom-agent-function-path=",
        "--generate-execute-tool-function-path=",
        "--generate-tool-call-parser=",
        "--generate-tool-specs-path=",
        "--max-seq-len=",
        "--use-session-server?",
        "--session-server-ip=",
        "--session-server-port+",
        "--session-message-matcher=",
        "--session-sample-picker-path=",
        "--session-sample-postprocessor-path=",
    ),
    *refused(
        LORA,
        "--target-modules=",
        "--exclude-modules=",
        "--lora-type=",
        "--lora-adapter-path=",
        "--lora-sync-from-tensor",
        "--lora-train-only",
        "--experts-shared-outer-loras",
        "--multi-lora-adapter+",
        "--multi-lora-api-port=",
        "--multi-lora-backend-path=",
        "--multi-lora-disable-service-mode",
        "--multi-lora-http-server-path=",
        "--multi-lora-idle-poll-s=",
        "--multi-lora-max-adapter-global-batch-size=",
        "--multi-lora-max-coalesce-wait-s=",
        "--multi-lora-max-empty-wait-s=",
        "--multi-lora-n-adapters=",
        "--no-sglang-lora-use-virtual-experts",
    ),
    *refused(
        LOW_PRECISION,
        "--fp8-format=",
        "--fp8-recipe=",
        "--fp8-param-gather",
        "--fp4-format=",
        "--fp4-recipe=",
        "--first-last-layers-bf16",
        "--num-layers-at-start-in-bf16=",
        "--num-layers-at-end-in-bf16=",
        "--te-precision-config-file=",
        "--reuse-grad-buf-for-mxfp8-param-ag",
        "--extra-high-precision-layers-hf*",
        "--extra-high-precision-layers-megatron*",
        "--megatron-deepgemm-forward-layers+",
        "--megatron-deepgemm-forward-modules+",
        "--megatron-deepgemm-moe-forward-layers+",
        "--megatron-deepgemm-moe-forward-modules+",
    ),
    *refused(
        MODEL.format("multi-token prediction (MTP) layers"),
        "--mtp-num-layers=",
        "--mtp-loss-scaling-factor=",
        "--enable-mtp-training",
    ),
    *refused(MODEL.format("gated attention output"), "--attention-output-gate", "--use-gated-attention"),
    *refused(MODEL.format("zero-centred (1p) layer norms"), "--apply-layernorm-1p"),
    *refused(
        MODEL.format("YaRN rope scaling"),
        "--rope-type=",
        "--beta-fast=",
        "--beta-slow=",
        "--original-max-position-embeddings=",
    ),
    *refused(MODEL.format("interleaved rotary embeddings"), "--rotary-interleaved"),
    *refused(
        MODEL.format("gpt-oss' learnable softmax, sliding windows and clamped activations"),
        "--softmax-type=",
        "--window-size=",
        "--window-attn-skip-freq=",
        "--activation-func-clamp-value=",
        "--no-activation-func-clamp-shared-expert",
    ),
    *refused(MODEL.format("latent MoE projections (Nemotron-3)"), "--moe-latent-size="),
    *refused(
        MODEL.format("DeepSeek sparse attention (DSA) and DeepSeek-V4's attention"),
        "--dsa-attention-backend=",
        "--dsa-indexer-head-dim=",
        "--dsa-indexer-n-heads=",
        "--dsa-indexer-topk=",
        "--miles-dsa-topk-backend=",
        "--experimental-attention-variant=",
        "--enable-experimental",
        "--dsv4-compress-ratios*",
        "--dsv4-compress-rope-theta*",
        "--dsv4-hc-mult*",
        "--dsv4-hc-sinkhorn-iters*",
        "--dsv4-n-hash-layers*",
        "--dsv4-o-groups*",
        "--dsv4-o-lora-rank*",
        "--dsv4-window-size*",
    ),
    *refused(
        MODEL.format("GLM-4's extra post-attention and post-MLP layer norms"),
        "--post-mlp-layernorm",
        "--post-self-attn-layernorm",
    ),
    *refused(
        MODEL.format("frozen MoE router gates and score-correction biases"),
        "--moe-router-freeze-gate",
        "--freeze-e-score-correction-bias",
    ),
)

IGNORED = (
    *ignored(
        "Megatron's weights go to the engines through mbridge's conversion tables here (Miles' bridge mode); the "
        "engines receive the same HF weights in either mode",
        "--megatron-to-hf-mode=",
    ),
    *ignored("the converter is chosen by config.json's model_type", "--model-name="),
    *ignored("every --save-interval checkpoint is kept here; none is deleted", "--save-retain-interval="),
    *ignored(
        "the W&B run is named --wandb-run-name as given; no random suffix is added here",
        "--disable-wandb-random-suffix",
    ),
    *ignored("set WANDB_MODE / WANDB_DIR in the environment; W&B reads them", "--wandb-mode=", "--wandb-dir="),
    *ignored(
        "each metric's x axis in W&B is its own step key here (rollout or train step)", "--wandb-always-use-train-step"
    ),
    *ignored("TensorBoard's folder is --tensorboard-dir", "--tb-project-name=", "--tb-experiment-name="),
    *ignored(
        "MLflow is not a tracker here (--use-wandb, --use-tensorboard)",
        "--use-mlflow",
        "--mlflow-experiment-name=",
        "--mlflow-run-id=",
        "--mlflow-run-name=",
        "--mlflow-tracking-uri=",
    ),
    *ignored(
        TELEMETRY,
        "--use-miles-dashboard",
        "--dashboard-gpu-sample-interval=",
        "--dashboard-sglang-scrape-mode=",
        "--dashboard-sglang-scrape-interval=",
        "--dashboard-sglang-metrics=",
        "--dashboard-flush-interval=",
        "--dashboard-forward-prometheus",
        "--use-prometheus",
        "--prometheus-port=",
        "--prometheus-run-name=",
        "--mfu-peak-tflops=",
        "--env-report=",
    ),
    *ignored(
        "an extra log line of Miles' that is not written here",
        "--log-multi-turn",
        "--log-correct-samples",
        "--log-reward-category=",
        "--log-passrate",
        "--get-mismatch-metrics",
        "--observe-training-entropy",
        "--use-rollout-entropy",
    ),
    *ignored(
        DUMP,
        "--dump-details=",
        "--save-debug-train-data=",
        "--save-debug-trajectory-data=",
        "--save-debug-event-data=",
        "--dumper-enable",
        "--dumper-dir=",
        "--dumper-inference*",
        "--dumper-fwd-only*",
        "--dumper-fwd-bwd*",
        "--dumper-source-patcher-config-inference=",
        "--dumper-source-patcher-config-train=",
    ),
    *ignored(
        PROFILE,
        "--use-pytorch-profiler",
        "--profile-step-start=",
        "--profile-step-end=",
        "--profile-target+",
        "--record-memory-history",
        "--memory-recorder=",
        "--memory-snapshot-dir=",
        "--memory-snapshot-num-steps=",
        "--memory-snapshot-path=",
    ),
    *ignored(
        CHECKS,
        "--ci-test",
        "--ci-check-model-hash",
        "--ci-save-model-hash",
        "--ci-disable-kl-checker",
        "--ci-disable-logprobs-checker",
        "--ci-disable-weight-update-checker",
        "--ci-metric-checker-key=",
        "--ci-metric-checker-threshold=",
        "--ci-save-grad-norm=",
        "--ci-load-grad-norm=",
        "--enable-event-analyzer",
        "--enable-witness",
        "--witness-buffer-size=",
        "--save-local-weight-checksum",
        "--check-rematerialize-param-from-master-weight",
        "--ci-train-rollout-logprob-abs-diff-threshold=",
        "--debug-deterministic-collective",
    ),
    *ignored(
        "--check-weight-update-equal compares every weight exactly here",
        "--check-weight-update-selector=",
        "--check-weight-update-skip-list*",
        "--check-weight-update-allow-quant-error",
        "--check-lora-weight-equal",
    ),
    *ignored(
        OFFLOAD,
        "--offload",
        "--offload-train-target=",
        "--offload-train-disk-dir=",
        "--offload-train-disk-chunk-mb=",
        "--rematerialize-param-from-master-weight",
        "--lora-base-cpu-backup",
        "--stream-optimizer-state-to-disk",
        "--release-train",
    ),
    *ignored(
        MEMORY,
        "--recompute-loss-function",
        "--log-probs-max-tokens-per-gpu=",
        "--fsdp-state-dict-cpu-offload",
        "--fsdp-cpu-backend=",
        "--dp-replicate-size=",
    ),
    *ignored(PACKING, "--balance-by-flops", "--data-pad-size-multiplier=", "--delay-split-train-data-by-dp"),
    *ignored(
        KERNEL,
        "--attn-implementation=",
        "--qkv-format=",
        "--allgather-cp",
        "--cp-comm-type=",
        "--linear-attention-backend=",
        "--use-flash-attn",
        "--moe-flex-dispatcher-backend=",
        "--no-bias-dropout-fusion",
        "--no-bias-swiglu-fusion",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--use-distributed-post",
        "--qwen-gdn-backend=",
    ),
    *ignored("the trainer's collectives keep the backend's own timeout", "--distributed-timeout-minutes="),
    *ignored(
        "the rollout executor (Miles' rollout manager) is a Ray actor Ray places; where it runs changes no result",
        "--pin-rollout-manager-to-head",
    ),
    *ignored(
        "engines and reward servers are reached directly here, through no proxy",
        "--http-proxy=",
    ),
    *ignored(
        "an engine's health is checked once it has started (--engine-startup-timeout bounds the start)",
        "--rollout-health-check-first-wait=",
    ),
    *ignored("the disk weight files are removed once the engines have loaded them", "--update-weight-disk-keep-files"),
    *ignored(
        ROUTER,
        "--use-miles-router",
        "--miles-router-health-check-failure-threshold=",
        "--miles-router-max-connections=",
        "--miles-router-timeout=",
        "--router-policy=",
        "--router-prefill-policy=",
        "--router-decode-policy=",
        "--router-assignment-mode=",
        "--router-health-check-interval-secs=",
        "--router-health-failure-threshold=",
        "--router-health-success-threshold=",
    ),
    *ignored(
        "rollout data passes between processes through Ray's object store here",
        "--object-store-backend=",
        "--rollout-data-transport=",
        "--mooncake-replica-num=",
        "--mooncake-store-init-kwargs=",
    ),
)


GROUPS = (
    group(
        "cluster",
        flag(
            "--colocate",
            action="store_true",
            check=_refuse_colocate,
            refused="asynchronous training keeps the trainer and the engines on separate GPUs",
        ),
        _value(
            "--num-gpus-per-node", "the GPUs of each group are --actor-num-gpus-per-node and --rollout-num-gpus", int
        ),
        _value("--train-memory-margin-bytes", OFFLOAD, int),
        _switch("--offload-train", OFFLOAD),
        _switch("--no-offload-train", OFFLOAD),
        _switch("--offload-rollout", OFFLOAD),
        _switch("--no-offload-rollout", OFFLOAD),
        _value("--offload-rollout-level", OFFLOAD, nargs="+"),
    ),
    REFUSED,
    group(
        TITLE,
        _switch(
            "--balance-data",
            "each optimizer step's samples are dealt to the data-parallel ranks in turn; "
            "micro-batches are then packed by tokens",
        ),
        _value("--micro-batch-size", PACKING, int),
        _value("--seq-length", PACKING + "; each sample keeps its own length", int),
        _value("--log-probs-chunk-size", "log-probs are computed per packed micro-batch", int),
        _switch(
            "--calculate-per-token-loss",
            "the loss is aggregated by --loss-agg-mode (token_mean by default: per token over the whole step)",
        ),
        _value("--loss-mask-type", "the loss mask comes with each sample from its generation"),
        _switch("--no-check-for-nan-in-loss-and-grad", "a non-finite loss is not checked separately here"),
        _switch("--no-gradient-accumulation-fusion", FUSION),
        _switch("--no-rope-fusion", FUSION),
        _switch("--no-masked-softmax-fusion", FUSION),
        _value(
            "--spec",
            "the layer spec is Transformer Engine's when it is installed, else Megatron's local one",
            nargs="+",
        ),
        _value(
            "--transformer-impl",
            "the layer spec is Transformer Engine's when it is installed, else Megatron's local one",
        ),
        _value("--wandb-key", WANDB),
        _value("--wandb-host", WANDB),
        _value("--wandb-team", WANDB),
        _value("--wandb-run-id", "the run's name is --wandb-run-name"),
        _switch("--moe-router-pre-softmax", MOE_ROUTER),
        _switch("--moe-shared-expert-gate", "the shared expert's sigmoid gate is config.json's (Qwen2-MoE has one)"),
        _switch(
            "--moe-enable-deepep",
            "DeepEP is what --moe-token-dispatcher-type flex dispatches with (megatron-core's default backend)",
        ),
        *IGNORED,
    ),
)
