"""Per-tensor checksums of model weights, for ``--check-weight-update-equal``.

The trainer casts its parameters to the engine's dtype before sending them and the engine
copies them into parameters of that dtype, so after a correct update both sides hold the
same bytes: a SHA-256 of each tensor's bytes (in the engine's dtype) must match exactly.
The float64 sum travels along only to make a mismatch readable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the inference controller compares checksums and needs no torch
    import torch

Checksums = dict[str, dict]  # name -> {"sha256": hex, "sum": float, "shape": [..], "dtype": str}


def tensor_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> Checksums:
    import torch

    out: Checksums = {}
    for name, t in named_tensors:
        t = t.detach().to(device="cpu", dtype=dtype or t.dtype).contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        out[name] = {
            "sha256": hashlib.sha256(raw).hexdigest(),
            "sum": float(t.double().sum()),
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
        }
    return out


def first_mismatch(expected: Checksums, actual: Checksums) -> str | None:
    """None when every expected tensor is present in ``actual`` with the same bytes; else a description
    of the first tensor that differs (and how many do)."""
    bad = [n for n in expected if n not in actual or actual[n]["sha256"] != expected[n]["sha256"]]
    if not bad:
        return None
    name = bad[0]
    if name not in actual:
        what = f"tensor {name!r} is missing"
    else:
        e, a = expected[name], actual[name]
        what = (
            f"tensor {name!r} differs (expected sum {e['sum']!r} {e['dtype']}{e['shape']}, "
            f"got sum {a['sum']!r} {a['dtype']}{a['shape']})"
        )
    return what + (f"; {len(bad)} of {len(expected)} tensors differ" if len(bad) > 1 else "")
