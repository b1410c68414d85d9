"""Two builds of one cached environment at once (parallel test workers, two runs on a fresh machine) build it
once: scripts/lib/engine_env.sh holds ``$VENV.lock`` while it builds, and whoever waited reuses the result.

The build is the script's own; only the interpreter is a stand-in (a script that makes ``bin/pip`` and
``bin/python`` no-ops), so no package is downloaded."""

from __future__ import annotations

import os
import subprocess
import textwrap

from tests.scripts.helpers import ROOT


def _setup_script(tmp_path):
    fake_python = tmp_path / "python3"
    fake_python.write_text(
        textwrap.dedent(
            """\
            #!/usr/bin/env bash
            # python3 -m venv DIR: a venv whose pip and python do nothing
            mkdir -p "$3/bin"
            printf '#!/usr/bin/env bash\\nexit 0\\n' > "$3/bin/pip"
            cp "$3/bin/pip" "$3/bin/python"
            chmod +x "$3/bin/pip" "$3/bin/python"
            """
        )
    )
    fake_python.chmod(0o755)
    req = tmp_path / "requirements-demo.txt"
    req.write_text("demo==1.0\n")
    script = tmp_path / "setup_demo_env.sh"
    script.write_text(
        textwrap.dedent(
            f"""\
            set -euo pipefail
            source "{ROOT}/scripts/lib/engine_env.sh"
            engine_build() {{ echo build >> "{tmp_path}/builds"; sleep 2; }}
            engine_env demo "{req}" x
            """
        )
    )
    return script, {**os.environ, "PYTHON": str(fake_python), "MILES_ASYNC_DEMO_VENV": str(tmp_path / "venv-demo")}


def test_two_builds_at_once_build_the_environment_once(tmp_path):
    script, env = _setup_script(tmp_path)
    first = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=60) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    assert (tmp_path / "builds").read_text() == "build\n"
    assert all(out.strip().splitlines()[-1] == str(tmp_path / "venv-demo") for out, _ in outs), outs
    assert any("another process is building" in err for _, err in outs), outs
