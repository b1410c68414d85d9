"""Each image holds every runtime requirement: requirements.txt, torch, and requirements-megatron.txt in the GPU
image, each installed by the Dockerfile or provided by its base image at a version that serves the project.

No image can be built where the tests run (base images cannot be pulled), so the check is static: it reads the
Dockerfiles, follows what their steps install (pip's requirement files, the grep filters that derive them, the
setup script the CPU image runs) and which of the repository's files each step has at hand (COPY), and compares
that with the requirement files and, for the GPU image's base, docker/sglang-base.toml: a declared record of
what SGLang's release image ships."""

from __future__ import annotations

import os
import re
import shlex
import tomllib
from dataclasses import dataclass, field

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.scripts.helpers import ROOT

GPU, CPU = ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"
BASE = tomllib.loads((ROOT / "docker" / "sglang-base.toml").read_text())
REDIRECTS = {">", ">>", ">&", "&>", "<", "2>"}


def requirements(lines: list[str]) -> list[Requirement]:
    return [Requirement(spec) for line in lines if (spec := line.split("#", 1)[0].strip())]


def runtime_requirements(gpu: bool) -> list[Requirement]:
    """requirements.txt, torch (which requirements.txt leaves to where it is installed) and, for the GPU image,
    the Megatron backend's (megatron-core and what it imports undeclared)."""
    reqs = [*requirements((ROOT / "requirements.txt").read_text().splitlines()), Requirement("torch")]
    if gpu:
        reqs += requirements((ROOT / "requirements-megatron.txt").read_text().splitlines())
    return reqs


@dataclass
class Image:
    """What a Dockerfile's steps put in the image, as far as this check follows them."""

    base: str = ""
    installed: dict[str, Requirement] = field(default_factory=dict)  # canonical name -> as pip was asked for it
    missing: list[str] = field(default_factory=list)  # files a step reads that are not in the image at that step
    files: dict[str, list[str] | None] = field(default_factory=dict)  # path -> lines (None: content unknown)
    everything: bool = False  # after COPY . .

    def read(self, path: str) -> list[str] | None:
        path = os.path.normpath(path)
        if path in self.files:
            return self.files[path]
        if self.everything and (ROOT / path).is_file():
            return (ROOT / path).read_text().splitlines()
        self.missing.append(path)
        return []

    def copy(self, source: str, dest: str) -> None:
        if source == ".":
            self.everything = True
            return
        assert (ROOT / source).is_file(), f"COPY {source}: only files and . are followed"
        target = f"{dest}/{os.path.basename(source)}" if dest.endswith("/") or dest == "." else dest
        self.files[os.path.normpath(target)] = (ROOT / source).read_text().splitlines()

    def run(self, text: str) -> None:
        """A shell command line: its commands, split at &&, ||, ; and |, each with its output file if any."""
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words, out, tokens = [], None, list(lexer)
        while tokens:
            token = tokens.pop(0)
            if token in {"&&", "||", ";", "|"}:
                self.command(words, out)
                words, out = [], None
            elif token in REDIRECTS:
                target = tokens.pop(0)
                out = target if token in {">", ">>"} else out
            else:
                words.append(token)
        self.command(words, out)

    def command(self, words: list[str], out: str | None) -> None:
        while words and re.fullmatch(r"\w+=.*", words[0]):  # VAR=value before the command
            words = words[1:]
        lines = None
        if words and words[0] == "grep":
            lines = self.grep(words[1:])
        elif words and words[0] in ("bash", "sh"):
            self.script(words[1])
        elif (i := next((i for i, w in enumerate(words[:-1]) if re.search(r"(^|/)pip3?$", w)), None)) is not None:
            if words[i + 1] == "install":
                self.pip_install(words[i + 2 :])
        if out is not None:
            self.files[os.path.normpath(out)] = lines

    def grep(self, args: list[str]) -> list[str] | None:
        flags = "".join(a[1:] for a in args if a.startswith("-"))
        pattern, *source = [a for a in args if not a.startswith("-")]
        if not source:
            return None  # standard input: what it filters is not followed
        lines = self.read(source[0]) or []
        found = re.compile(pattern, re.IGNORECASE if "i" in flags else 0)
        return [line for line in lines if bool(found.search(line)) != ("v" in flags)]

    def pip_install(self, args: list[str]) -> None:
        words = iter(args)
        for word in words:
            if word in ("-r", "--requirement"):
                path = next(words)
                lines = self.read(path)
                assert lines is not None, f"pip install -r {path}: its content comes from a command not followed here"
                self.installed |= {canonicalize_name(r.name): r for r in requirements(lines)}
            elif word in ("-c", "--constraint", "-e", "--editable", "-i", "--index-url", "--extra-index-url"):
                next(words)
            elif not word.startswith("-") and word != ".":
                req = Requirement(word)
                self.installed[canonicalize_name(req.name)] = req

    def script(self, path: str) -> None:
        """A setup script of the repository: the repository files it reads ($ROOT/...) must be in the image, and
        its pip installs and those of the files it sources count, with its variables' defaults
        (NAME="${OVERRIDE:-default}") filled in."""
        lines = self.read(path) or []
        # What it sources is read first, as bash does: its variables and pip installs count too.
        for sourced in re.findall(r'^\s*(?:source|\.)\s+"\$ROOT/([\w./-]+)"', "\n".join(lines), re.M):
            lines = [*(self.read(sourced) or []), *lines]
        text = "\n".join(lines)
        for used in re.findall(r"\$ROOT/([\w./-]+)", text):
            self.read(used)
        variables = {"ROOT": "."} | dict(re.findall(r'^\s*(\w+)="\$\{\w+:-([^}]*)\}"', text, re.M))
        for line in lines:
            if re.search(r'pip3?"?\s+install', line):
                self.run(re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m[1], m[0]), line))


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined and comments left out."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not (current or line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (current + line).strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        current = ""
    return out


def read_image(text: str) -> Image:
    image, args = Image(), {}
    for keyword, rest in instructions(text):
        # Build arguments take their defaults; the shell's own variables stay for it.
        rest = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), rest)
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
        elif keyword == "FROM":
            image.base = rest.split()[0]
        elif keyword == "COPY":
            *sources, dest = [w for w in shlex.split(rest) if not w.startswith("--")]
            for source in sources:
                image.copy(source, dest)
        elif keyword == "RUN":
            image.run(rest)
    return image


def problems(text: str, gpu: bool) -> list[str]:
    """What keeps the image from holding every runtime requirement, one line each; empty when nothing does."""
    image = read_image(text)
    found = [
        f"a step reads {path}, which is not in the image then (COPY it first)" for path in dict.fromkeys(image.missing)
    ]
    provides = BASE["provides"] if gpu and image.base == BASE["image"] else {}
    if gpu and not provides:
        found.append(f"the base image {image.base} is not the one docker/sglang-base.toml describes")
    for req in runtime_requirements(gpu):
        name = canonicalize_name(req.name)
        if name in image.installed:
            if req.specifier and image.installed[name].specifier != req.specifier:
                found.append(f"installs {image.installed[name]}, where the requirement is {req}")
        elif name not in provides:
            found.append(f"{req}: neither installed nor provided by the base image {image.base}")
        elif not req.specifier.contains(provides[name], prereleases=True) and name not in BASE["kept"]:
            found.append(f"{req}: the base image provides {name} {provides[name]} and it is not installed")
    found += [
        f"installs {image.installed[name]} over the base image's {name} {version} (docker/sglang-base.toml)"
        for name, version in provides.items()
        if name in image.installed
    ]
    return found


@pytest.mark.parametrize("dockerfile,gpu", [(GPU, True), (CPU, False)], ids=["Dockerfile", "Dockerfile.cpu"])
def test_each_image_holds_every_runtime_requirement(dockerfile, gpu):
    assert problems(dockerfile.read_text(), gpu) == []


def test_the_gpu_image_is_based_on_the_sglang_the_tests_run():
    sglang = next(
        r for r in requirements((ROOT / "requirements-sglang.txt").read_text().splitlines()) if r.name == "sglang"
    )
    assert sglang.specifier.contains(BASE["provides"]["sglang"]), (sglang, BASE["provides"]["sglang"])
    assert read_image(GPU.read_text()).base == BASE["image"]
    assert f":v{BASE['provides']['sglang']}-" in BASE["image"]
    assert set(BASE["kept"]) <= set(BASE["provides"]) and all(reason.strip() for reason in BASE["kept"].values())


def test_the_check_fails_an_image_that_leaves_a_requirement_out():
    gpu = GPU.read_text()
    # The install step before this check existed: a grep'd subset of requirements.txt, without peft or
    # prometheus-client among others.
    subset = """ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu130
FROM ${SGLANG_IMAGE}
COPY requirements.txt ./
RUN grep -E '^(ray|math-verify|gguf|pyarrow|matplotlib|tensorboard|aiohttp)==' requirements.txt > /tmp/extra.txt \\
 && pip install --no-cache-dir -r /tmp/extra.txt "megatron-core==0.16.1"
"""
    found = "\n".join(problems(subset, gpu=True))
    assert "peft==" in found and "prometheus-client==" in found and "ray==" not in found
    # One more name left out of the real install step.
    assert "(transformers|tokenizers)==' requirements.txt" in gpu
    without_peft = gpu.replace(
        "(transformers|tokenizers)==' requirements.txt", "(transformers|tokenizers|peft)==' requirements.txt"
    )
    pins = {r.name: r for r in runtime_requirements(True)}
    assert problems(without_peft, gpu=True) == [
        f"{pins['peft']}: neither installed nor provided by the base image {BASE['image']}"
    ]
    # Every requirement installed, but transformers and tokenizers over SGLang's pins; and the old base image.
    assert problems(gpu.replace("'^(transformers|tokenizers)==' ", "'^$' "), gpu=True) == [
        f"installs {pins[name]} over the base image's {name} {BASE['provides'][name]} (docker/sglang-base.toml)"
        for name in ("transformers", "tokenizers")
    ]
    old_base = gpu.replace(BASE["image"], "lmsysorg/sglang:v0.5.11-cu129")
    assert "is not the one docker/sglang-base.toml describes" in problems(old_base, gpu=True)[0]
    # The CPU image's setup script sources scripts/lib/engine_env.sh: not copied in, the build would fail.
    cpu = CPU.read_text()
    without_helpers = cpu.replace("COPY scripts/lib/engine_env.sh scripts/lib/engine_env.sh\n", "")
    assert without_helpers != cpu
    assert problems(without_helpers, gpu=False) == [
        "a step reads scripts/lib/engine_env.sh, which is not in the image then (COPY it first)"
    ]
