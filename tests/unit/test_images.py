"""vision/images.load_image: what an image reference in the data (--multimodal-keys) may be (a path, absolute or
relative to the data file's folder, a data: URI, bare base64) and the error that names what is wrong with one."""

from __future__ import annotations

import base64
import io
import random

import pytest
from PIL import Image

from miles_async.vision.images import ImageError, as_data_uri, load_image


def _png(size=(24, 16)) -> bytes:
    """Noise (so its base64 is as long as a real image's), with one known pixel."""
    img = Image.frombytes("RGB", size, random.Random(0).randbytes(size[0] * size[1] * 3))
    img.putpixel((3, 3), (200, 10, 10))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


FORMS = ["absolute", "relative", "data_uri", "base64"]


def _ref(form: str, tmp_path, png: bytes) -> str:
    """``png`` written under tmp_path/imgs, referred to in ``form``."""
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png)
    return {
        "absolute": str(tmp_path / "imgs" / "a.png"),
        "relative": "imgs/a.png",
        "data_uri": "data:image/png;base64," + base64.b64encode(png).decode(),
        "base64": base64.b64encode(png).decode(),
    }[form]


@pytest.mark.parametrize("form", FORMS)
def test_each_form_of_reference_gives_the_same_rgb_image(tmp_path, form):
    png = _png()
    ref = _ref(form, tmp_path, png)
    assert form != "base64" or len(ref) > 256  # bare base64 is told from a path by its length
    img = load_image(ref, base_dir=tmp_path)
    assert img.mode == "RGB" and img.size == (24, 16) and img.getpixel((3, 3)) == (200, 10, 10)


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("", "an image reference must be a non-empty string"),
        (7, "an image reference must be a non-empty string"),
        ("data:image/png,AAAA", "a data: URI must be base64"),
        ("data:image/png;base64,@@@@", "the data: URI's base64 does not decode"),
        ("missing/b.png", "image file not found: missing/b.png"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a readable image: data:image"),
    ],
)
def test_a_bad_reference_is_refused_saying_why(tmp_path, ref, message):
    with pytest.raises(ImageError) as refused:
        load_image(ref, base_dir=tmp_path)
    assert str(refused.value).startswith(message), str(refused.value)


def test_a_file_that_is_not_an_image_is_named(tmp_path):
    (tmp_path / "notes.png").write_text("hello")
    with pytest.raises(ImageError) as refused:
        load_image("notes.png", base_dir=tmp_path)
    assert str(refused.value).startswith("not a readable image: notes.png")


@pytest.mark.parametrize("form", FORMS)
def test_each_form_of_reference_becomes_a_data_uri_of_the_same_image(tmp_path, form):
    """What vLLM gets (it takes images by URL and reads none of our files): the same picture, its format named."""
    png = _png()
    ref = _ref(form, tmp_path, png)
    uri = as_data_uri(ref, base_dir=tmp_path)
    assert uri == "data:image/png;base64," + base64.b64encode(png).decode()
    assert load_image(uri).getpixel((3, 3)) == (200, 10, 10)


def test_a_reference_that_is_no_image_gets_no_data_uri(tmp_path):
    (tmp_path / "notes.txt").write_text("not a picture")
    with pytest.raises(ImageError, match="not a readable image"):
        as_data_uri(str(tmp_path / "notes.txt"))
    with pytest.raises(ImageError, match="image file not found"):
        as_data_uri(str(tmp_path / "missing.png"))
    with pytest.raises(ImageError, match="does not decode"):
        as_data_uri("data:image/png;base64,@@@")
