"""Output tokens/s of the embedded engine (real server, over HTTP) against transformers' batched ``generate``.

Both sides run SmolLM2-135M-Instruct in the same dtype with one torch thread, on the same
chat-templated multiplication prompts, sampling at temperature 1 with no top-k/top-p, and
with EOS banned until ``max_new_tokens`` (``min_new_tokens == max_new_tokens``) so every
request yields exactly the same number of tokens on both sides. Only generated tokens count.

At concurrency ``c`` the engine gets ``n = max(c, min_requests)`` requests from ``c`` client
tasks that each send their next request as soon as the previous one returns (closed loop);
HF gets the same ``n`` prompts as ``n / c`` successive ``generate`` calls of batch ``c``.

Two prompt mixes: ``distinct`` (every request a different prompt) and ``grpo`` (each prompt
repeated ``GROUP`` times back to back, as GRPO sends a group; the engine prefills one copy).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import requests
import torch

from benchmarks.common import (
    DTYPES,
    engine_config,
    median,
    multiplication_prompts,
    running_engine,
    smollm2_path,
    table,
    torch_threads,
)
from miles_async.inference.auth import auth_headers

LEVELS = (1, 8, 32, 64)
GROUP = 8
THREADS = 1


def _sampling(max_new: int) -> dict:
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new, "min_new_tokens": max_new}


def _engine_stats(url: str, key) -> dict:
    return requests.get(url + "/get_load", headers=auth_headers(key), timeout=30).json()


def engine_run(url: str, key, prompts: list[list[int]], concurrency: int, max_new: int) -> tuple[int, float]:
    """(generated tokens, seconds) for ``prompts`` kept ``concurrency`` in flight."""
    from miles_async.inference.client import EngineClient

    async def go() -> tuple[int, float]:
        next_index = 0
        tokens = 0
        async with EngineClient(url, timeout=1200, api_key=key) as client:

            async def worker() -> None:
                nonlocal next_index, tokens
                while next_index < len(prompts):
                    i = next_index
                    next_index += 1
                    # return_logprob=True because that is what rollouts ask for.
                    out = await client.generate(prompts[i], _sampling(max_new), return_logprob=True)
                    tokens += len(out["output_ids"])

            t0 = time.perf_counter()
            await asyncio.gather(*[worker() for _ in range(concurrency)])
            return tokens, time.perf_counter() - t0

    return asyncio.run(go())


def hf_run(model, prompts: list[list[int]], batch: int, max_new: int, pad_id: int) -> tuple[int, float]:
    """(generated tokens, seconds) for ``prompts`` as successive left-padded ``generate`` calls of ``batch`` rows."""
    tokens = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=pad_id,
            )
        # Rows that stopped early are padded with pad_id; EOS is banned here, but count honestly anyway.
        tokens += int((out[:, width:] != pad_id).sum())
    return tokens, time.perf_counter() - t0


def _requests(mix: str, prompts: list[list[int]], concurrency: int, min_requests: int) -> list[list[int]]:
    n = max(concurrency, min_requests)
    if mix == "distinct":
        return prompts[:n]
    return [p for p in prompts[: n // GROUP] for _ in range(GROUP)]


def run(quick: bool, out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_async.rollout.generate import encode_prompt

    max_new = 16 if quick else 32
    dtypes = ["bfloat16"] if quick else ["bfloat16", "float32"]
    reps = 1 if quick else 2
    # c=1 finishes one request in about a second; a few back to back steady the number.
    min_requests = 4 if quick else 8
    model_path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    samples: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_tput_") as tmp, torch_threads(THREADS):
        data, texts = multiplication_prompts(Path(tmp))
        prompts = [encode_prompt(tok, t, True) for t in texts]
        assert len(prompts) >= max(LEVELS), "not enough distinct prompts"
        for dtype in dtypes:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).eval()
            cfg = engine_config(model_path, data, dtype, THREADS, max_running=max(LEVELS), out_dir=Path(tmp))
            with running_engine(cfg, Path(tmp) / f"logs_{dtype}") as eng:
                # First calls pay for lazy init and allocator growth on both sides; keep them out.
                engine_run(eng.url, eng.cfg.api_key, prompts[:8], 8, 4)
                hf_run(model, prompts[:8], 8, 4, pad_id)
                for rep in range(reps):
                    for mix in ("distinct", "grpo"):
                        for c in LEVELS:
                            if mix == "grpo" and c < GROUP:
                                continue  # a group of 8 cannot be in flight with fewer than 8 slots
                            reqs = _requests(mix, prompts, c, min_requests)
                            # Alternate who goes first so slow drift of a shared machine hits both sides alike.
                            order = ("engine", "hf") if rep % 2 == 0 else ("hf", "engine")
                            for side in order:
                                extra = {}
                                if side == "engine":
                                    before = _engine_stats(eng.url, eng.cfg.api_key)
                                    n_tok, secs = engine_run(eng.url, eng.cfg.api_key, reqs, c, max_new)
                                    after = _engine_stats(eng.url, eng.cfg.api_key)
                                    # How the engine batched the work: with every request arriving at once,
                                    # prefill batches stay few and decode steps ~ max_new per wave.
                                    extra = {
                                        k: after[k] - before[k]
                                        for k in ("prefill_batches", "decode_steps", "prefill_rows_deduplicated")
                                    }
                                else:
                                    n_tok, secs = hf_run(model, reqs, c, max_new, pad_id)
                                expected = len(reqs) * max_new
                                if n_tok != expected:
                                    raise RuntimeError(f"{side} generated {n_tok} tokens, expected {expected}")
                                samples.append(
                                    {
                                        "dtype": dtype,
                                        "mix": mix,
                                        "concurrency": c,
                                        "side": side,
                                        "rep": rep,
                                        "requests": len(reqs),
                                        "tokens": n_tok,
                                        "seconds": round(secs, 4),
                                        "tokens_per_s": round(n_tok / secs, 2),
                                        **extra,
                                    }
                                )
                                print(
                                    f"  {dtype} {mix:8s} c={c:2d} {side:6s} {n_tok / secs:7.1f} tok/s "
                                    f"({n_tok} tok, {secs:.2f} s) {extra or ''}",
                                    flush=True,
                                )
            del model

    summary = []
    for dtype in dtypes:
        for mix in ("distinct", "grpo"):
            for c in LEVELS:
                pick = [s for s in samples if (s["dtype"], s["mix"], s["concurrency"]) == (dtype, mix, c)]
                if not pick:
                    continue
                engine_side = [s for s in pick if s["side"] == "engine"]
                eng = median([s["tokens_per_s"] for s in engine_side])
                hf = median([s["tokens_per_s"] for s in pick if s["side"] == "hf"])
                summary.append(
                    {
                        "dtype": dtype,
                        "mix": mix,
                        "concurrency": c,
                        "requests": pick[0]["requests"],
                        "engine_tok_s": round(eng, 1),
                        "hf_tok_s": round(hf, 1),
                        "ratio": round(eng / hf, 3),
                        **{
                            f"engine_{k}": median([s[k] for s in engine_side])
                            for k in ("prefill_batches", "decode_steps", "prefill_rows_deduplicated")
                        },
                    }
                )

    plot = _plot(summary, dtypes, out_dir)
    tables = [
        table(
            f"Engine vs HF generate, {dtype}, output tokens/s (max_new_tokens {max_new}, 1 thread each)",
            [
                "prompt mix",
                "concurrency",
                "requests",
                "engine tok/s",
                "HF tok/s",
                "engine / HF",
                "engine prefill batches",
                "engine decode steps",
                "engine rows deduped",
            ],
            [
                [
                    s["mix"],
                    s["concurrency"],
                    s["requests"],
                    s["engine_tok_s"],
                    s["hf_tok_s"],
                    s["ratio"],
                    s["engine_prefill_batches"],
                    s["engine_decode_steps"],
                    s["engine_prefill_rows_deduplicated"],
                ]
                for s in summary
                if s["dtype"] == dtype
            ],
            note=f"Median of {reps} run(s) per cell, engine and HF measured back to back. The last three "
            "columns show how the engine batched one run: prefill forward passes, decode forward "
            "passes, and prefill rows skipped because an identical prompt was admitted in the same "
            "batch. HF needs requests/concurrency prefills and max_new_tokens-1 decode passes per batch.",
        )
        for dtype in dtypes
    ]
    return {
        "settings": {
            "levels": list(LEVELS),
            "group_size": GROUP,
            "max_new_tokens": max_new,
            "dtypes": dtypes,
            "reps": reps,
            "min_requests": min_requests,
            "threads": THREADS,
            "sampling": _sampling(max_new),
            "model": str(model_path),
        },
        "summary": summary,
        "samples": samples,
        "tables": tables,
        "plots": [plot],
        "notes": [
            "Engine: real server process over HTTP (EngineClient), --num-threads 1; HF: "
            "model.generate in the benchmark process, torch.set_num_threads(1). The engine's HTTP "
            "handling and the client can use the second core; HF's loop has it to itself.",
            "Every request generates exactly max_new_tokens (EOS banned on both sides), so the "
            "two sides do the same decoding work per request.",
        ],
    }


def _plot(summary: list[dict], dtypes: list[str], out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One row per dtype: overlaid dtypes made the ratio labels collide.
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(11, 3.9 * len(dtypes)), sharey=True, squeeze=False)
    for row, dtype in zip(axes, dtypes):
        for ax, mix in zip(row, ("distinct", "grpo")):
            rows = [s for s in summary if s["dtype"] == dtype and s["mix"] == mix]
            xs = [s["concurrency"] for s in rows]
            ax.plot(xs, [s["engine_tok_s"] for s in rows], "-o", color="tab:blue", label="engine (HTTP)")
            ax.plot(xs, [s["hf_tok_s"] for s in rows], "-s", color="tab:orange", label="HF generate")
            for s in rows:
                ax.annotate(
                    f"{s['ratio']:.2f}x",
                    (s["concurrency"], s["engine_tok_s"]),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=8,
                )
            ax.margins(y=0.12)  # room for the ratio labels above the top points
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(LEVELS))
            ax.set_xticklabels([str(c) for c in LEVELS])
            ax.set_xlabel("concurrent requests (HF: batch size)")
            what = "distinct prompts" if mix == "distinct" else f"GRPO groups of {GROUP} identical prompts"
            ax.set_title(f"{dtype}, {what}", fontsize=10)
            ax.grid(alpha=0.3)
        row[0].set_ylabel("output tokens / s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, 1 torch thread each: embedded engine vs transformers generate (labels: engine / HF)")
    fig.tight_layout()
    name = "engine_throughput.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def headline(entry: dict) -> list[list[str]]:
    rows = []
    for mix, label in (("distinct", "distinct prompts"), ("grpo", "GRPO groups of 8")):
        pick = [s for s in entry["summary"] if s["mix"] == mix and s["dtype"] == "bfloat16"]
        if pick:
            ratios = " / ".join(f"{s['ratio']:.2f}x" for s in pick)
            levels = "/".join(str(s["concurrency"]) for s in pick)
            rows.append(
                [
                    f"embedded engine vs HF `generate`, SmolLM2 bf16, {label}, concurrency {levels}",
                    f"{ratios} output tokens/s",
                ]
            )
    return rows
