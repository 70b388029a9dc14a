"""A deliberately easy environment for a tiny random model, loaded as
`tests.support.vowel_env:VowelEnv`: the closed-loop test of environments (track 2) trains on it.

A task is one of the demo's questions with the environment's rule: the answer must start
with a vowel (shared/demo_tasks.py's `vowel` criterion, the one the chat closed loop
learns). There are no tools: the episode is one answer, which `verify` checks — reward
1 when it starts with a vowel, else 0. A random 2-layer model does that by chance some of
the time (its first token is a vowel-initial one), so outcome rewards have something to
reinforce and the success rate per policy version can rise within minutes on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.envs.base import Environment, Message, Split, Task, Verdict, opening, pick
from services.envs.sandbox import Sandbox
from shared.demo_tasks import HELD_OUT_QUESTIONS, QUESTIONS, TASKS

CRITERION = TASKS["vowel"]
SYSTEM = "Answer the question. Your answer must start with a vowel."

_TASKS = [
    *(Task(id=f"vowel-{i}", env="vowel", prompt=q) for i, q in enumerate(QUESTIONS)),
    *(Task(id=f"vowel-h{i}", env="vowel", prompt=q, split="heldout") for i, q in enumerate(HELD_OUT_QUESTIONS)),
]


def answer_of(messages: Sequence[Message]) -> str:
    """The text of the last assistant message ("" when there is none)."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    content = last.get("content") if last is not None else None
    return content if isinstance(content, str) else ""


class VowelEnv(Environment):
    name = "vowel"

    @classmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        return pick([t for t in _TASKS if t.split == split], n, seed)

    def tools(self) -> list[Message]:
        return []

    async def reset(self, task: Task, sandbox: Sandbox) -> list[Message]:
        self.done = False
        return opening(SYSTEM, task)

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        answer = answer_of(messages or [])
        return Verdict.of(CRITERION.ok(answer), first=answer.lstrip()[:1])
