"""Tool calls: parsing the model's <tool_call> blocks, the registry (--tools-path) and its flags, the tool
segment the chat template adds, and running calls in real worker subprocesses (a worker per sample, timeout, crash,
output cap, the allowlisted environment). The sandbox's containment: tests/unit/test_tool_sandbox.py."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from miles_async.arguments import ConfigError, parse_args
from miles_async.config import SandboxConfig, ToolsConfig
from miles_async.rollout.multi_turn import Toolbox, has_tool_role, shows_tools, tool_messages, tool_segment_text
from miles_async.rollout.sandbox import ALLOWED_ENV, ONE_THREAD, coverage_env
from miles_async.rollout.tools import ToolCall, ToolRunner, cap_output, load_tools, parse_tool_calls, tool_schema
from miles_async.rollout.verifier_pool import VerifierPool
from miles_async.utils.plugins import PluginError
from tests.credentials_helpers import assert_no_credentials, hold_credentials
from tests.flag_helpers import minimal_flags
from tests.hostile_tools import environment
from tests.multi_turn_helpers import CHATML_TEMPLATE, QWEN_LIKE_TEMPLATE, build_tokenizer, sum_tool

H = "tests.multi_turn_helpers"

# What a worker's environment may hold (and, under scripts/coverage.sh only, coverage.py's configuration).
WORKER_ENV = {*ALLOWED_ENV, *ONE_THREAD, *coverage_env(""), "HOME", "TMPDIR", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE"}


def _flags(tmp_path, *extra: str) -> list[str]:
    return [*minimal_flags(tmp_path), "--num-rollout", "2", *extra]


# -- parsing ----------------------------------------------------------------------------------------


def test_parses_each_call_of_a_turn_in_order():
    text = (
        'Let me check.<tool_call>\n{"name": "sum", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call><|im_end|>'
    )
    assert parse_tool_calls(text) == [ToolCall("sum", {"a": 2, "b": 3}), ToolCall("echo", {"text": "hi"})]


def test_a_turn_without_a_call_has_none():
    assert parse_tool_calls("The answer is 5.<|im_end|>") == []


@pytest.mark.parametrize(
    "block, error",
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "names no tool"),
        ('<tool_call>["sum"]</tool_call>', "names no tool"),
        ('<tool_call>{"name": "sum", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "sum", "arguments": "{oops"}</tool_call>', "arguments are not valid JSON"),
        ('<tool_call>{"name": "sum", "arguments": {"a": 1', "unterminated <tool_call>"),
    ],
)
def test_a_malformed_call_is_kept_with_the_reason(block, error):
    (call,) = parse_tool_calls("x " + block)
    assert call.error is not None and error in call.error


def test_arguments_default_to_none_given():
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


def test_output_cap_says_how_much_was_cut():
    assert cap_output("abc", 3) == "abc"
    assert cap_output("abcdef", 2) == "ab\n[output truncated: 4 more characters]"


# -- the registry -----------------------------------------------------------------------------------


def test_a_dict_or_a_list_is_a_registry():
    assert load_tools(f"{H}.TOOLS") == {"sum": sum_tool}
    assert sorted(load_tools(f"{H}:MANY")) == ["boom", "chatty", "crash", "echo", "hang", "spawn_and_hang"]


@pytest.mark.parametrize(
    "path, message",
    [
        ("nodots", "is not of the form module:attribute"),
        ("no_such_module_xyz.TOOLS", "cannot import module 'no_such_module_xyz'"),
        (f"{H}.MISSING", "has no attribute 'MISSING'"),
        (f"{H}.NOT_A_REGISTRY", "is a int; expected a dict name -> callable or a list of callables"),
        (f"{H}.EMPTY", "holds no tools"),
        (f"{H}.NAMELESS", "which has no name"),
        (f"{H}.NOT_CALLABLE", "tool 'x' of 'tests.multi_turn_helpers.NOT_CALLABLE' is not callable"),
    ],
)
def test_a_bad_registry_is_refused_naming_the_flag(path, message):
    with pytest.raises(PluginError, match="^--tools-path: ") as err:
        load_tools(path)
    assert message in str(err.value)


def test_schema_is_derived_from_the_signature_unless_declared():
    assert tool_schema("sum", sum_tool) == {
        "type": "function",
        "function": {
            "name": "sum",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }

    def f(x):
        return x

    f.tool_schema = {"type": "function", "function": {"name": "f"}}
    assert tool_schema("f", f) is f.tool_schema


def test_flags_build_the_tools_config(tmp_path):
    flags = ["--apply-chat-template", "--tools-path", f"{H}.TOOLS", "--generate-max-turns", "3"]
    cfg = parse_args(_flags(tmp_path, *flags, "--tool-timeout", "2.5", "--tool-output-max-chars", "100"))
    assert (cfg.tools.path, cfg.tools.max_turns, cfg.tools.timeout, cfg.tools.max_output_chars) == (
        H + ".TOOLS",
        3,
        2.5,
        100,
    )
    assert cfg.tools.workers == 4
    assert cfg.tools.sandbox == SandboxConfig()  # namespace, with the defaults
    assert parse_args(_flags(tmp_path)).tools is None


def test_flags_build_the_sandbox_config(tmp_path):
    tools = ["--apply-chat-template", "--tools-path", f"{H}.TOOLS"]
    limits = ["--tool-cpu-seconds", "2", "--tool-memory-mb", "256", "--tool-file-size-mb", "1"]
    more = ["--tool-open-files", "64", "--tool-max-processes", "16", "--tool-no-network", "--tool-private-tmp"]
    cfg = parse_args(_flags(tmp_path, *tools, *limits, *more))
    assert cfg.tools.sandbox == SandboxConfig("namespace", 2.0, 256, 1, 64, 16, True, True)
    cfg = parse_args(_flags(tmp_path, *tools, "--tool-sandbox", "rlimits-only", "--tool-max-processes", "8"))
    assert cfg.tools.sandbox.mode == "rlimits-only"
    assert (
        "--tool-max-processes 8 is ignored: it only takes effect with --tools-path and --tool-sandbox namespace"
        in cfg.warnings
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--apply-chat-template", "--tools-path", f"{H}.EMPTY"], "--tools-path: 'tests.multi_turn_helpers.EMPTY'"),
        (["--tools-path", f"{H}.TOOLS"], "--tools-path needs --apply-chat-template"),
        (["--apply-chat-template", "--tools-path", f"{H}.TOOLS", "--tool-timeout", "0"], "--tool-timeout must be"),
        (
            ["--apply-chat-template", "--tools-path", f"{H}.TOOLS", "--tool-sandbox", "none", "--tool-no-network"],
            "--tool-no-network needs --tools-path and --tool-sandbox namespace",
        ),
        (
            [
                "--apply-chat-template",
                "--tools-path",
                f"{H}.TOOLS",
                "--tool-sandbox",
                "rlimits-only",
                "--tool-private-tmp",
            ],
            "--tool-private-tmp needs --tools-path and --tool-sandbox namespace",
        ),
        (
            ["--apply-chat-template", "--tools-path", f"{H}.TOOLS", "--tool-memory-mb", "8"],
            "--tool-memory-mb must be >= 64",
        ),
    ],
)
def test_bad_tool_flags_are_refused_by_name(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(_flags(tmp_path, *extra))


# -- the chat template's tool segment ---------------------------------------------------------------


def test_a_template_with_a_tool_role_gets_tool_messages():
    tok = build_tokenizer(QWEN_LIKE_TEMPLATE)
    assert has_tool_role(tok) and shows_tools(tok)
    messages = tool_messages([("sum", "5"), ("sum", "7")], tool_role=True)
    assert messages == [
        {"role": "tool", "name": "sum", "content": "5"},
        {"role": "tool", "name": "sum", "content": "7"},
    ]
    # The model wrote <|im_end|>: only the newline after it, the tool turn and the next header are added.
    assert tool_segment_text(tok, messages, "<tool_call>...</tool_call><|im_end|>") == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_without_a_tool_role_gets_a_user_message_with_tags():
    tok = build_tokenizer(CHATML_TEMPLATE)
    assert not has_tool_role(tok) and not shows_tools(tok)
    messages = tool_messages([("sum", "5")], tool_role=False)
    assert messages == [{"role": "user", "content": "<tool_response>\n5\n</tool_response>"}]
    # A turn that stopped without <|im_end|> (another stop token) gets the template's end of turn first.
    assert tool_segment_text(tok, messages, "<tool_call>x</tool_call>") == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # Renders the assistant's content only when it is the last message: appending would change earlier tokens.
    tok = build_tokenizer(
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        tool_segment_text(tok, [{"role": "user", "content": "r"}], "t")


# -- running calls in worker processes ----------------------------------------------------------------
# These run without the sandbox (--tool-sandbox none), so they pass on any machine; what the sandbox adds is tested
# in test_tool_sandbox.py. The environment, session, descriptors and per-sample workers are every mode's.
NONE = SandboxConfig(mode="none")


@pytest.fixture
def runner():
    made = []

    def make(path=f"{H}.MANY", timeout=20.0, max_chars=1000, workers=2, sandbox=NONE):
        made.append(ToolRunner(path, timeout, max_chars, workers, sandbox))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of a living parent is a zombie until reaped: not running any more.
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(") ")[1][0] != "Z"


def _calls(session, *calls):
    async def go():
        try:
            return await asyncio.gather(*(session.call(name, args) for name, args in calls))
        finally:
            await session.aclose()

    return asyncio.run(go())


def test_results_errors_and_prints_come_back_as_text(runner):
    r = runner(max_chars=12)
    ok, raised, printed, long = _calls(
        r.session(),
        ("echo", {"text": "ab", "times": 2}),
        ("boom", {}),
        ("chatty", {}),
        ("echo", {"text": "x", "times": 50}),
    )
    assert ok == "abab"
    assert raised == "error: tool \n[output truncated: 33 more characters]"  # a tool's error is capped too
    assert printed == '{"ok": true}'
    assert long == "x" * 12 + "\n[output truncated: 38 more characters]"
    assert r.restarts == 0 and r.started == 1  # one sample: one worker for all its calls


def test_a_tool_error_is_reported_to_the_model(runner):
    r = runner()
    raised, bad_args = _calls(r.session(), ("boom", {}), ("echo", {"nope": 1}))
    assert raised == "error: tool 'boom' raised ValueError: no luck"
    assert bad_args.startswith("error: tool 'echo' raised TypeError:")


def test_each_sample_gets_a_fresh_worker_that_ends_with_it(runner):
    r = runner(path="tests.hostile_tools.HOSTILE")
    first, second = r.session(), r.session()

    async def go():
        assert await first.call("remember", {"value": "a"}) == ""
        assert await first.call("remember", {"value": "b"}) == "a"  # a sample's calls share their worker
        pid, folder = first.pid, first.folder
        assert await second.call("remember", {"value": "c"}) == ""  # nothing of the other sample's
        assert second.pid != pid
        await first.aclose()
        await second.aclose()
        return pid, folder

    pid, folder = asyncio.run(go())
    assert not _alive(pid) and not os.path.exists(folder)
    assert r.worker_pids() == [] and r.started == 2


def test_a_hanging_tool_costs_its_timeout_and_its_worker_only(runner):
    r = runner(path="tests.hostile_tools.HOSTILE", timeout=1.0)
    session = r.session()

    async def go():
        child = await session.call("child_pid", {})  # a child that would outlive a plain kill of its worker
        worker = session.pid
        t0 = time.monotonic()
        hung = await session.call("endless_loop", {})
        took = time.monotonic() - t0
        again = await session.call("remember", {"value": "x"})  # a fresh worker: the old one's state is gone
        await session.aclose()
        return int(child), worker, hung, took, again

    child, worker, hung, took, again = asyncio.run(go())
    assert hung == "error: tool 'endless_loop' timed out after 1 s (--tool-timeout) and was killed"
    assert 1.0 <= took < 6.0
    assert again == ""
    assert r.restarts == 1 and r.started == 2 and r.worker_pids() == []
    assert not _alive(worker) and not _alive(child)  # the tool's own child went with its worker


def test_a_crashing_tool_costs_its_call_only(runner):
    r = runner()
    crashed, after = _calls(r.session(), ("crash", {"a": 1, "b": 2}), ("echo", {"text": "still here"}))
    assert crashed == "error: tool 'crash' crashed (its worker process exited with code 3)"
    assert after == "still here"
    assert r.restarts == 1


def test_a_registry_the_worker_cannot_load_is_named(runner):
    r = runner(path=f"{H}.EMPTY")
    with pytest.raises(RuntimeError, match="--tools-path: a tool worker failed to start: .*holds no tools"):
        _calls(r.session(), ("echo", {}))


def test_a_worker_gets_no_secret_no_descriptor_and_a_session_of_its_own(runner, monkeypatch):
    hold_credentials(monkeypatch)  # as a run's driver may: the worker starts from this process
    leak_r, leak_w = os.pipe()  # an inheritable descriptor of ours, as a careless library leaves one
    os.set_inheritable(leak_w, True)
    try:
        r = runner(path="tests.hostile_tools.HOSTILE", max_chars=100_000)
        env, fds, ids, where = _calls(
            r.session(), ("environment", {}), ("descriptors", {}), ("session", {}), ("where", {})
        )
        ours = os.readlink(f"/proc/self/fd/{leak_w}")
    finally:
        os.close(leak_r)
        os.close(leak_w)
    env, fds, ids, where = json.loads(env), json.loads(fds), json.loads(ids), json.loads(where)
    assert_no_credentials(env, "a tool worker")
    assert set(env) <= WORKER_ENV, set(env) - WORKER_ENV
    assert env["HOME"] == env["TMPDIR"] == where["cwd"]  # its own folder
    # stdin, stdout (its requests and replies), stderr (ours, for what tools print), its own copy of stdout
    assert sorted(fds) == ["0", "1", "2", "3"] and ours not in fds.values()
    assert fds["0"].startswith("pipe:") and fds["1"] == os.readlink("/proc/self/fd/2")
    assert ids["sid"] == ids["pid"] != os.getsid(0)  # the worker leads a session of its own


def test_a_verifier_worker_gets_no_secret_either(monkeypatch):
    """The reward verifiers' workers (rollout.verifier_pool, math-verify's) start from the same allowlist."""
    hold_credentials(monkeypatch)
    pool = VerifierPool(1, 30.0)

    async def go():
        try:
            return await pool.run(environment)
        finally:
            pool.close()

    env = asyncio.run(go())
    assert_no_credentials(env, "a verifier worker")
    assert set(env) <= WORKER_ENV, set(env) - WORKER_ENV


def test_an_unknown_tool_or_a_malformed_call_is_answered_without_a_worker():
    box = Toolbox(ToolsConfig(f"{H}.TOOLS", 2, 5.0, 100, 1, NONE))
    session = box.session()
    try:
        assert asyncio.run(box.run(session, ToolCall("mul", {}))) == "error: unknown tool 'mul'; the tools are: sum"
        assert asyncio.run(box.run(session, ToolCall("", {}, "the tool call is not valid JSON (x)"))) == (
            "error: the tool call is not valid JSON (x)"
        )
        assert box.runner.worker_pids() == [] and box.runner.started == 0
        assert asyncio.run(box.run(session, ToolCall("sum", {"a": 2, "b": 3}))) == "5"
    finally:
        session.close()
        box.close()
