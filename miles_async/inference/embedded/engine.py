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

This module is the scheduler: the decode thread, its commands, admission (prefill), decode steps and
finishing requests. The rest has its own module: the model and its forward pass (``model``), the
running batch and its KV cache (``batch``), sampling (``sampling``), weights in and out
(``weights``), the request and result records (``records``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from miles_async.inference.embedded.batch import KVBatch, prefill_inputs
from miles_async.inference.embedded.kv_cache import select_rows
from miles_async.inference.embedded.model import CausalLM
from miles_async.inference.embedded.records import (
    EngineDeadError,
    GenerationResult,
    RequestRejectedError,
    SamplingParams,
    Seq,
    record_routing,
    resolve,
)
from miles_async.inference.embedded.sampling import sample_tokens
from miles_async.inference.embedded.vision import Images, decode_positions, prepare_images, vision_prefill
from miles_async.inference.embedded.weights import (
    ShmMaps,
    StagedWeights,
    copy_into_model,
    map_staged,
    read_checkpoint,
)

logger = logging.getLogger(__name__)


# Control commands are tiny; anything beyond this backlog means the decode
# thread is stuck, and callers should hear about it rather than queue forever.
_INBOX_WARN_SIZE = 10_000


@dataclass
class _Command:
    kind: str
    future: concurrent.futures.Future | None = None
    payload: Any = None


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
        attn_implementation: str = "sdpa",
    ):
        if max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        self.model_path = model_path
        self.dtype = dtype
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = int(weight_version)

        self.lm = CausalLM(model_path, dtype, attn_implementation)
        self.model = self.lm.model
        self.tokenizer = self.lm.tokenizer
        self.vocab_size = self.lm.vocab_size
        self.eos_token_ids = self.lm.eos_token_ids
        self.context_len = self.lm.context_len

        self.generator = torch.Generator().manual_seed(int(seed))

        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._inbox_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None

        # State below is owned by the decode thread.
        self._waiting: deque[Seq] = deque()
        self._batch = KVBatch()
        self._live: dict[str, Seq] = {}
        self._paused = False
        self._stopping = False
        # A staged update (``stage_weights``): set by a server thread, taken by the decode thread's commit.
        self._staged: StagedWeights | None = None
        self._staged_lock = threading.Lock()  # also serializes the stages' use of _shm_maps
        self._shm_maps = ShmMaps()
        self.stats = {
            "decode_steps": 0,
            "decode_tokens": 0,
            "prefill_batches": 0,
            "max_batch_size": 0,
            "prefill_rows_deduplicated": 0,
            "busy_seconds": 0.0,
        }

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
        images: Images | None = None,
        routed_experts_start: int | None = None,
    ) -> concurrent.futures.Future:
        """Queue a generation; the future resolves to a ``GenerationResult``. ``images``: a VLM prompt's images
        (``prepare_images``), whose placeholders ``input_ids`` holds already expanded. ``routed_experts_start``
        (an MoE model): the result's ``routed_experts`` cover positions ``[routed_experts_start, prompt + output -
        1)``; None: not recorded. ``RequestRejectedError`` for a dense model or a start outside the prompt."""
        if routed_experts_start is not None:
            if not self.supports_routed_experts:
                raise RequestRejectedError(f"routed experts: {self.lm.routers.why_not}")
            if not 0 <= routed_experts_start <= len(input_ids):
                raise RequestRejectedError(
                    f"routed_experts_start_len {routed_experts_start} is outside [0, {len(input_ids)}] (the prompt)"
                )
        fut: concurrent.futures.Future = concurrent.futures.Future()
        seq = Seq(
            rid=rid if rid is not None else uuid.uuid4().hex,
            prompt=list(input_ids),
            params=params,
            future=fut,
            submitted_at=time.monotonic(),
            stop_ids=frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.eos_token_ids),
            image_refs=images.refs if images is not None else (),
            pixels=images.pixels if images is not None else None,
            routed_start=routed_experts_start or 0,
            routed=[] if routed_experts_start is not None else None,
        )
        self._post(_Command("submit", fut, seq))
        return fut

    @property
    def supports_routed_experts(self) -> bool:
        """Whether requests may ask for their routed experts (an MoE model: ``CausalLM.routers``, whose ``why_not``
        says why not)."""
        return bool(self.lm.routers)

    def prepare_images(self, refs: list[str], input_ids: list[int]) -> Images | None:
        """Load a request's images and compute their pixel inputs (off the decode thread: this is IO and image
        processing); ``ImageRequestError`` when the model takes no images, an image does not load, or the prompt's
        placeholders do not match the images' patches (or have none)."""
        return prepare_images(self.lm, refs, input_ids)

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
        """Copy named tensors into the live model between decode steps (see ``weights``).

        Raises (through the future) ``UnknownParameterError`` before touching anything if a name is
        unknown, and ``ValueError`` on a shape mismatch.
        """

        def apply() -> int:
            copy_into_model(self.model, tensors)
            if weight_version is not None:
                self.weight_version = int(weight_version)
            if flush:
                self._flush()
            return self.weight_version

        return self.run_between_steps(apply)

    def stage_weights(self, segments: Any, weight_version: int) -> int:
        """Map an update the trainer wrote into shared memory and check it, while generation goes on; nothing
        is applied until ``commit_staged_weights``. Replaces an earlier stage never committed. Returns the bytes
        staged. Must not be called from the decode thread (mapping is IO)."""
        with self._staged_lock:
            self._staged = None
            try:
                self._staged = map_staged(self.model, segments, weight_version, self._shm_maps)
            except BaseException:
                self._shm_maps.clear()
                raise
            return self._staged.nbytes

    def discard_staged_weights(self) -> bool:
        """Drop a staged update and every mapping of the trainer's files (its update failed); True if there
        was a staged update."""
        with self._staged_lock:
            old, self._staged = self._staged, None
            self._shm_maps.clear()
        return old is not None

    def commit_staged_weights(self, weight_version: int, flush: bool) -> concurrent.futures.Future:
        """Copy the staged update of ``weight_version`` into the live model between two decode steps, as one
        step: a request sees the old weights or the new ones, never a mix. Fails (``LookupError``, nothing
        touched) if no update of that version is staged."""

        def apply() -> int:
            with self._staged_lock:
                staged = self._staged
                if staged is None or staged.weight_version != int(weight_version):
                    have = "none" if staged is None else f"version {staged.weight_version}"
                    raise LookupError(f"no staged update of weight version {weight_version} (staged: {have})")
                self._staged = None
            copy_into_model(self.model, staged.tensors)
            self.weight_version = int(weight_version)
            if flush:
                self._flush()
            return self.weight_version

        return self.run_between_steps(apply)

    def update_weights_from_disk(self, model_path: str, weight_version: int | None) -> concurrent.futures.Future:
        """Load an HF checkpoint folder of the same architecture into the live model.

        The files are read on the calling thread (slow IO must not stall
        decoding); only the copy happens on the decode thread.
        Must not be called from the decode thread.
        """
        tensors = read_checkpoint(self.model, model_path, self.dtype, self.lm.attn_implementation)

        def apply() -> int:
            copy_into_model(self.model, tensors)
            self.model_path = model_path
            if weight_version is not None:
                self.weight_version = int(weight_version)
            return self.weight_version

        return self.run_between_steps(apply)

    def weights_snapshot(self) -> concurrent.futures.Future:
        """(copies of the parameters, weight version), read between two decode steps so no update is half
        applied; one name per storage (tied weights appear once)."""
        return self.run_between_steps(
            lambda: ({n: p.detach().clone() for n, p in self.model.named_parameters()}, self.weight_version)
        )

    def weights_checksum(self) -> concurrent.futures.Future:
        """(per-parameter checksums, weight version), computed between two decode steps."""
        from miles_async.utils.hf_names import checkpoint_named
        from miles_async.utils.weight_checksum import tensor_checksums

        # Under the checkpoint's names, as the trainers send them (an MoE's experts fused here are each its own).
        named = checkpoint_named(self.model, self.model.named_parameters())
        return self.run_between_steps(lambda: (tensor_checksums(named), self.weight_version))

    def load_snapshot(self) -> dict[str, Any]:
        """Cheap, slightly racy view of the engine's load (for /get_load)."""
        rows = list(self._batch.rows)
        return {
            "num_running_reqs": len(rows),
            "num_waiting_reqs": len(self._waiting) + self._inbox.qsize(),
            "num_tokens": sum(s.context_len for s in rows),
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
                    idle = self._paused or (not self._batch.rows and not self._waiting)
                    self._drain_inbox(block=idle)
                    if self._stopping or self._paused:
                        continue
                    t0 = time.perf_counter()
                    self._admit()
                    if self._batch.rows:
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
            resolve(seq.future, error=err)
        self._live.clear()
        self._batch.clear()
        self._waiting.clear()
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            target = cmd.payload.future if cmd.kind == "submit" else cmd.future
            resolve(target, error=err)

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
            seq: Seq = cmd.payload
            if seq.rid in self._live:
                resolve(seq.future, error=RequestRejectedError(f"duplicate rid {seq.rid!r}"))
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
            resolve(cmd.future, error=exc)
            return
        resolve(cmd.future, result)

    # ------------------------------------------------------------ scheduling
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
        self._waiting.extendleft(reversed(self._batch.clear()))

    def _finish(self, seq: Seq, finish_type: str, matched: int | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        self._live.pop(seq.rid, None)
        result = GenerationResult(
            rid=seq.rid,
            prompt_tokens=len(seq.prompt),
            output_ids=list(seq.output),
            output_logprobs=list(seq.logprobs),
            output_weight_versions=list(seq.versions),
            finish_type=finish_type,
            finish_matched=matched,
            weight_version=self.weight_version,
            text=self.lm.decode(seq.output, seq.params.skip_special_tokens),
            e2e_latency=time.monotonic() - seq.submitted_at,
            routed_experts=seq.routed_experts(),
        )
        resolve(seq.future, result)

    def _drop_finished(self) -> None:
        if any(s.finished for s in self._waiting):
            self._waiting = deque(s for s in self._waiting if not s.finished)
        self._batch.drop_finished()

    def _admit(self) -> None:
        room = self.max_running_requests - len(self._batch.rows)
        batch: list[Seq] = []
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
        # A VLM row's context includes its images: the same tokens with other images are another row.
        row_of: dict[tuple, int] = {}
        distinct: list[Seq] = []
        expand = []
        for seq in batch:
            key = (tuple(seq.prompt + seq.output), seq.image_refs)
            if key not in row_of:
                row_of[key] = len(distinct)
                distinct.append(seq)
            expand.append(row_of[key])
        n = len(distinct)
        ids, mask, positions = prefill_inputs([key[0] for key in row_of], self.lm.pad_id)
        pixels = None
        if self.lm.is_vision:
            positions, pixels = vision_prefill(self.lm, distinct, ids, mask)
            for seq, row in zip(batch, expand):
                seq.rope_delta = distinct[row].rope_delta
        cache = self.lm.new_cache()
        routing = any(seq.routed is not None for seq in batch)
        logits = self.lm.forward(ids, mask, positions, cache, last_only=True, pixels=pixels, capture_routing=routing)
        if routing:
            record_routing(batch, expand, self.lm.last_routing.numpy())
        if n < len(batch):
            idx = torch.tensor(expand, dtype=torch.long)
            select_rows(cache, idx)
            mask, logits = mask.index_select(0, idx), logits.index_select(0, idx)
        self.stats["prefill_batches"] += 1
        self.stats["prefill_rows_deduplicated"] += len(batch) - n
        self._batch.add(batch, cache, mask)
        self.stats["max_batch_size"] = max(self.stats["max_batch_size"], len(self._batch.rows))
        self._sample_and_append(batch, logits)

    def _decode_step(self) -> None:
        rows = self._batch.rows
        last, positions, mask = self._batch.step_inputs()
        if self.lm.is_vision:
            positions = decode_positions(rows, positions)
        routing = any(seq.routed is not None for seq in rows)
        logits = self.lm.forward(last, mask, positions, self._batch.cache, last_only=False, capture_routing=routing)
        if routing:
            record_routing(rows, range(len(rows)), self.lm.last_routing.numpy())
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(rows)
        self._sample_and_append(rows, logits)

    def _sample_and_append(self, seqs: list[Seq], logits: torch.Tensor) -> None:
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
        if self.lm.unsampled_ids:  # a VLM's image placeholder (vision.hf.unsampled_token_ids)
            logits[:, self.lm.unsampled_ids] = float("-inf")
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
