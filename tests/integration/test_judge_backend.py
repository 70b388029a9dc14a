"""Judge backends and votes over real HTTP against the scripted stand-in (no Redis needed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from services.judge.backend import JudgeBackend, make_backend
from services.judge.judges import PRMJudge, RuleJudge, RuleThenPRM
from services.judge.settings import JudgeConfig
from services.judge.votes import JudgeUnavailable, cast_votes
from shared.schemas import Turn
from tests.support.judge_standin import StandinThread
from tests.support.servers import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def standin() -> Iterator[StandinThread]:
    with StandinThread(free_port()) as s:
        yield s


def cfg(url: str, **kw: Any) -> JudgeConfig:
    base: dict[str, Any] = {"url": url, "timeout_s": 2.0, "retries": 2, "backoff_s": 0.01, "concurrency": 8}
    return JudgeConfig(**{**base, **kw})


@pytest.fixture
async def backend(standin: StandinThread) -> AsyncIterator[JudgeBackend]:
    async with make_backend(cfg(standin.url, api_key="sk-test", model="judge-x")) as b:
        yield b


def ask(directive: str, unique: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "grade"}, {"role": "user", "content": f"{unique} <<standin {directive}>>"}]


def stats(s: StandinThread) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{s.url}/stats", timeout=5).json()
    return data


async def test_openai_backend_sends_key_and_reads_answer(backend: JudgeBackend, standin: StandinThread, unique: str) -> None:
    r = await backend.call(ask("votes=-1", unique))
    assert r.ok and r.attempts == 1 and r.error is None
    assert r.text is not None and r.text.rstrip().endswith("\\boxed{-1}")
    st = stats(standin)
    assert st["paths"] == {"/v1/chat/completions": 1}
    assert st["auth"] == ["Bearer sk-test"]
    await backend.health()


async def test_url_with_or_without_v1(standin: StandinThread, unique: str) -> None:
    async with make_backend(cfg(standin.url + "/v1")) as b:
        assert (await b.call(ask("votes=1", unique))).ok


async def test_sglang_text_backend(standin: StandinThread, unique: str) -> None:
    async with make_backend(cfg(standin.url, backend="sglang")) as b:
        r = await b.call(ask("votes=0", unique))
        await b.health()
    assert r.text is not None and r.text.endswith("\\boxed{0}")
    assert stats(standin)["paths"]["/generate"] == 1


async def test_5xx_and_429_are_retried(backend: JudgeBackend, unique: str) -> None:
    r = await backend.call(ask("votes=1; fail=2; status=503", unique))
    assert r.ok and r.attempts == 3
    r = await backend.call(ask("votes=1; fail=1; status=429", unique + "b"))
    assert r.ok and r.attempts == 2


async def test_retries_are_bounded(backend: JudgeBackend, standin: StandinThread, unique: str) -> None:
    r = await backend.call(ask("fail=100; status=500", unique))
    assert not r.ok and r.attempts == 3 and r.error is not None and "500" in r.error
    assert stats(standin)["total"] == 3


async def test_4xx_is_not_retried(standin: StandinThread, unique: str) -> None:
    async with make_backend(cfg(standin.url, backend="sglang")) as b:
        b.path = "/no-such-route"
        r = await b.call(ask("votes=1", unique))
    assert not r.ok and r.attempts == 1 and r.error is not None and "404" in r.error


async def test_slow_call_times_out_then_retries(standin: StandinThread, unique: str) -> None:
    async with make_backend(cfg(standin.url, timeout_s=0.3, retries=1)) as b:
        r = await b.call(ask("delays=5,0", unique))
    assert r.ok and r.attempts == 2  # the first attempt timed out, the second answered
    async with make_backend(cfg(standin.url, timeout_s=0.2, retries=1)) as b:
        r = await b.call(ask("delays=5", unique + "b"))
    assert not r.ok and r.error is not None and "within 0.2s" in r.error and r.attempts == 2


async def test_unreachable_judge_is_an_error_not_a_vote(unique: str) -> None:
    async with make_backend(cfg(f"http://127.0.0.1:{free_port()}", retries=1)) as b:
        r = await b.call(ask("votes=1", unique))
        with pytest.raises(httpx.HTTPError):
            await b.health()
    assert not r.ok and r.error is not None and "unreachable" in r.error and r.attempts == 2


async def test_votes_majority_and_audit(backend: JudgeBackend, unique: str) -> None:
    votes = await cast_votes(backend, ask("votes=1,x,-1,-1,-1", unique), 5, 3, "prm")
    assert sorted((v.score for v in votes), key=str) == sorted([1, None, -1, -1, -1], key=str)
    assert all(v.error is None and v.text and v.latency_s > 0 for v in votes)


async def test_quorum_one_slow_call_still_scores(standin: StandinThread, unique: str) -> None:
    async with make_backend(cfg(standin.url, timeout_s=0.3, retries=0)) as b:
        votes = await cast_votes(b, ask("votes=1; delays=0,0,5", unique), 3, 2, "prm")
    errors = [v for v in votes if v.error]
    assert len(errors) == 1 and errors[0].score is None
    assert [v.score for v in votes if not v.error] == [1, 1]


async def test_below_quorum_raises(standin: StandinThread, unique: str) -> None:
    async with make_backend(cfg(standin.url, retries=0)) as b:
        with pytest.raises(JudgeUnavailable, match="only 1 of 3 calls answered"):
            await cast_votes(b, ask("fail=2; status=502", unique), 3, 2, "prm")


async def test_rule_then_prm_skips_the_llm_when_the_rule_is_decisive(backend: JudgeBackend, standin: StandinThread, unique: str) -> None:
    c = cfg(standin.url, model="judge-x")
    judge = RuleThenPRM(RuleJudge(c.positive, c.negative), PRMJudge(backend, c))

    def turn(reply: str) -> Turn:
        return Turn(session_id=unique, messages=[{"role": "user", "content": "q"}],
                    response={"role": "assistant", "content": "a"},
                    next_state=[{"role": "user", "content": reply}])

    v = await judge.judge(turn("thanks, perfect"))
    assert (v.reward, v.judge, v.prompt_version) == (1, "rule", None)
    assert stats(standin)["total"] == 0
    v = await judge.judge(turn(f"{unique} and tomorrow? <<standin votes=-1>>"))
    assert (v.reward, v.judge, v.judge_model, v.prompt_version) == (-1, "prm", "judge-x", "prm-v1")
    assert len(v.votes) == 3 and stats(standin)["total"] == 3


async def test_many_concurrent_calls_spread_over_small_pools(standin: StandinThread, unique: str) -> None:
    async with make_backend(cfg(standin.url, concurrency=20, votes=3)) as b:
        assert b.http.shards == 9  # 20 x 3 + 8 connections, 8 per shard
        results = await asyncio.gather(*(b.call(ask("votes=1; delays=0.05", f"{unique}-{i}")) for i in range(68)))
    assert all(r.ok and r.attempts == 1 for r in results)
    assert stats(standin)["total"] == 68
