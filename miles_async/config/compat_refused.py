"""Miles', slime's and Megatron-LM's flags that parse here and are refused when given: each changes what Miles
computes and has no implementation here, so dropping it silently would train something else. The message says
what is missing or what to use instead (``declare.flag(..., refused=...)``). ``ignored`` declares the harmless
ones, accepted with a warning; ``config/compat.py`` holds most of those and puts both under one --help heading.
"""

from __future__ import annotations

from typing import Any

from miles_async.config.declare import Flag, When, flag, group


def spelled(spec: str) -> tuple[str, dict[str, Any]]:
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
    return tuple(flag(name, ignored=why, **options) for name, options in map(spelled, specs))


def refused(why: str, *specs: str) -> tuple[Flag, ...]:
    """Flags that parse and are refused when given, saying ``why``."""
    return tuple(flag(name, refused=why, **options) for name, options in map(spelled, specs))


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
