"""Tool calls: parsing the model's <tool_call> blocks, the registry (--tools-path) and its flags, the tool
segment the chat template adds, and running calls in real worker subprocesses (timeout, crash, output cap)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from miles_async.arguments import ConfigError, parse_args
from miles_async.config import ToolsConfig
from miles_async.rollout.multi_turn import Toolbox, has_tool_role, shows_tools, tool_messages, tool_segment_text
from miles_async.rollout.tools import ToolCall, ToolRunner, cap_output, load_tools, parse_tool_calls, tool_schema
from miles_async.utils.plugins import PluginError
from tests.flag_helpers import minimal_flags
from tests.multi_turn_helpers import CHATML_TEMPLATE, QWEN_LIKE_TEMPLATE, build_tokenizer, sum_tool

H = "tests.multi_turn_helpers"


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
    assert parse_args(_flags(tmp_path)).tools is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--apply-chat-template", "--tools-path", f"{H}.EMPTY"], "--tools-path: 'tests.multi_turn_helpers.EMPTY'"),
        (["--tools-path", f"{H}.TOOLS"], "--tools-path needs --apply-chat-template"),
        (["--apply-chat-template", "--tools-path", f"{H}.TOOLS", "--tool-timeout", "0"], "--tool-timeout must be"),
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


@pytest.fixture
def runner():
    made = []

    def make(path=f"{H}.MANY", timeout=20.0, max_chars=1000, workers=2):
        made.append(ToolRunner(path, timeout, max_chars, workers))
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


def test_results_errors_and_prints_come_back_as_text(runner):
    r = runner(max_chars=12)

    async def go():
        return await asyncio.gather(
            r.call("echo", {"text": "ab", "times": 2}),
            r.call("boom", {}),
            r.call("chatty", {}),
            r.call("echo", {"text": "x", "times": 50}),
        )

    ok, raised, printed, long = asyncio.run(go())
    assert ok == "abab"
    assert raised == "error: tool \n[output truncated: 33 more characters]"  # a tool's error is capped too
    assert printed == '{"ok": true}'
    assert long == "x" * 12 + "\n[output truncated: 38 more characters]"
    assert r.restarts == 0


def test_a_tool_error_is_reported_to_the_model(runner):
    r = runner()
    assert asyncio.run(r.call("boom", {})) == "error: tool 'boom' raised ValueError: no luck"
    assert asyncio.run(r.call("echo", {"nope": 1})).startswith("error: tool 'echo' raised TypeError:")


def test_a_hanging_tool_costs_its_timeout_and_its_worker_only(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTI_TURN_CHILD_PID_FILE", str(tmp_path / "child.pid"))
    r = runner(timeout=1.0, workers=2)
    assert asyncio.run(r.call("echo", {"text": "warm"})) == "warm"
    (before,) = r.worker_pids()

    async def go():
        return await asyncio.gather(r.call("spawn_and_hang", {}), r.call("hang", {"a": 1, "b": 2}))

    t0 = time.monotonic()
    spawned, hung = asyncio.run(go())
    took = time.monotonic() - t0
    assert spawned == "error: tool 'spawn_and_hang' timed out after 1 s (--tool-timeout) and was killed"
    assert hung == "error: tool 'hang' timed out after 1 s (--tool-timeout) and was killed"
    assert 1.0 <= took < 8.0  # both in parallel, each bounded by the timeout (+ one worker start)
    assert r.restarts == 2 and r.worker_pids() == []
    assert not _alive(before)
    assert not _alive(int((tmp_path / "child.pid").read_text()))  # the tool's own child went with its worker
    assert asyncio.run(r.call("echo", {"text": "again"})) == "again"  # a fresh worker serves the next call


def test_a_crashing_tool_costs_its_call_only(runner):
    r = runner()
    assert asyncio.run(r.call("crash", {"a": 1, "b": 2})) == (
        "error: tool 'crash' crashed (its worker process exited with code 3)"
    )
    assert asyncio.run(r.call("echo", {"text": "still here"})) == "still here"
    assert r.restarts == 1


def test_a_registry_the_worker_cannot_load_is_named(runner):
    r = runner(path=f"{H}.EMPTY")
    with pytest.raises(RuntimeError, match="--tools-path: a tool worker failed to start: .*holds no tools"):
        asyncio.run(r.call("echo", {}))


def test_an_unknown_tool_or_a_malformed_call_is_answered_without_a_worker():
    box = Toolbox(ToolsConfig(f"{H}.TOOLS", 2, 5.0, 100, 1))
    try:
        assert asyncio.run(box.run(ToolCall("mul", {}))) == "error: unknown tool 'mul'; the tools are: sum"
        assert asyncio.run(box.run(ToolCall("", {}, "the tool call is not valid JSON (x)"))) == (
            "error: the tool call is not valid JSON (x)"
        )
        assert box.runner.worker_pids() == []
        assert asyncio.run(box.run(ToolCall("sum", {"a": 2, "b": 3}))) == "5"
    finally:
        box.close()
