"""Episode jobs without Redis: deterministic ids and plans, attempts, the run summary."""

from __future__ import annotations

import pytest

from services.ctl.envs import summarize
from services.envs.jobs import attempt_of
from services.envs.runtime import resolve_task
from shared.envjobs import JOB_FUNCTION, episode_plan, new_group, task_pick
from shared.rqjobs import rq_job_id
from shared.schemas import Outcome, episode_job_id, episode_session_id

ECHO = "tests.support.echo_env:EchoEnv"


def test_a_plan_is_deterministic_per_invocation_and_new_per_invocation() -> None:
    plan = episode_plan("r", "toolcall", 3, 2, invocation="inv")
    assert plan == episode_plan("r", "toolcall", 3, 2, invocation="inv")
    assert [(job, task, group, i) for job, task, group, i, _ in plan[:2]] == [
        (episode_job_id("r", "toolcall", "train-0-0", "inv-t0", 0), "train-0-0", "inv-t0", 0),
        (episode_job_id("r", "toolcall", "train-0-0", "inv-t0", 1), "train-0-0", "inv-t0", 1),
    ]
    assert len({job for job, *_ in plan}) == 6 and len({g for _, _, g, _, _ in plan}) == 3  # a group per task
    assert {job for job, *_ in plan}.isdisjoint(job for job, *_ in episode_plan("r", "toolcall", 3, 2))
    assert new_group(2, "x") == "x-t2"
    assert rq_job_id(plan[0][0]).startswith("episode_2e")  # what the envs ACL user's job keys allow
    assert JOB_FUNCTION == "services.envs.jobs.run_episode"
    with pytest.raises(ValueError):
        episode_plan("r", "toolcall", 0, 2)


def test_the_worker_resolves_a_picked_task() -> None:
    assert resolve_task(ECHO, task_pick("train", 2, 0, 1)).id.startswith("echo-")
    assert resolve_task(ECHO, task_pick("train", 9, 0, 8)).env == "echo"  # wraps around a small set
    with pytest.raises(ValueError):
        task_pick("train", 2, 0, 2)


@pytest.mark.parametrize(("retries", "left", "expected"), [
    (2, 2, (1, False)), (2, 1, (2, False)), (2, 0, (3, True)), (0, None, (1, True)), (0, 1, (1, True)),
])
def test_attempts(retries: int, left: int | None, expected: tuple[int, bool]) -> None:
    assert attempt_of(retries, left) == expected


def outcome(i: int, passed: bool, steps: int, error: str | None = None, attempt: int = 1) -> Outcome:
    job = episode_job_id("r", "e", f"t{i}", "g", 0)
    return Outcome(id=job, run="r", env="e", task_id=f"t{i}", group="g", session_id=episode_session_id(job, 1, "n"),
                   reward=1.0 if passed else 0.0, passed=passed, steps=steps, error=error, attempt=attempt,
                   policy_versions=[3, 4] if i else [3])


def test_summary() -> None:
    got = summarize([outcome(0, True, 2), outcome(1, False, 4, attempt=2), outcome(2, False, 0, "PolicyUnavailable")],
                    wall_s=2.0, expected=4)
    assert got == {"episodes": 3, "expected": 4, "missing": 1, "passed": 1, "success_rate": 0.3333,
                   "mean_reward": 0.3333, "mean_steps": 3.0, "failures": 1, "retried": 1,
                   "policy_versions": [3, 4], "wall_s": 2.0, "episodes_per_s": 1.5}
    assert summarize([], wall_s=0.0, expected=0)["success_rate"] == 0.0
