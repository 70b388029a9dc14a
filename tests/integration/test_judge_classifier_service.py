"""`python -m services.judge` with NEXTSTATE_JUDGE__TYPE=classifier, as a real process on a
real Redis: a sequence-classification reward model (a tiny one built on the spot) in the
judge process, no LLM judge anywhere. Turns in, scored turns out, each reward 2p - 1 of
the classifier's own p for the text the judge renders; a turn with no next state is not
judged, a side turn is not scored; every entry acknowledged; a graceful stop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.judge.settings import JudgeConfig
from services.judge.verdict import render_for_judge
from shared.schemas import ScoredTurn, Turn
from shared.settings import Settings
from shared.streams import Bus
from tests.support.metrics import total
from tests.support.servers import ServiceProcess, free_port
from tests.support.tiny_model import build_tiny_classifier
from tests.support.waiting import eventually
from tests.unit.test_judge_classifier import direct_p

pytestmark = pytest.mark.integration

REPLIES = ["thanks, that works", "no, that is wrong", "ok", "perfect!", "try again", "hm"]


@pytest.fixture(scope="module")
def classifier_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tiny_model, tmp_path_factory.mktemp("reward-model"))


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    async with Bus(settings) as b:
        yield b


def turn(session: str, reply: str | None, index: int = 0, **kw: object) -> Turn:
    return Turn(
        session_id=session, turn_index=index,
        messages=[{"role": "user", "content": f"What is {index} + {index}?"}],
        response={"role": "assistant", "content": f"It is {2 * index}." + " Surely." * index},
        prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-0.1, -0.2],
        next_state=None if reply is None else [{"role": "user", "content": reply}], **kw,  # type: ignore[arg-type]
    )  # fmt: skip


async def test_the_classifier_judge_scores_turns_as_a_service(
    bus: Bus, env: dict[str, str], classifier_dir: Path, unique: str
) -> None:
    port = free_port()
    judge = ServiceProcess("judge", {
        **env, "NEXTSTATE_JUDGE__TYPE": "classifier", "NEXTSTATE_JUDGE__CLASSIFIER": str(classifier_dir),
        "NEXTSTATE_JUDGE__CLASSIFIER_BATCH_SIZE": "4", "NEXTSTATE_JUDGE__PORT": str(port),
        "NEXTSTATE_STREAMS__BLOCK_MS": "100", "OMP_NUM_THREADS": "1",
    })  # fmt: skip
    judged = [turn(f"{unique}-{i}", reply, i) for i, reply in enumerate(REPLIES)]
    ended = turn(f"{unique}-ended", None, closed_by="ttl")
    side = turn(f"{unique}-side", "thanks", turn_type="side")
    for t in [*judged, ended, side]:
        await bus.publish("turns", t)
    judge.start()
    try:
        judge.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=120)

        async def all_acked() -> bool:
            (group,) = await bus.redis.xinfo_groups(bus.keys.turns)
            return int(group["pending"]) == 0 and group["lag"] == 0

        await eventually(all_acked, 60, "every turn judged and acknowledged")
        out = {s.id: s for s in (ScoredTurn.from_json(f["data"]) for _, f in await bus.redis.xrange(bus.keys.scored))}
        assert set(out) == {t.id for t in [*judged, ended]}  # the side turn: nothing
        cfg = JudgeConfig(type="classifier", classifier=str(classifier_dir))
        rewards = []
        for t in judged:
            s = out[t.id]
            p = direct_p(classifier_dir, render_for_judge(t, cfg))
            assert s.reward == pytest.approx(2 * p - 1, abs=1e-4), t.session_id  # padding changes nothing
            assert (s.judged, s.judge, s.judge_model, s.mode) == (True, "classifier", str(classifier_dir), "rl")
            assert len(s.votes) == 1 and s.votes[0].score == s.reward and s.votes[0].text.startswith("classifier p=")
            assert s.turn == t
            rewards.append(s.reward)
        assert max(rewards) - min(rewards) > 1e-3  # the classifier tells the texts apart
        e = out[ended.id]
        assert (e.judged, e.reward, e.votes) == (False, 0, [])
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        assert total(text, "nextstate_judge_votes_total", kind="classifier") == len(judged)
        assert total(text, "nextstate_judge_turns_total", outcome="side") == 1
        assert total(text, "nextstate_judge_turns_total", outcome="unjudged") == 1
    finally:
        rc = judge.stop()
    assert rc == 0, judge.logs()
    assert "What is 3 + 3" not in judge.logs()  # no conversation text in the logs
