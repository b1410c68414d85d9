"""Tests for miles_async.assets: tiny model, task datasets and the SmolLM2 builder."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from miles_async.assets import arith_dataset, smollm2, tiny_model  # noqa: E402
from miles_async.assets.arith_dataset import (  # noqa: E402
    make_addition_dataset,
    make_multiplication_dataset,
    read_records,
)
from miles_async.assets.tiny_model import (  # noqa: E402
    make_tiny_model,
    make_tiny_task_dataset,
)

# --------------------------------------------------------------------- tiny model


@pytest.mark.parametrize("arch", tiny_model.ARCHES)
def test_tiny_model_loads_with_auto_classes_and_chat_template(tmp_path: Path, arch: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = make_tiny_model(tmp_path / "tiny", seed=0, arch=arch)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)

    assert tok.is_fast
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
    assert model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token == "<pad>" and tok.pad_token_id != im_end
    assert GenerationConfig.from_pretrained(path).eos_token_id == im_end

    messages = [{"role": "user", "content": "repeat 7"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nrepeat 7<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # Specials must be single tokens and characters must round-trip exactly.
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_end) == 1
    assert tok.decode(ids) == text
    templated = tok.apply_chat_template(messages, add_generation_prompt=True)
    templated_ids = templated["input_ids"] if not isinstance(templated, list) else templated
    assert list(templated_ids) == ids

    assert tok.decode(tok("what is 7 * 8? 56", add_special_tokens=False)["input_ids"]) == "what is 7 * 8? 56"
    # The normalizer lower-cases, so arbitrary English prompts still encode.
    assert tok.unk_token_id not in tok("What Is 7?", add_special_tokens=False)["input_ids"]

    enc = tok([text], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, len(ids), len(tok))
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= len(ids) + 4


def test_tiny_model_is_deterministic_in_seed(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = load_file(make_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)


def test_tiny_model_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make_tiny_model(tmp_path / "x", arch="gpt9")


def test_tiny_task_dataset(tmp_path: Path) -> None:
    train_path, eval_path = make_tiny_task_dataset(tmp_path, n_train=50, n_eval=20, seed=1, parquet=True)
    train, eval_ = read_records(train_path), read_records(eval_path)
    assert len(train) == 50 and len(eval_) == 20
    uids = [r["uid"] for r in train + eval_]
    assert len(set(uids)) == len(uids)
    for r in train + eval_:
        m = re.fullmatch(r"repeat (\d)", r["prompt"])
        assert m and m.group(1) == r["label"]
    # Balanced over 1..9 (no 0: "000" would also parse as 0).
    assert sorted(r["label"] for r in train) == sorted(str(1 + i % 9) for i in range(50))
    assert read_records(tmp_path / "train.parquet") == train

    single = read_records(make_tiny_task_dataset(tmp_path / "one", n_train=8, n_eval=4, digits=(7,))[0])
    assert {r["prompt"] for r in single} == {"repeat 7"} and {r["label"] for r in single} == {"7"}
    with pytest.raises(ValueError):
        make_tiny_task_dataset(tmp_path / "bad", digits=(12,))


# ----------------------------------------------------------------- arithmetic


def _operands(prompt: str, op: str) -> tuple[int, int]:
    nums = [int(x) for x in re.findall(r"\d+", prompt)]
    assert len(nums) == 2, prompt
    return nums[0], nums[1]


def _check_splits(train: list[dict], eval_: list[dict], op) -> None:
    for r in train + eval_:
        assert set(r) == {"prompt", "label", "uid"}
        assert all(isinstance(v, str) for v in r.values())
        a, b = _operands(r["prompt"], op)
        assert r["label"] == str(op(a, b)), r
    uids = [r["uid"] for r in train + eval_]
    assert len(set(uids)) == len(uids)
    pair = lambda r: frozenset(_operands(r["prompt"], op))  # noqa: E731
    assert not {pair(r) for r in train} & {pair(r) for r in eval_}


def test_multiplication_dataset_splits(tmp_path: Path) -> None:
    train_path, eval_path = make_multiplication_dataset(tmp_path, seed=0, parquet=True)
    assert (train_path.name, eval_path.name) == ("train.jsonl", "eval.jsonl")
    train, eval_ = read_records(train_path), read_records(eval_path)
    mul = lambda a, b: a * b  # noqa: E731
    _check_splits(train, eval_, mul)

    all_pairs = {frozenset(_operands(r["prompt"], mul)) for r in train + eval_}
    assert len(all_pairs) == 45  # every unordered pair of 1..9, none lost
    eval_pairs = {frozenset(_operands(r["prompt"], mul)) for r in eval_}
    assert len(eval_pairs) == 9
    assert len(train) > 100  # an epoch bigger than the 100-fact table
    # Both operand orders of every non-square pair are on the same side.
    ordered = {_operands(r["prompt"], mul) for r in eval_}
    assert all((b, a) in ordered for a, b in ordered)
    # Every prompt asks for the bare number, which the reward relies on.
    assert all("only" in r["prompt"] or "just" in r["prompt"] for r in train + eval_)

    assert read_records(tmp_path / "train.parquet") == train
    assert read_records(tmp_path / "eval.parquet") == eval_


def test_multiplication_dataset_seeded(tmp_path: Path) -> None:
    a = read_records(make_multiplication_dataset(tmp_path / "a", seed=5)[1])
    b = read_records(make_multiplication_dataset(tmp_path / "b", seed=5)[1])
    c = read_records(make_multiplication_dataset(tmp_path / "c", seed=6)[1])
    assert a == b
    assert {r["uid"] for r in a} != {r["uid"] for r in c}
    assert not (tmp_path / "a" / "train.parquet").exists()


def test_addition_dataset_splits(tmp_path: Path) -> None:
    train_path, eval_path = make_addition_dataset(tmp_path, seed=0, max_train=500, max_eval=80, parquet=True)
    train, eval_ = read_records(train_path), read_records(eval_path)
    assert len(train) == 500 and len(eval_) == 80
    add = lambda a, b: a + b  # noqa: E731
    _check_splits(train, eval_, add)
    for r in train + eval_:
        assert all(10 <= x <= 99 for x in _operands(r["prompt"], add))
    assert read_records(tmp_path / "eval.parquet") == eval_


def test_dataset_cli_writes_jsonl_and_parquet(tmp_path: Path) -> None:
    arith_dataset.main(["--task", "mul", "--out", str(tmp_path / "m"), "--format", "parquet"])
    arith_dataset.main(["--task", "add", "--out", str(tmp_path / "a")])
    for name in ("train.jsonl", "eval.jsonl", "train.parquet", "eval.parquet"):
        assert (tmp_path / "m" / name).is_file()
    assert read_records(tmp_path / "m" / "eval.jsonl") == read_records(tmp_path / "m" / "eval.parquet")
    assert (tmp_path / "a" / "train.jsonl").is_file() and not (tmp_path / "a" / "train.parquet").exists()


def test_split_rejects_bad_fraction(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        make_multiplication_dataset(tmp_path, eval_fraction=1.0)


# ------------------------------------------------------------------- SmolLM2


@pytest.fixture
def fake_builder(monkeypatch: pytest.MonkeyPatch):
    """Replace the download and the conversion with cheap stand-ins that count calls."""
    calls: list[Path] = []

    def ensure_wheel(wheels_dir: Path) -> Path:
        return wheels_dir / smollm2.WHEEL_FILENAME

    def build(wheel: Path, out: Path) -> None:
        calls.append(out)
        assert out.parent.name == "models" and out.name.startswith(".")  # builds beside the target, hidden
        for name in smollm2.REQUIRED_FILES:
            (out / name).write_text("{}")

    monkeypatch.setattr(smollm2, "_ensure_wheel", ensure_wheel)
    monkeypatch.setattr(smollm2, "_build_model_folder", build)
    return calls


def test_prepare_smollm2_is_idempotent(tmp_path: Path, fake_builder: list[Path]) -> None:
    path = smollm2.prepare_smollm2(tmp_path)
    assert path == tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert smollm2.is_complete(path)
    assert smollm2.prepare_smollm2(tmp_path) == path
    assert len(fake_builder) == 1
    # Only the finished folder (and the lock) remain: no temp debris.
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")) == [path.name]


def test_prepare_smollm2_default_cache_from_env(
    tmp_path: Path, fake_builder: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_ASYNC_CACHE", str(tmp_path / "envcache"))
    assert smollm2.prepare_smollm2() == tmp_path / "envcache" / "models" / "SmolLM2-135M-Instruct"


def test_prepare_smollm2_ignores_and_cleans_leftover_temp(tmp_path: Path, fake_builder: list[Path]) -> None:
    models = tmp_path / "models"
    leftover = models / ".SmolLM2-135M-Instruct.tmp-crashed"
    leftover.mkdir(parents=True)
    for name in smollm2.REQUIRED_FILES:  # even a "complete-looking" temp must not count
        (leftover / name).write_text("{}")
    path = smollm2.prepare_smollm2(tmp_path)
    assert len(fake_builder) == 1
    assert not leftover.exists()
    assert smollm2.is_complete(path)


def test_prepare_smollm2_crash_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smollm2, "_ensure_wheel", lambda d: d / smollm2.WHEEL_FILENAME)

    def crash(wheel: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(smollm2, "_build_model_folder", crash)
    with pytest.raises(RuntimeError, match="boom"):
        smollm2.prepare_smollm2(tmp_path)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_prepare_smollm2_rebuilds_incomplete_target(tmp_path: Path, fake_builder: list[Path]) -> None:
    target = smollm2.model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert smollm2.prepare_smollm2(tmp_path) == target
    assert len(fake_builder) == 1 and smollm2.is_complete(target)


def test_prepare_smollm2_rejects_incomplete_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smollm2, "_ensure_wheel", lambda d: d / smollm2.WHEEL_FILENAME)
    monkeypatch.setattr(smollm2, "_build_model_folder", lambda w, out: (out / "config.json").write_text("{}"))
    with pytest.raises(RuntimeError, match="incomplete"):
        smollm2.prepare_smollm2(tmp_path)
    assert not smollm2.model_dir(tmp_path).exists()
