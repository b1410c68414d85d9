"""Megatron-LM's torch_dist checkpoints as Miles' launchers pass them: ``--ref-load <model>_torch_dist`` and an
empty ``--load`` = ``--save`` folder on the first start.

The checkpoints are written as Megatron-LM's ``save_checkpoint`` lays them out (megatron/training/checkpointing.py:
``generate_state_dict``'s ``args``/``checkpoint_version``/``iteration``/``model`` saved by
``dist_checkpointing.save`` into ``iter_NNNNNNN/`` or ``release/``, then the tracker written last), with
megatron-core alone: Megatron-LM's training package is not installable here. Megatron runs in spawned gloo
processes (it keeps global parallel state)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from tests.flag_helpers import tiny_train_flags
from tests.ports import spawn_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -r requirements-megatron.txt)")

RENAMED = "decoder.final_layernorm.weight"  # the negative control's key, saved as "decoder.final_norm.weight"


def _save_as_megatron_lm(model, folder: Path, tracker: str, iteration: int, rename: str | None = None) -> None:
    """``model`` saved as Megatron-LM's ``save_checkpoint`` writes it (no optimizer, as Miles' converter)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}  # _build_sharded_..._metadata
    sharded = model.sharded_state_dict(metadata={**metadata, "dp_cp_group": ps.get_data_parallel_group(True)})
    for tensor in nested_values(sharded):
        if getattr(tensor, "key", None) == rename:
            tensor.key = "decoder.final_norm.weight"
    args = argparse.Namespace(ckpt_format="torch_dist", tensor_model_parallel_size=1, no_save_optim=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": sharded}
    saved = folder / ("release" if tracker == "release" else f"iter_{iteration:07d}")
    saved.mkdir(parents=True)
    dist_checkpointing.save(state, str(saved), content_metadata=metadata)
    (folder / "latest_checkpointed_iteration.txt").write_text(tracker)


def _write_checkpoints(rank, world, port, hf: str, out: str) -> None:
    from transformers import AutoConfig

    from miles_async.backends.megatron.convert import HFReader, export_hf, load_hf
    from miles_async.backends.megatron.model import ArchSpec, ParallelSizes, build_gpt_model, init_parallel

    init_parallel(rank, world, ParallelSizes(), "127.0.0.1", port, seed=0)
    arch = ArchSpec.from_hf(AutoConfig.from_pretrained(hf))
    model = build_gpt_model(arch, ParallelSizes())
    load_hf(model, HFReader(hf), arch, tp=1, rank=0)
    with torch.no_grad():  # weights other than --hf-checkpoint's, so that starting from them shows
        for p in model.parameters():
            p.mul_(1.5)
    root = Path(out)
    torch.save(dict(export_hf(model, arch)), root / "source.pt")
    # Megatron-LM pads the vocabulary to a multiple of 128 x TP (--make-vocab-size-divisible-by), this backend to
    # one of TP: the embedding's rows past the vocabulary are zeros in the checkpoint, left out on the load.
    padded = build_gpt_model(dataclasses.replace(arch, vocab_size=128), ParallelSizes())
    with torch.no_grad():
        for p, q in zip(padded.parameters(), model.parameters(), strict=True):
            p.zero_()[tuple(slice(0, n) for n in q.shape)].copy_(q)
    assert padded.embedding.word_embeddings.weight.shape[0] == 128 > arch.vocab_size
    _save_as_megatron_lm(padded, root / "numbered", "0", 0)
    _save_as_megatron_lm(model.to(torch.bfloat16), root / "bf16_release", "release", 1)  # as Miles' converter
    torch.save(dict(export_hf(model, arch)), root / "source_bf16.pt")
    _save_as_megatron_lm(model, root / "renamed", "release", 1, rename=RENAMED)


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torch_dist")
    assert spawn_ranks(_write_checkpoints, 1, str(tiny_model), str(root), timeout=120) == [0]
    return root


def _flags(tiny_model: Path, task: Path, out: Path, ref: Path, *extra: str) -> list[str]:
    save = out / "ckpt"
    ckpt = ("--ref-load", str(ref), "--load", str(save), "--save", str(save))
    return tiny_train_flags(
        tiny_model, task, out, "--global-batch-size", "8", *ckpt, *extra, "--train-backend", "megatron"
    )


@pytest.mark.parametrize("layout", ["numbered", "bf16_release"])
def test_a_torch_dist_ref_load_and_an_empty_load_pass_check_config(checkpoints, tiny_model, tiny_task, tmp_path,
                                                                    layout, caplog):  # fmt: skip
    """Miles' first start: --ref-load <model>_torch_dist (tracker "0" with iter_0000000/, or "release" with
    release/) and --load = --save, a folder not made yet; a fresh run from rollout 0 whose policy starts from
    --ref-load, logged. The torch backend refuses that checkpoint, naming what to give instead."""
    from miles_async.arguments import ConfigError, parse_args

    argv = _flags(tiny_model, tiny_task[0], tmp_path, checkpoints / layout, "--check-config")
    with caplog.at_level(logging.INFO, logger="miles_async.config.checkpoint"):
        cfg = parse_args(argv)
    assert cfg.loop.start_rollout_id == 0 and cfg.checkpoint.load is None
    assert cfg.train.init_weights == cfg.train.ref_model_path == str(checkpoints / layout)
    assert f"--load {tmp_path / 'ckpt'} holds no checkpoint: a fresh run from rollout 0, the policy from " \
           f"--ref-load {checkpoints / layout}" in caplog.messages  # fmt: skip
    with pytest.raises(ConfigError, match=r"^--ref-load: .* is a Megatron \(torch_dist\) checkpoint, which "
                       r"--train-backend fsdp does not read .* \(--hf-checkpoint's, when the reference"):  # fmt: skip
        parse_args(argv[:-2])


def test_a_release_checkpoint_as_load_starts_a_fresh_run_from_its_weights(checkpoints, tiny_model, tiny_task,
                                                                            tmp_path, caplog):  # fmt: skip
    """Megatron-LM loads a release checkpoint's weights as a fresh start (iteration 0, no optimizer): so does
    --load here on the Megatron backend; the torch backend refuses it, naming --hf-checkpoint."""
    from miles_async.arguments import ConfigError, parse_args

    release = checkpoints / "bf16_release"
    argv = tiny_train_flags(tiny_model, tiny_task[0], tmp_path, "--global-batch-size", "8", "--load", str(release),
                            "--check-config", "--train-backend", "megatron")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="miles_async.config.checkpoint"):
        cfg = parse_args(argv)
    assert (cfg.loop.start_rollout_id, cfg.checkpoint.load, cfg.train.init_weights) == (0, None, str(release))
    assert [m for m in caplog.messages if m.startswith("--load")] == [
        f"--load {release} holds a release checkpoint: a fresh run from its weights ({release / 'release'})"
    ]
    with pytest.raises(ConfigError, match=r"^--load: .* is a Megatron-LM release checkpoint .* as --hf-checkpoint"):
        parse_args(argv[:-2])


def _load_worker(rank, world, port, runs: dict[str, list[str]], out: str) -> None:
    from miles_async.arguments import parse_args
    from miles_async.backends.megatron.actor import MegatronTrainActor
    from miles_async.backends.megatron.convert import export_hf

    result = {}
    for name, argv in runs.items():
        actor = MegatronTrainActor(parse_args(argv).train, rank, world, total_optimizer_steps=10)
        try:
            actor.init_process_group("127.0.0.1", port)
        except Exception as e:  # noqa: BLE001 - the negative control's error is the result
            result[name] = str(e)
            continue
        result[name] = actor.hf_state()
        if actor.ref_model is not None:  # every TP rank takes part in the gathers
            ref = export_hf(actor.ref_model, actor.arch, actor.tp, actor.tp_group)
            result[name + "/ref"] = {k: v.clone() for k, v in ref}
    if rank == 0:
        torch.save(result, out)


def test_megatron_starts_from_a_torch_dist_ref_load_at_tensor_parallel_2(checkpoints, tiny_model, tiny_task, tmp_path):
    """The checkpoint written at TP 1 loads into TP 2 (dist_checkpointing reshards it): the policy (fresh --load)
    and the reference model (--use-kl-loss) hold the source's weights, bf16 ones as bf16 values; so does the
    policy of a run whose --load is the release checkpoint itself. Negative control: the same checkpoint with one
    key renamed fails, naming the key."""
    task = tiny_task[0]
    kl = ("--use-kl-loss", "--kl-loss-coef", "0.1")
    tp2 = ("--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2")
    runs = {
        name: _flags(tiny_model, task, tmp_path / name, checkpoints / name, *kl, *tp2)
        for name in ("numbered", "bf16_release", "renamed")
    }
    # Megatron-LM's --load of a release checkpoint: a fresh run from its weights (the reference: --hf-checkpoint).
    runs["load_release"] = tiny_train_flags(tiny_model, task, tmp_path / "lr", "--global-batch-size", "8",
                                            "--load", str(checkpoints / "bf16_release"), *tp2,
                                            "--train-backend", "megatron")  # fmt: skip
    out = tmp_path / "loaded.pt"
    assert spawn_ranks(_load_worker, 2, runs, str(out), timeout=180) == [0, 0]
    loaded = torch.load(out, weights_only=False)
    for name, source in (
        ("numbered", "source.pt"),
        ("bf16_release", "source_bf16.pt"),
        ("load_release", "source_bf16.pt"),
    ):
        expected = torch.load(checkpoints / source)
        for part in (name, name + "/ref") if name + "/ref" in loaded else (name,):
            assert sorted(loaded[part]) == sorted(expected)
            for k, v in expected.items():
                assert torch.equal(loaded[part][k], v.float()), (part, k)
    assert "load_release/ref" not in loaded and sorted(loaded) == sorted(
        ["numbered", "numbered/ref", "bf16_release", "bf16_release/ref", "load_release", "renamed"]
    )
    assert f"has no tensor '{RENAMED}'" in loaded["renamed"]
    assert "'decoder.final_norm.weight', which the model does not name" in loaded["renamed"]
