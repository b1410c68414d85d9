"""A model folder's tokenizer, as ``AutoTokenizer`` builds it, without ``AutoTokenizer``'s cost where it can.

``transformers.AutoTokenizer`` imports ``configuration_utils`` and with it torch: about 3-4 s of CPU in the rollout
executor, which only tokenizes. The class it picks depends only on the folder's ``tokenizer_config.json`` and
``config.json``, the names of its files and the transformers version, so the class is remembered under the cache
folder by a digest of those; a later load of any folder with the same digest takes that class directly, which
gives the same tokenizer without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from miles_async.utils.cache import cache_dir
from miles_async.utils.plugins import load_object

logger = logging.getLogger(__name__)

CACHE_FILE = "tokenizer-classes.json"
# The files AutoTokenizer reads to choose a class (their contents), beside the folder's file names.
_CHOICE_FILES = ("tokenizer_config.json", "config.json")


def class_key(model_path: str) -> str | None:
    """The digest of what decides ``AutoTokenizer``'s class for ``model_path``; None for anything but a local
    folder (a hub id: AutoTokenizer decides)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return None
    digest = hashlib.sha256(metadata.version("transformers").encode())
    digest.update(json.dumps(sorted(p.name for p in folder.iterdir())).encode())
    for name in _CHOICE_FILES:
        path = folder / name
        digest.update(name.encode() + (path.read_bytes() if path.is_file() else b"\0absent"))
    return digest.hexdigest()


def _remembered() -> dict[str, str]:
    try:
        found = json.loads((cache_dir() / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _remember(key: str, class_path: str) -> None:
    """Adds ``key``'s class to the cache file (written whole and renamed, so a reader never sees half of it); a
    cache that cannot be written only costs the next load its AutoTokenizer."""
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        entries = {**_remembered(), key: class_path}
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=f".{CACHE_FILE}.", delete=False) as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(f.name, folder / CACHE_FILE)
    except OSError as e:
        logger.debug("could not remember the tokenizer class in %s: %s", cache_dir(), e)


def load_tokenizer(model_path: str) -> Any:
    """``AutoTokenizer.from_pretrained(model_path)``'s tokenizer; through its remembered class when a folder with
    the same ``class_key`` was loaded before on this machine."""
    key = class_key(model_path)
    class_path = _remembered().get(key) if key else None
    if class_path is not None:
        try:
            return load_object(class_path, "tokenizer class").from_pretrained(model_path)
        except Exception as e:  # noqa: BLE001 - a stale entry: AutoTokenizer decides again below
            logger.debug("remembered tokenizer class %s failed for %s: %s", class_path, model_path, e)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if key is not None:
        cls = type(tokenizer)
        _remember(key, f"{cls.__module__}:{cls.__qualname__}")
    return tokenizer
