"""The test command's time budget and skip policy, read from tests/budget.toml and tests/allowed_skips.toml.

Pure: the root conftest feeds it node ids and skip reports and applies what it answers (a ``timeout`` and a
``slow`` mark per test, a failure for a skip CI does not allow).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@dataclass(frozen=True)
class Cap:
    seconds: float
    slow: bool
    why: str = ""


class Budget:
    """Every test's cap: the default, or the longest-prefix entry of the slow list naming it."""

    def __init__(self, default_cap_s: float, slow: dict[str, tuple[float, str]]):
        self.default = Cap(default_cap_s, slow=False)
        self.slow = {key: Cap(cap, slow=True, why=why) for key, (cap, why) in slow.items()}

    @classmethod
    def load(cls, path: Path = TESTS / "budget.toml") -> Budget:
        data = tomllib.loads(path.read_text())
        slow = {}
        for key, entry in data.get("slow", {}).items():
            if set(entry) != {"cap_s", "why"} or not str(entry["why"]).strip():
                raise ValueError(f"{path}: [slow] {key!r} needs exactly cap_s and a non-empty why, got {entry}")
            if entry["cap_s"] <= data["default_cap_s"]:
                raise ValueError(f"{path}: [slow] {key!r}: cap_s {entry['cap_s']} is within the default cap")
            slow[key] = (float(entry["cap_s"]), str(entry["why"]))
        return cls(float(data["default_cap_s"]), slow)

    def cap(self, nodeid: str) -> Cap:
        matches = [key for key in self.slow if _covers(key, nodeid)]
        return self.slow[max(matches, key=len)] if matches else self.default

    def stale_entries(self, root: Path = ROOT) -> list[str]:
        """Entries whose file or folder no longer exists (a renamed or removed test)."""
        return [key for key in self.slow if not (root / key.split("::", 1)[0]).exists()]


def _covers(key: str, nodeid: str) -> bool:
    """A folder ("tests/e2e/"), a file, a test or one parametrization of it covers the node ids under it."""
    if key.endswith("/"):
        return nodeid.startswith(key)
    return nodeid == key or nodeid.startswith(key + "::") or nodeid.startswith(key + "[")


def allowed_skips(path: Path = TESTS / "allowed_skips.toml") -> dict[str, str]:
    """Node id (or prefix, as in the slow list) -> why this machine may skip it under CI=true."""
    data = tomllib.loads(path.read_text()).get("skips", {})
    for key, why in data.items():
        if not str(why).strip():
            raise ValueError(f"{path}: {key!r} needs its reason")
    return data


def skip_allowed(nodeid: str, gpu: bool, allowlist: dict[str, str]) -> bool:
    """Whether CI may skip this test: a GPU test, or one the allowlist names."""
    return gpu or any(_covers(key, nodeid) for key in allowlist)
