"""Batched CPU decoding engine around a Hugging Face causal LM.

The engine owns one model and one background thread (the *decode thread*).
Every mutation of the model or of the running batch happens on that thread,
between two forward passes, so no lock is needed around the model itself:
other threads talk to the engine only through a FIFO inbox of commands and
get answers back through ``concurrent.futures.Future`` objects (which asyncio
code can await with ``asyncio.wrap_future``).

Why not transformers' own continuous batching (``generate_batch`` /
``ContinuousBatchingManager`` in transformers 5.x)?  It picks greedy vs.
sampling once per manager (``do_sample`` is global, so a greedy request and a
sampled request cannot share a batch), it only builds a temperature processor
when the *default* temperature differs from 1.0, has no ``min_new_tokens``,
and gives no hook to tag each token with the weight version that produced it.
Those are core needs of RL rollouts, so the loop below is our own.

Batching scheme
---------------
The running batch is a set of rows sharing one ``DynamicCache``; rows are left
padded to a common length and padding is hidden by a 2-D attention mask, with
explicit ``position_ids`` so every row sees the positions it would see alone.
Each decode step is one forward pass of shape ``[B, 1]`` for all rows.
New requests are prefilled in their own (left padded) forward pass and then
merged into the running batch by left-padding the shorter of the two caches
with zeros (masked, hence inert).  Finished rows are dropped with a batch
index-select of the cache, and all-padding columns on the left are trimmed.

Only caches made of plain full-attention ``DynamicLayer`` s are supported
(Llama, Qwen2/2.5/3, Mistral without sliding window, ...); sliding-window or
linear-attention layers would need position-aware merging and are refused at
start-up.
"""

from __future__ import annotations

import concurrent.futures
import glob
import inspect
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from miles_async.inference.embedded.sampling import sample_tokens

logger = logging.getLogger(__name__)


# Control commands are tiny; anything beyond this backlog means the decode
# thread is stuck, and callers should hear about it rather than queue forever.
_INBOX_WARN_SIZE = 10_000


class EngineDeadError(RuntimeError):
    """The decode thread has died; the engine cannot serve any request."""


class RequestRejectedError(ValueError):
    """A request is invalid for this engine (e.g. duplicate rid)."""


class UnknownParameterError(ValueError):
    """A weight update named tensors the model does not have."""

    def __init__(self, names: list[str]):
        self.names = names
        super().__init__(f"unknown parameter names: {names}")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables top-k (SGLang uses -1)
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True


@dataclass
class GenerationResult:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    output_weight_versions: list[int]
    finish_type: str  # "stop" | "length" | "abort"
    finish_matched: int | None
    weight_version: int
    text: str
    e2e_latency: float


@dataclass
class _Seq:
    rid: str
    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    submitted_at: float
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    finished: bool = False

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass
class _Command:
    kind: str
    future: concurrent.futures.Future | None = None
    payload: Any = None


def _resolve(fut: concurrent.futures.Future | None, value: Any = None, error: BaseException | None = None) -> None:
    # The waiting side may have cancelled (client went away); losing that race is fine.
    if fut is None or fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass


def _eos_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    sources.append(getattr(model.config, "eos_token_id", None))
    for src in sources:
        if src is None:
            continue
        if isinstance(src, int):
            ids.add(src)
        else:
            ids.update(int(x) for x in src)
    return ids


def _read_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


class Engine:
    """Continuous-batching decode engine for one HF causal LM on the CPU.

    Thread model: ``start()`` launches the decode thread; every public method
    is thread-safe and returns a ``concurrent.futures.Future`` (or raises
    ``EngineDeadError`` once the decode thread has died).
    """

    def __init__(
        self,
        model_path: str,
        dtype: torch.dtype = torch.bfloat16,
        max_running_requests: int = 64,
        seed: int = 0,
        weight_version: int = 0,
        max_prefill_tokens: int = 16384,
        step_delay_s: float = 0.0,
        attn_implementation: str = "sdpa",
    ):
        from transformers import AutoModelForCausalLM

        if max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        self.model_path = model_path
        self.dtype = dtype
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.step_delay_s = step_delay_s
        self.weight_version = int(weight_version)

        # local_files_only: this engine must never reach for the model hub.
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
        self.model.eval()
        # No requires_grad_(False): the decode loop runs under inference_mode anyway, and with
        # frozen bf16 weights torch's CPU matmul on the non-contiguous last-token view that
        # lm_head receives at prefill copies the weight once per row (~200x slower at B=32).
        self._attn_implementation = attn_implementation
        self.config = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids = _eos_ids(self.model)
        self.context_len = int(getattr(self.config, "max_position_embeddings", 0) or 0) or None
        pad = getattr(self.config, "pad_token_id", None)
        self._pad_id = int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self.tokenizer = self._load_tokenizer(model_path)

        params = inspect.signature(self.model.forward).parameters
        # transformers 5.x renamed past_key_values -> cache; accept either so
        # remote-code models keep working.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._has_logits_to_keep = "logits_to_keep" in params
        self._check_cache_layout()

        self.generator = torch.Generator().manual_seed(int(seed))

        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._inbox_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None

        # State below is owned by the decode thread.
        self._waiting: deque[_Seq] = deque()
        self._rows: list[_Seq] = []
        self._live: dict[str, _Seq] = {}
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, L] long, 1 = real token
        self._paused = False
        self._stopping = False
        self.stats = {"decode_steps": 0, "decode_tokens": 0, "prefill_batches": 0, "max_batch_size": 0,
                      "prefill_rows_deduplicated": 0, "busy_seconds": 0.0}

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _load_tokenizer(model_path: str) -> Any:
        # Only for the "text" field; a folder without tokenizer files is a
        # valid model folder (callers send input_ids), so text is then "".
        has_files = any(
            os.path.exists(os.path.join(model_path, f))
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        )
        if not has_files:
            return None
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - a broken tokenizer must not block serving
            logger.warning("could not load tokenizer from %s (%s); text will be empty", model_path, exc)
            return None

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def _check_cache_layout(self) -> None:
        from transformers.cache_utils import DynamicLayer

        cache = self._new_cache()
        bad = [type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer]
        if bad:
            raise NotImplementedError(
                f"embedded engine supports only full-attention DynamicLayer caches; model has {sorted(set(bad))}"
            )

    # --------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="embedded-decode", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight (partial outputs are returned) and stop the thread."""
        if self._thread is None:
            return
        try:
            self._post(_Command("stop"))
        except EngineDeadError:
            pass
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    # --------------------------------------------------------------- public API
    def submit(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None = None,
    ) -> concurrent.futures.Future:
        """Queue a generation; the future resolves to a ``GenerationResult``."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        seq = _Seq(
            rid=rid if rid is not None else uuid.uuid4().hex,
            prompt=list(input_ids),
            params=params,
            future=fut,
            submitted_at=time.monotonic(),
            stop_ids=frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.eos_token_ids),
        )
        self._post(_Command("submit", fut, seq))
        return fut

    def abort(self, rid: str | None = None, abort_all: bool = False) -> concurrent.futures.Future:
        """Finish one request (or all) with its partial output; resolves to the number aborted."""
        return self._call("abort", (rid, abort_all))

    def pause(self, mode: str = "abort") -> concurrent.futures.Future:
        """Stop decoding after the current step.

        ``abort``: every queued or running request returns now with finish
        reason abort.  ``in_place``: running rows keep their KV cache and
        resume on ``resume()``.  ``retract``: like in_place, but the KV cache
        is dropped and rebuilt (with the then-current weights) on resume.
        The future resolves once the decode thread is idle.
        """
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"unknown pause mode {mode!r}")
        return self._call("pause", mode)

    def resume(self) -> concurrent.futures.Future:
        return self._call("resume")

    def flush_cache(self) -> concurrent.futures.Future:
        """Drop all KV state; running requests are re-prefilled (prompt + output so far) before their next step."""
        return self._call("flush")

    def run_between_steps(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the decode thread between two forward passes; resolves to its return value."""
        return self._call("call", fn)

    def update_weights_from_tensors(
        self, tensors: dict[str, torch.Tensor], weight_version: int | None, flush: bool
    ) -> concurrent.futures.Future:
        """Copy named tensors into the live model between decode steps.

        Names are HF parameter names (``model.state_dict()`` keys); for tied
        embeddings either or both of ``lm_head.weight`` and
        ``model.embed_tokens.weight`` may be given.  Raises (through the
        future) ``UnknownParameterError`` before touching anything if a name is
        unknown, and ``ValueError`` on a shape mismatch.
        """

        def apply() -> int:
            self._copy_into_model(tensors)
            if weight_version is not None:
                self.weight_version = int(weight_version)
            if flush:
                self._flush()
            return self.weight_version

        return self.run_between_steps(apply)

    def update_weights_from_disk(self, model_path: str, weight_version: int | None) -> concurrent.futures.Future:
        """Load an HF checkpoint folder of the same architecture into the live model.

        The files are read on the calling thread (slow IO must not stall
        decoding); only the copy happens on the decode thread.  When the
        checkpoint's names do not map 1:1 onto the model (e.g. transformers
        renames or fuses weights on load), the folder is loaded through
        ``from_pretrained`` instead and its state dict is copied.
        Must not be called from the decode thread.
        """
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"model_path {model_path!r} is not a directory")
        tensors = _read_safetensors_dir(model_path)
        known = self._param_table()
        unknown = [n for n in tensors if n not in known]
        missing = self._missing_names(tensors.keys(), known)
        if not tensors or unknown or missing:
            from transformers import AutoModelForCausalLM

            logger.info(
                "checkpoint names do not match the live model (%d unknown, %d missing); loading via from_pretrained",
                len(unknown),
                len(missing),
            )
            fresh = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=self.dtype, attn_implementation=self._attn_implementation, local_files_only=True
            )
            tensors = dict(fresh.state_dict())
            del fresh

        def apply() -> int:
            self._copy_into_model(tensors)
            self.model_path = model_path
            if weight_version is not None:
                self.weight_version = int(weight_version)
            return self.weight_version

        return self.run_between_steps(apply)

    def weights_snapshot(self) -> concurrent.futures.Future:
        """(copies of the parameters, weight version), read between two decode steps so no update is half
        applied; one name per storage (tied weights appear once)."""
        return self.run_between_steps(lambda: ({n: p.detach().clone() for n, p in self.model.named_parameters()},
                                               self.weight_version))

    def weights_checksum(self) -> concurrent.futures.Future:
        """(per-parameter checksums, weight version), computed between two decode steps."""
        from miles_async.utils.weight_checksum import tensor_checksums

        return self.run_between_steps(lambda: (tensor_checksums(self.model.named_parameters()), self.weight_version))

    def load_snapshot(self) -> dict[str, Any]:
        """Cheap, slightly racy view of the engine's load (for /get_load)."""
        return {
            "num_running_reqs": len(self._rows),
            "num_waiting_reqs": len(self._waiting) + self._inbox.qsize(),
            "num_tokens": sum(s.context_len for s in list(self._rows)),
            "paused": self._paused,
            "weight_version": self.weight_version,
            **self.stats,
        }

    # ---------------------------------------------------------------- plumbing
    def _post(self, cmd: _Command) -> None:
        # Holding the lock while checking _dead and enqueueing guarantees the
        # dying thread's final drain sees every command that got in.
        with self._inbox_lock:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if self._thread is None:
                raise EngineDeadError("engine not started")
            self._inbox.put(cmd)
            if self._inbox.qsize() > _INBOX_WARN_SIZE:
                logger.warning("engine inbox backlog: %d commands", self._inbox.qsize())

    def _call(self, kind: str, payload: Any = None) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Command(kind, fut, payload))
        return fut

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stopping:
                    idle = self._paused or (not self._rows and not self._waiting)
                    self._drain_inbox(block=idle)
                    if self._stopping or self._paused:
                        continue
                    t0 = time.perf_counter()
                    self._admit()
                    if self._rows:
                        # A set step cost (benchmarks) is paid before the step's tokens are out, as
                        # compute would be: after the last step nothing is left to wait for.
                        if self.step_delay_s > 0:
                            time.sleep(self.step_delay_s)
                        self._decode_step()
                    # Busy time (prefill + decode) against wall time gives the engine's idle fraction.
                    self.stats["busy_seconds"] += time.perf_counter() - t0
            self._abort_everything()
            self._die(EngineDeadError("engine was shut down"))
        except BaseException as exc:  # noqa: BLE001 - must fail every waiter, whatever happened
            logger.exception("decode thread died")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"decode thread died: {exc!r}")
        with self._inbox_lock:
            self._dead = err
        for seq in list(self._live.values()):
            _resolve(seq.future, error=err)
        self._live.clear()
        self._rows = []
        self._waiting.clear()
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            target = cmd.payload.future if cmd.kind == "submit" else cmd.future
            _resolve(target, error=err)

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: _Command) -> None:
        kind = cmd.kind
        if kind == "submit":
            seq: _Seq = cmd.payload
            if seq.rid in self._live:
                _resolve(seq.future, error=RequestRejectedError(f"duplicate rid {seq.rid!r}"))
                return
            self._live[seq.rid] = seq
            self._waiting.append(seq)
            return
        if kind == "stop":
            self._stopping = True
            return
        try:
            if kind == "abort":
                rid, abort_all = cmd.payload
                result = self._abort(rid, abort_all)
            elif kind == "pause":
                if cmd.payload == "abort":
                    self._abort(None, True)
                elif cmd.payload == "retract":
                    self._flush()
                self._paused = True
                result = True
            elif kind == "resume":
                self._paused = False
                result = True
            elif kind == "flush":
                self._flush()
                result = True
            elif kind == "call":
                result = cmd.payload()
            else:
                raise ValueError(f"unknown engine command {kind!r}")
        except Exception as exc:  # noqa: BLE001 - a bad command must not kill the decode loop
            _resolve(cmd.future, error=exc)
            return
        _resolve(cmd.future, result)

    # ------------------------------------------------------------ batch state
    def _abort(self, rid: str | None, abort_all: bool) -> int:
        targets = list(self._live.values()) if abort_all else ([self._live[rid]] if rid in self._live else [])
        for seq in targets:
            self._finish(seq, "abort")
        self._drop_finished()
        return len(targets)

    def _abort_everything(self) -> None:
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                break
        self._abort(None, True)

    def _flush(self) -> None:
        # Running rows go back to the front of the queue, in order, keeping
        # their outputs; admission re-prefills prompt + output.
        for seq in reversed(self._rows):
            self._waiting.appendleft(seq)
        self._rows = []
        self._cache = None
        self._mask = None

    def _finish(self, seq: _Seq, finish_type: str, matched: int | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        self._live.pop(seq.rid, None)
        text = ""
        if self.tokenizer is not None and seq.output:
            try:
                text = self.tokenizer.decode(seq.output, skip_special_tokens=seq.params.skip_special_tokens)
            except Exception:  # noqa: BLE001 - text is best effort, ids are the contract
                logger.exception("decoding output text failed for %s", seq.rid)
        result = GenerationResult(
            rid=seq.rid,
            prompt_tokens=len(seq.prompt),
            output_ids=list(seq.output),
            output_logprobs=list(seq.logprobs),
            output_weight_versions=list(seq.versions),
            finish_type=finish_type,
            finish_matched=matched,
            weight_version=self.weight_version,
            text=text,
            e2e_latency=time.monotonic() - seq.submitted_at,
        )
        _resolve(seq.future, result)

    def _drop_finished(self) -> None:
        if any(s.finished for s in self._waiting):
            self._waiting = deque(s for s in self._waiting if not s.finished)
        keep = [i for i, s in enumerate(self._rows) if not s.finished]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._rows, self._cache, self._mask = [], None, None
            return
        idx = torch.tensor(keep, dtype=torch.long)
        self._rows = [self._rows[i] for i in keep]
        mask = self._mask.index_select(0, idx)
        # Columns that are padding for every surviving row cost compute each
        # step; cut them off.
        first = int(mask.any(dim=0).to(torch.int8).argmax())
        mask = mask[:, first:]
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, first:]
            layer.values = layer.values.index_select(0, idx)[:, :, first:]
        self._mask = mask

    def _merge(self, cache: Any, mask: torch.Tensor) -> None:
        if self._cache is None:
            self._cache, self._mask = cache, mask
            return
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        total = max(old_len, new_len)

        def left_pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
            if n == 0:
                return t
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self._cache.layers, cache.layers):
            mine.keys = torch.cat([left_pad(mine.keys, total - old_len, 2), left_pad(theirs.keys, total - new_len, 2)])
            mine.values = torch.cat(
                [left_pad(mine.values, total - old_len, 2), left_pad(theirs.values, total - new_len, 2)]
            )
        self._mask = torch.cat([left_pad(self._mask, total - old_len, 1), left_pad(mask, total - new_len, 1)])

    # -------------------------------------------------------------- decoding
    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any, last_only: bool
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": positions,
            self._cache_kwarg: cache,
            "use_cache": True,
        }
        if last_only and self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        return out.logits[:, -1, :].float()

    def _admit(self) -> None:
        room = self.max_running_requests - len(self._rows)
        batch: list[_Seq] = []
        longest = 0
        while self._waiting and len(batch) < room:
            seq = self._waiting[0]
            if seq.params.max_new_tokens <= len(seq.output):
                self._waiting.popleft()
                self._finish(seq, "length")
                continue
            longest_if = max(longest, seq.context_len)
            # Always take at least one request, even a huge one.
            if batch and longest_if * (len(batch) + 1) > self.max_prefill_tokens:
                break
            longest = longest_if
            batch.append(self._waiting.popleft())
        if not batch:
            return

        # RL rollouts send each prompt n_samples_per_prompt times: prefill every distinct
        # context once and copy its cache rows, which divides prefill work by the group size.
        row_of: dict[tuple[int, ...], int] = {}
        expand = [row_of.setdefault(tuple(seq.prompt + seq.output), len(row_of)) for seq in batch]
        n = len(row_of)
        ids = torch.full((n, longest), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, longest), dtype=torch.long)
        for i, ctx in enumerate(row_of):
            ids[i, longest - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
            mask[i, longest - len(ctx) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = self._new_cache()
        logits = self._forward(ids, mask, positions, cache, last_only=True)
        if n < len(batch):
            idx = torch.tensor(expand, dtype=torch.long)
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, idx)
                layer.values = layer.values.index_select(0, idx)
            mask, logits = mask.index_select(0, idx), logits.index_select(0, idx)
        self.stats["prefill_batches"] += 1
        self.stats["prefill_rows_deduplicated"] += len(batch) - n
        self._merge(cache, mask)
        self._rows.extend(batch)
        self.stats["max_batch_size"] = max(self.stats["max_batch_size"], len(self._rows))
        self._sample_and_append(batch, logits)

    def _decode_step(self) -> None:
        rows = self._rows
        b = len(rows)
        last = torch.tensor([s.output[-1] for s in rows], dtype=torch.long)[:, None]
        positions = torch.tensor([s.context_len - 1 for s in rows], dtype=torch.long)[:, None]
        self._mask = torch.cat([self._mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
        logits = self._forward(last, self._mask, positions, self._cache, last_only=False)
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += b
        self._sample_and_append(rows, logits)

    def _sample_and_append(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        # min_new_tokens: stop tokens are made impossible, so the returned
        # log-probs describe the distribution actually sampled from.
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        vocab = logits.shape[1]
        for i, seq in enumerate(seqs):
            if len(seq.output) < seq.params.min_new_tokens:
                for t in seq.stop_ids:
                    if 0 <= t < vocab:
                        ban_rows.append(i)
                        ban_cols.append(t)
        if ban_rows:
            logits[ban_rows, ban_cols] = float("-inf")
        temps = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
        top_ps = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32)
        top_ks = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long)
        tokens, logprobs = sample_tokens(logits, temps, top_ps, top_ks, self.generator)
        version = self.weight_version
        any_finished = False
        for seq, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.output.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(version)
            if tok in seq.stop_ids:
                self._finish(seq, "stop", tok)
            elif len(seq.output) >= seq.params.max_new_tokens or (
                self.context_len is not None and seq.context_len >= self.context_len
            ):
                self._finish(seq, "length")
            else:
                continue
            any_finished = True
        if any_finished:
            self._drop_finished()

    # ---------------------------------------------------------- weight update
    def _param_table(self) -> dict[str, torch.Tensor]:
        # remove_duplicate=False keeps every alias of tied weights, so both
        # lm_head.weight and model.embed_tokens.weight resolve.
        table = dict(self.model.named_parameters(remove_duplicate=False))
        for name, buf in self.model.named_buffers(remove_duplicate=False):
            table.setdefault(name, buf)
        return table

    def _missing_names(self, given: Any, known: dict[str, torch.Tensor]) -> list[str]:
        given_ptrs = {known[n].data_ptr() for n in given if n in known}
        names = dict(self.model.named_parameters())  # deduplicated: one name per storage
        return [n for n, p in names.items() if p.data_ptr() not in given_ptrs]

    def _copy_into_model(self, tensors: dict[str, torch.Tensor]) -> None:
        table = self._param_table()
        unknown = sorted(n for n in tensors if n not in table)
        if unknown:
            raise UnknownParameterError(unknown)
        bad_shapes = [
            f"{n}: got {tuple(t.shape)}, expected {tuple(table[n].shape)}"
            for n, t in tensors.items()
            if tuple(t.shape) != tuple(table[n].shape)
        ]
        if bad_shapes:
            raise ValueError("shape mismatch: " + "; ".join(bad_shapes))
        with torch.no_grad():
            for name, tensor in tensors.items():
                table[name].copy_(tensor)  # copy_ casts to the model dtype
