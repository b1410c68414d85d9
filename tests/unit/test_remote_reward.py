"""Remote rewards (--rm-url) against a real aiohttp reward server, the --group-rm hook, their flags, and the
pure retry policy under an injected clock and sleep."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_async.arguments import ConfigError, parse_args
from miles_async.config import RewardConfig
from miles_async.config.control import Secret
from miles_async.config.report import render
from miles_async.config.rollout import RM_TOKEN_ENV, RemoteRewardConfig
from miles_async.rollout.data_source import PromptItem
from miles_async.rollout.generate import GenerateContext
from miles_async.rollout.remote_reward import RemoteRewardError
from miles_async.rollout.reward_retry import GaveUp, Retryable, RetryPolicy, with_retries
from miles_async.rollout.rewards import RewardError, RewardModel
from miles_async.rollout.rollout import RolloutContext, generate_group
from miles_async.rollout.sample import Sample, SampleStatus
from tests.flag_helpers import minimal_flags
from tests.reward_server import RewardServer

# Rewards no built-in gives: a right answer scores RIGHT, so a test can tell the server's rewards apart.
RIGHT, WRONG = 0.75, 0.25
FAST = {"retry_backoff": 0.01, "timeout": 5.0}


def samples(n: int) -> list[Sample]:
    """Sample i answers "i" to label str(i % 3): right for every third."""
    return [
        Sample(uid=f"u{i}", group_index=0, index=i, prompt="q", label=str(i % 3), response=str(i)) for i in range(n)
    ]


def expected(batch: list[Sample]) -> list[float]:
    return [RIGHT if s.response == s.label else WRONG for s in batch]


def remote_model(url: str, reward_key: str | None = None, group_rm: bool = False, **remote) -> RewardModel:
    return RewardModel(
        RewardConfig(None, None, "raise", RemoteRewardConfig(url, **{**FAST, **remote}), group_rm, reward_key)
    )


async def score_all(model: RewardModel, batch: list[Sample], deadline: float = 60) -> list[float]:
    """Scores every sample concurrently, as a rollout does; a deadline so a hang fails the test instead."""
    try:
        return await asyncio.wait_for(asyncio.gather(*(model.score(s) for s in batch)), deadline)
    finally:
        await model.close()


# -- the pure retry policy -----------------------------------------------------------------------------------
class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(times: int, error: Exception, result: str = "ok"):
    calls = []

    async def attempt() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return result

    return attempt, calls


def test_retries_back_off_exponentially_up_to_the_cap():
    t = FakeTime()
    attempt, calls = failing(5, Retryable("503"))
    policy = RetryPolicy(max_retries=5, backoff_base=1.0, backoff_cap=4.0)
    assert asyncio.run(with_retries(attempt, policy, "server x", t.clock, t.sleep)) == "ok"
    assert t.sleeps == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert len(calls) == 6


def test_gives_up_after_the_last_retry_naming_what_and_the_last_error():
    t = FakeTime()
    attempt, calls = failing(99, Retryable("connection refused"))
    with pytest.raises(GaveUp) as err:
        asyncio.run(with_retries(attempt, RetryPolicy(2, 0.5, 30.0), "reward server http://h:1/r", t.clock, t.sleep))
    assert len(calls) == 3 and t.sleeps == [0.5, 1.0]
    assert str(err.value) == (
        "reward server http://h:1/r: gave up after 3 attempts over 1.5s; last error: connection refused"
    )


def test_an_error_that_is_not_retryable_is_raised_at_once():
    t = FakeTime()
    attempt, calls = failing(1, ValueError("bad reply"))
    with pytest.raises(ValueError, match="bad reply"):
        asyncio.run(with_retries(attempt, RetryPolicy(3, 1.0, 30.0), "x", t.clock, t.sleep))
    assert len(calls) == 1 and t.sleeps == []


# -- the client against a real server ------------------------------------------------------------------------
def test_samples_go_out_in_batches_of_the_configured_size():
    with RewardServer(RIGHT, WRONG) as server:
        batch = samples(8)
        rewards = asyncio.run(score_all(remote_model(server.url, batch_size=4), batch))
    assert rewards == expected(batch)
    assert server.batch_sizes == [4, 4]
    assert [item["response"] for body in server.bodies for item in body] == [s.response for s in batch]


def test_batch_size_one_posts_miles_single_object_and_reads_the_reward_key():
    with RewardServer(RIGHT, WRONG, reward_key="score") as server:
        batch = samples(3)
        rewards = asyncio.run(score_all(remote_model(server.url, reward_key="score"), batch))
    assert rewards == expected(batch)
    assert sorted(server.bodies, key=lambda b: b["response"]) == [
        {"prompt": "q", "response": str(i), "label": str(i % 3), "metadata": {}} for i in range(3)
    ]


def test_requests_in_flight_never_exceed_the_limit():
    with RewardServer(RIGHT, WRONG, delay=0.2) as server:
        batch = samples(8)
        rewards = asyncio.run(score_all(remote_model(server.url, max_concurrent_requests=2), batch))
    assert rewards == expected(batch)
    assert server.requests == 8
    assert server.max_in_flight == 2


@pytest.mark.parametrize("failure", ["fail_first", "drop_first"])
def test_failed_requests_are_retried_and_the_rewards_are_right(failure):
    with RewardServer(RIGHT, WRONG, **{failure: 2}) as server:
        batch = samples(4)
        rewards = asyncio.run(score_all(remote_model(server.url, batch_size=4, max_retries=3), batch))
    assert rewards == expected(batch)
    assert server.requests == 3  # two failed, the third answered
    assert server.batch_sizes == [4]


def test_an_unreachable_server_fails_naming_the_url_after_the_retries(refused_port):
    url = f"http://127.0.0.1:{refused_port}/reward"  # held by the test, never listening: connections refused
    with pytest.raises(RemoteRewardError) as err:
        asyncio.run(score_all(remote_model(url, max_retries=2), samples(1)))
    message = str(err.value)
    assert f"--rm-url {url}" in message
    assert "gave up after 3 attempts" in message
    assert "--rm-max-retries 2" in message


def test_a_server_that_hangs_times_out_and_fails_naming_the_url():
    with RewardServer(RIGHT, WRONG, delay=600) as server:
        with pytest.raises(RemoteRewardError) as err:
            asyncio.run(score_all(remote_model(server.url, timeout=0.3, max_retries=1), samples(1)))
        assert server.requests == 2
    assert f"--rm-url {server.url}" in str(err.value)
    assert "no reply within 0.3s" in str(err.value)


def test_a_client_error_is_not_retried():
    with RewardServer(RIGHT, WRONG) as server:
        url = server.url.replace("/reward", "/nope")  # 404
        with pytest.raises(RemoteRewardError, match="refused the request: HTTP 404"):
            asyncio.run(score_all(remote_model(url, max_retries=3), samples(1)))
        assert server.requests == 0


def test_a_reply_of_the_wrong_length_names_the_url():
    with RewardServer(RIGHT, WRONG, reward_key="score") as server:  # objects back, and no --reward-key
        with pytest.raises(RemoteRewardError, match=f"--rm-url {server.url} answered badly: .*--reward-key"):
            asyncio.run(score_all(remote_model(server.url, batch_size=2), samples(2)))


# -- credentials ---------------------------------------------------------------------------------------------
def test_the_bearer_token_reaches_the_server_and_no_redirect_is_followed():
    with RewardServer(RIGHT, WRONG) as elsewhere, RewardServer(redirect_to=f"{elsewhere.url}?key=s3cret") as server:
        with RewardServer(RIGHT, WRONG) as direct:
            batch = samples(2)
            rewards = asyncio.run(score_all(remote_model(direct.url, token=Secret("t0ken")), batch))
        assert rewards == expected(batch) and direct.authorizations == ["Bearer t0ken"] * 2
        with pytest.raises(RemoteRewardError) as err:
            asyncio.run(score_all(remote_model(server.url, token=Secret("t0ken"), max_retries=3), samples(1)))
        assert server.requests == 1 and elsewhere.requests == 0  # not retried, not followed
    host = elsewhere.url.removeprefix("http://")
    assert str(err.value) == (
        f"reward server --rm-url {server.url} answered HTTP 307, a redirect to http://{host}?<redacted>; redirects "
        "are not followed (they could take the token or the samples elsewhere): give the final URL as --rm-url"
    )


@pytest.mark.parametrize("failure", ["refused", "unreachable"])
def test_the_url_is_redacted_in_every_error_and_log(failure, refused_port, caplog):
    """A user, password and query (an API key) in --rm-url: the reply's echo of the query, the retry warnings and
    the final error show none of them."""
    with RewardServer(refuse_with=503 if failure == "refused" else None) as server:
        port = server.port if failure == "refused" else refused_port
        url = f"http://bob:pa55word@127.0.0.1:{port}/reward?api_key=s3cret"
        with pytest.raises(RemoteRewardError) as err:
            asyncio.run(score_all(remote_model(url, max_retries=1), samples(1)))
    if failure == "refused":
        assert server.authorizations[0].startswith("Basic ")  # the credentials were sent, as the URL asked
    seen = f"{err.value!s} {err.value.__cause__!s} {caplog.text}"
    for secret in ("bob", "pa55word", "s3cret"):
        assert secret not in seen
    assert f"--rm-url http://<redacted>@127.0.0.1:{port}/reward?<redacted>" in str(err.value)
    if failure == "refused":
        assert "no access for /reward?<redacted>" in str(err.value)


def test_the_token_comes_from_a_file_or_the_environment(tmp_path, data, monkeypatch):
    url = ["--rm-url", "http://rm:8000/score"]
    assert parse_args(flags(tmp_path, data, *url)).rollout.reward.remote.token is None
    monkeypatch.setenv(RM_TOKEN_ENV, " from-env\n")
    assert parse_args(flags(tmp_path, data, *url)).rollout.reward.remote.token.value == "from-env"
    (tmp_path / "token").write_text("from-file\n")
    keyed = ["--rm-url", "http://rm:8000/score?key=k3y", "--rm-token-file", str(tmp_path / "token")]
    cfg = parse_args(flags(tmp_path, data, *keyed))
    assert cfg.rollout.reward.remote.token.value == "from-file"  # the file wins
    report = render(cfg)  # --check-config's
    assert "from-file" not in report and "k3y" not in report
    assert "token: <hidden>" in report and "http://rm:8000/score?<redacted>" in report


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rm-token-file", "missing"], "--rm-token-file: file not found: missing"),
        (["--rm-token-file", "{empty}"], "--rm-token-file: {empty} is empty"),
        (
            ["--rm-url", "http://u:pw@rm:8000/score", "--rm-token-file", "{token}"],
            "--rm-url http://<redacted>@rm:8000/score holds credentials and a bearer token is given too",
        ),
        (["--rm-url", "ftp://u:pw@rm/score?k=v"], "--rm-url: 'ftp://<redacted>@rm/score?<redacted>' is not an"),
    ],
)
def test_bad_token_flags_are_refused_naming_the_flag(tmp_path, data, extra, message):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "token").write_text("t")
    paths = {"empty": tmp_path / "empty", "token": tmp_path / "token"}
    extra = [e.format(**paths) for e in extra]
    url = [] if "--rm-url" in extra else ["--rm-url", "http://rm:8000/score"]
    with pytest.raises(ConfigError) as err:
        parse_args(flags(tmp_path, data, *url, *extra))
    assert message.format(**paths) in str(err.value)
    assert "pw" not in str(err.value)


# -- the group hook ------------------------------------------------------------------------------------------
GROUPS_SEEN: list[list[tuple[str, int]]] = []


def rank_by_length(group: list[Sample]) -> list[float]:
    """A ranking reward: the longest response of the group gets 1, the shortest 0."""
    GROUPS_SEEN.append([(s.uid, s.index) for s in group])
    order = sorted(range(len(group)), key=lambda i: len(group[i].response))
    return [order.index(i) / (len(group) - 1) for i in range(len(group))]


async def async_rank_by_length(group: list[Sample]) -> list[float]:
    return rank_by_length(group)


def one_short(group: list[Sample]) -> list[float]:
    return [1.0] * (len(group) - 1)


async def grow_with_index(ctx, sample: Sample, sampling_params: dict) -> Sample:
    """A generate function in place of an engine (the e2e test runs the real one): response i is the digit i,
    i+1 times ("0", "11", "222", "3333"), so the longer the later."""
    await asyncio.sleep(0.01 * (3 - sample.index))  # finish out of order
    sample.response = str(sample.index) * (sample.index + 1)
    sample.status = SampleStatus.COMPLETED
    return sample


def rollout_ctx(reward: RewardModel) -> RolloutContext:
    ctx = RolloutContext(
        data_source=None,
        generate_ctx=GenerateContext(router=None, tokenizer=None),
        generate_fn=grow_with_index,
        reward=reward,
        apply_chat_template=False,
        n_samples_per_prompt=4,
        sampling_params={},
        semaphore=asyncio.Semaphore(8),
    )
    for uid in ("a", "b"):
        ctx.prompt_token_cache[uid] = [1, 2]
    return ctx


async def two_groups(ctx: RolloutContext) -> list[list[Sample]]:
    items = [PromptItem(uid, "q", "11", {}) for uid in ("a", "b")]
    return await asyncio.gather(*(generate_group(ctx, item, gi, 4, {}) for gi, item in enumerate(items)))


@pytest.mark.parametrize("fn", ["rank_by_length", "async_rank_by_length"])
def test_the_group_hook_gets_whole_groups_and_its_rewards_land_on_the_samples(fn):
    GROUPS_SEEN.clear()
    reward = RewardModel(RewardConfig(None, f"tests.unit.test_remote_reward:{fn}", "raise", group_rm=True))
    groups = asyncio.run(two_groups(rollout_ctx(reward)))
    assert sorted(GROUPS_SEEN) == [[("a", i) for i in range(4)], [("b", i) for i in range(4)]]
    for group in groups:
        assert [s.reward for s in group] == [0.0, 1 / 3, 2 / 3, 1.0]


def test_a_group_hook_that_returns_too_few_rewards_fails_naming_the_group():
    reward = RewardModel(RewardConfig(None, "tests.unit.test_remote_reward:one_short", "raise", group_rm=True))
    with pytest.raises(RewardError, match="group of uid=a .*one reward per sample \\(4\\)"):
        asyncio.run(two_groups(rollout_ctx(reward)))


def test_a_group_hook_that_fails_scores_zero_under_reward_on_error_zero(caplog):
    reward = RewardModel(RewardConfig(None, "tests.unit.test_remote_reward:one_short", "zero", group_rm=True))
    groups = asyncio.run(two_groups(rollout_ctx(reward)))
    assert [s.reward for g in groups for s in g] == [0.0] * 8
    assert reward.errors == 8
    assert "group reward failed on uid=a (its 4 samples scored 0)" in caplog.text


def test_group_rm_with_rm_url_sends_one_request_per_group():
    with RewardServer(RIGHT, WRONG) as server:

        async def run() -> list[list[Sample]]:
            reward = remote_model(server.url, group_rm=True, batch_size=3)
            try:
                return await two_groups(rollout_ctx(reward))
            finally:
                await reward.close()

        groups = asyncio.run(run())
    assert server.batch_sizes == [4, 4]  # --rm-batch-size has no say: a group is one request
    assert [[item["response"] for item in body] for body in server.bodies] == [["0", "11", "222", "3333"]] * 2
    assert [s.reward for g in groups for s in g] == [WRONG, RIGHT, WRONG, WRONG] * 2  # the label is "11"


def scored_object(sample: Sample) -> dict:
    return {"score": 0.5, "detail": "partly right"}


def test_a_custom_reward_returning_an_object_is_read_at_the_reward_key():
    keyed = RewardModel(RewardConfig(None, "tests.unit.test_remote_reward:scored_object", "raise", reward_key="score"))
    assert asyncio.run(keyed.score(samples(1)[0])) == 0.5
    unkeyed = RewardModel(RewardConfig(None, "tests.unit.test_remote_reward:scored_object", "raise"))
    with pytest.raises(RewardError, match="give --reward-key"):
        asyncio.run(unkeyed.score(samples(1)[0]))


# -- the flags -----------------------------------------------------------------------------------------------
@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(16)))
    return path


def flags(tmp_path, data, *extra: str, rm_type: bool = False) -> list[str]:
    args = minimal_flags(tmp_path, data=data)
    if not rm_type:
        i = args.index("--rm-type")
        args = args[:i] + args[i + 2 :]
    return [*args, "--num-rollout", "2", *extra]


def test_remote_flags_build_the_remote_config(tmp_path, data):
    cfg = parse_args(
        flags(tmp_path, data, "--rm-url", "http://rm:8000/score", "--rm-batch-size", "8", "--rm-timeout", "5")
    ).rollout.reward
    assert cfg.rm_type is None and cfg.custom_rm_path is None
    assert cfg.remote == RemoteRewardConfig("http://rm:8000/score", 8, 16, 5.0, 3, 1.0)
    # Miles' spelling: --rm-type remote_rm with --rm-url
    miles = parse_args(flags(tmp_path, data, "--rm-type", "remote_rm", "--rm-url", "http://rm:8000/score"))
    assert miles.rollout.reward.rm_type is None and miles.rollout.reward.remote.url == "http://rm:8000/score"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rm-url", "localhost:8000"], "--rm-url: 'localhost:8000' is not an http(s) URL"),
        (["--rm-url", "http://h:port/x"], "--rm-url: 'http://h:port/x' is not an http(s) URL"),
        (
            ["--rm-url", "http://h/r", "--rm-type", "integer"],
            "give exactly one of --rm-type, --custom-rm-path and --rm-url",
        ),
        (["--rm-type", "remote_rm"], "--rm-type remote_rm needs --rm-url"),
        (["--rm-type", "integer", "--group-rm"], "--group-rm needs --custom-rm-path or --rm-url"),
        (["--rm-url", "http://h/r", "--rm-batch-size", "0"], "--rm-batch-size must be >= 1"),
        (["--rm-url", "http://h/r", "--rm-timeout", "0"], "--rm-timeout must be positive"),
    ],
)
def test_bad_remote_flags_are_refused_naming_the_flag(tmp_path, data, extra, message):
    with pytest.raises(ConfigError) as err:
        parse_args(flags(tmp_path, data, *extra))
    assert message in str(err.value)


def test_remote_flags_without_rm_url_are_named_as_ignored(tmp_path, data, caplog):
    parse_args(flags(tmp_path, data, "--rm-batch-size", "4", rm_type=True))
    assert "--rm-batch-size 4 is ignored" in caplog.text
