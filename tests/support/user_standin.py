"""A stand-in for the simulated user's model: the judge stand-in's real HTTP server
(tests/support/judge_standin.py) answering as a user and as a rater.

- A rating request (its prompt asks to "Rate the assistant") is answered with a line of
  reasoning holding a decoy box, then `\\boxed{N}` last; N is `rating=` of a
  `<<standin …>>` directive in the prompt (e.g. in the scenario's persona), default 8;
  `rating=x` answers with no box (unreadable).
- Any other request is the user's next message: "Thanks. Could you give me more
  detail?", or `[[END]]` when the directive says `end=1`.

Every prompt is kept (`prompts`) so a test can check what the user model was shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.support.judge_standin import Standin, StandinThread, parse_directive

USER_REPLY = "Thanks. Could you give me more detail?"


@dataclass
class UserStandin(Standin):
    prompts: list[str] = field(default_factory=list)

    def answer(self, prompt: str) -> tuple[float, int, str]:
        self.prompts.append(prompt)
        self.calls["rating" if "Rate the assistant" in prompt else "user"] += 1
        d = parse_directive(prompt)
        if "Rate the assistant" in prompt:
            rating = d.get("rating", "8")
            if rating == "x":
                return 0.0, 200, "I cannot decide on a number."
            return 0.0, 200, f"At first \\boxed{{2}} seemed fair, but it did help.\n\\boxed{{{rating}}}"
        if d.get("end") == "1":
            return 0.0, 200, "[[END]]"
        return 0.0, 200, USER_REPLY


class UserStandinThread(StandinThread):
    """`with UserStandinThread(port) as s:` — `s.user.prompts`, `s.user.auth`."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        super().__init__(port, host)
        self.user = UserStandin()
        self.standin = self.user

    def __enter__(self) -> UserStandinThread:
        super().__enter__()
        return self
