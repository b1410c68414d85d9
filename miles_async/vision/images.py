"""Image references (a file path, a ``data:`` URI or bare base64) and how they load, with errors that say which.

A sample carries its images by reference, the strings of its dataset's --multimodal-keys column: the engines and
the trainer each load them when they need the pixels, so no pixel array travels through Ray's object store.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any


class ImageError(ValueError):
    """An image reference that names no readable image."""


def _decoded(ref: str) -> bytes | None:
    """The bytes of a ``data:`` URI or of bare base64; None when ``ref`` is neither (a path, then)."""
    if ref.startswith("data:"):
        head, sep, payload = ref.partition(",")
        if not sep or ";base64" not in head:
            raise ImageError("a data: URI must be base64 ('data:image/png;base64,...')")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"the data: URI's base64 does not decode ({e})") from e
    # A path holds a '/' or a '.', and base64 of an image is far longer than any path; try it as base64 only then.
    if len(ref) > 256 and "." not in ref[-8:]:
        try:
            return base64.b64decode(ref, validate=True)
        except (binascii.Error, ValueError):
            return None
    return None


def resolve_path(ref: str, base_dir: Path | None) -> Path:
    """A path reference as a file: as given, else relative to ``base_dir`` (the dataset's folder)."""
    path = Path(ref)
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = base_dir / path
    return path


def _bytes_of(ref: Any, base_dir: Path | None) -> bytes:
    """The encoded image ``ref`` names: a data: URI's or bare base64's bytes, else the file's."""
    if not isinstance(ref, str) or not ref:
        raise ImageError(f"an image reference must be a non-empty string (a path, data: URI or base64), got {ref!r}")
    raw = _decoded(ref)
    if raw is not None:
        return raw
    path = resolve_path(ref, base_dir)
    if not path.is_file():
        raise ImageError(f"image file not found: {ref}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise ImageError(f"cannot read image file {ref}: {e}") from e


def _opened(raw: bytes, ref: str) -> Any:
    """The decoded ``PIL.Image`` of ``raw`` (pixels loaded); ``ImageError`` naming ``ref`` when it is none."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
        return img
    except (UnidentifiedImageError, OSError, ValueError) as e:
        shown = ref if len(ref) <= 80 else ref[:60] + "..."
        raise ImageError(f"not a readable image: {shown} ({e})") from e


def as_data_uri(ref: str, base_dir: Path | None = None) -> str:
    """The image ``ref`` names as a ``data:`` URI (a data: URI as given): for an engine that takes images by URL
    and should not read our files; ``ImageError`` saying why not."""
    raw = _bytes_of(ref, base_dir)
    if ref.startswith("data:"):
        return ref
    kind = (_opened(raw, ref).format or "png").lower()
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode("ascii")


def load_image(ref: Any, base_dir: Path | None = None) -> Any:
    """The RGB ``PIL.Image`` that ``ref`` names; ``ImageError`` saying why not."""
    return _opened(_bytes_of(ref, base_dir), ref).convert("RGB")
