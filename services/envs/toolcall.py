"""Word problems solved with a code interpreter: the `toolcall` environment.

Tasks are generated, not stored: task `i` of a split comes from a generator seeded with
(split, seed, i), so the same arguments give the same tasks everywhere, and the held-out
split draws from seeds the training split never uses. Each problem (sums, products,
discounts, percentages, unit conversions, rates, averages, remainders, interest) has an
exact answer, computed with fractions and written as a terminating decimal.

The model may run Python (`python`, a fresh interpreter in the sandbox per call) and ends
with `submit(answer)`, or by stating the answer in its last message (`\\boxed{…}`, then
"answer: …", then the last number in it). Reward 1 when that number equals the answer
(relative and absolute tolerance 1e-6), else 0.

With NEXTSTATE_ENVS__TOOLS_CONFIG set, the tools offered (and, if the file has them, the
tasks) are the file's (tools_config.py): its own tools answer as the file says, `python`
and `submit` only when it names them; a task's text answer is compared as text.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from services.envs import tools_config
from services.envs.base import (
    Environment,
    Message,
    Split,
    Task,
    ToolError,
    Verdict,
    check_arguments,
    error,
    function_tool,
    opening,
    pick,
)
from services.envs.sandbox import Sandbox, SandboxError
from services.envs.settings import current

DEFAULT_N = 200  # tasks when `n` is not given: the generator has no end
TOLERANCE = 1e-6

SYSTEM = (
    "You solve word problems exactly. You have a Python interpreter: call `python` with code "
    "that prints what you need (each call is a fresh interpreter; print your results). When you "
    "know the answer, call `submit` with the number alone, no units."
)
CONFIG_SYSTEM = (
    "You answer the user's question using the tools you are given. When you know the answer, "
    "{how}"
)

Problem = tuple[str, Fraction]  # (text, exact answer)


def _decimal(x: Fraction) -> str:
    """A terminating fraction as a plain decimal string (7/4 -> "1.75")."""
    sign = "-" if x < 0 else ""
    x = abs(x)
    whole, rest = divmod(x.numerator, x.denominator)
    if rest == 0:
        return f"{sign}{whole}"
    digits = ""
    while rest and len(digits) < 30:
        rest *= 10
        digits += str(rest // x.denominator)
        rest %= x.denominator
    if rest:
        raise ValueError(f"{x} has no terminating decimal")
    return f"{sign}{whole}.{digits}"


def _money(x: Fraction) -> str:
    return f"{float(x):.2f}"


def _sum(r: random.Random) -> Problem:
    item = r.choice(["croissants", "bus tickets", "jars of honey", "bicycle helmets"])
    a, b, c = (r.randint(120, 990) for _ in range(3))
    return (f"A shop sold {a} {item} on Monday, {b} on Tuesday and {c} on Wednesday. "
            f"How many {item} did it sell over the three days?"), Fraction(a + b + c)


def _product(r: random.Random) -> Problem:
    a, b, c = r.randint(12, 80), r.randint(6, 40), r.randint(25, 250)
    return (f"A warehouse has {a} shelves. Each shelf holds {b} boxes and each box holds {c} "
            "screws. How many screws are in the warehouse?"), Fraction(a * b * c)


def _discount(r: random.Random) -> Problem:
    price = Fraction(r.randint(2000, 40000), 100)
    pct = r.choice([5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 60, 75])
    return (f"A jacket costs ${_money(price)}. In a sale its price is cut by {pct}%. What is the "
            "sale price in dollars?"), price * (100 - pct) / 100


def _percent_of(r: random.Random) -> Problem:
    n, pct = 20 * r.randint(10, 120), 5 * r.randint(1, 19)
    return (f"Of the {n} students at a school, {pct}% walk to school. How many students walk "
            "to school?"), Fraction(n * pct, 100)


def _miles(r: random.Random) -> Problem:
    miles = Fraction(r.randint(6, 120), 2)
    return (f"A hiking trail is {_decimal(miles)} miles long. How long is it in kilometres? "
            "Use 1 mile = 1.609344 km."), miles * Fraction("1.609344")


def _minutes(r: random.Random) -> Problem:
    h, m, d = r.randint(1, 9), r.randint(1, 59), r.randint(3, 30)
    return (f"A machine runs for {h} hours and {m} minutes every day. How many minutes does it "
            f"run in {d} days?"), Fraction((60 * h + m) * d)


def _distance(r: random.Random) -> Problem:
    v1, t1, v2, t2 = r.randint(40, 160), r.randint(1, 6), r.randint(30, 140), 15 * r.randint(1, 11)
    return (f"A train travels at {v1} km/h for {t1} hours, then at {v2} km/h for {t2} minutes. "
            "How many kilometres does it travel in total?"), Fraction(v1 * t1) + Fraction(v2 * t2, 60)


def _average(r: random.Random) -> Problem:
    k = r.choice([4, 5, 8])
    temps = [r.randint(-5, 35) for _ in range(k)]
    listed = ", ".join(str(t) for t in temps[:-1]) + f" and {temps[-1]}"
    return (f"The noon temperatures over {k} days were {listed} degrees Celsius. What was the "
            "mean noon temperature?"), Fraction(sum(temps), k)


def _remainder(r: random.Random) -> Problem:
    k = r.randint(7, 48)
    n = k * r.randint(20, 400) + r.randint(1, k - 1)
    return (f"{n} marbles are packed into bags of {k}. How many marbles are left over after "
            "filling as many full bags as possible?"), Fraction(n % k)


def _shopping(r: random.Random) -> Problem:
    q, price = r.randint(3, 12), Fraction(r.randint(99, 1299), 100)
    start = Fraction(r.randint(int(q * price) + 5, int(q * price) + 200))
    earn = Fraction(r.randint(10, 90))
    return (f"Maya has ${_money(start)}. She buys {q} notebooks at ${_money(price)} each, then "
            f"earns ${_money(earn)} babysitting. How many dollars does she have now?"), start - q * price + earn


def _interest(r: random.Random) -> Problem:
    principal = 100 * r.randint(5, 200)
    rate = Fraction(r.randint(2, 16), 2)
    years = r.randint(2, 10)
    return (f"${principal} is deposited at {_decimal(rate)}% simple annual interest. What is the "
            f"balance in dollars after {years} years?"), principal * (1 + rate * years / 100)


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    "sum": _sum, "product": _product, "discount": _discount, "percent_of": _percent_of,
    "miles": _miles, "minutes": _minutes, "distance": _distance, "average": _average,
    "remainder": _remainder, "shopping": _shopping, "interest": _interest,
}


def make_task(split: Split, seed: int, index: int) -> Task:
    """Task `index` of (split, seed): the same arguments, the same task."""
    r = random.Random(f"toolcall/{split}/{seed}/{index}")
    kind = r.choice(sorted(GENERATORS))
    text, answer = GENERATORS[kind](r)
    return Task(id=f"toolcall-{split}-{seed}-{index}", env="toolcall", prompt=text,
                data={"answer": _decimal(answer), "kind": kind}, split=split)


_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\**\s*\$?\s*(-?[\d.,]+)", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """The final answer in `text`: the last \\boxed{…}, else "answer: …", else the last number."""
    for pattern in (_BOXED, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            text = found[-1]
            break
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    try:
        return Fraction(numbers[-1].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def correct(got: Fraction, expected: Fraction) -> bool:
    return math.isclose(got, expected, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


def _text(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


BUILTIN_TOOLS = {
    "python": function_tool("python", "Run Python 3 code in a fresh interpreter; returns what it "
                            "prints (stdout, then stderr).", {"code": ("string", "the program")}),
    "submit": function_tool("submit", "Submit your final answer (a number, no units). Ends the task.",
                            {"answer": (["string", "number"], "the final answer")}),
}


def configured() -> tools_config.ToolsConfig | None:
    """The tools config of this process (NEXTSTATE_ENVS__TOOLS_CONFIG), or None."""
    path = current().tools_config
    return tools_config.load(path) if path is not None else None


def config_task(t: tools_config.ConfigTask, index: int) -> Task:
    answer = t.answer
    data = {"answer_text": answer, "kind": "config"} if isinstance(answer, str) else \
        {"answer": _decimal_or_float(Fraction(str(answer))), "kind": "config"}
    return Task(id=t.id or f"toolcall-{t.split}-{index}", env="toolcall", prompt=t.prompt, data=data,
                split=t.split)


class ToolCallEnv(Environment):
    name = "toolcall"

    def __init__(self) -> None:
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None
        self.submitted: str | None = None
        self.config = configured()

    @classmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        config = configured()
        if config is not None and config.tasks is not None:
            tasks = [config_task(t, i) for i, t in enumerate(config.tasks)]
            return pick([t for t in tasks if t.split == split], n, seed)
        return [make_task(split, seed, i) for i in range(DEFAULT_N if n is None else n)]

    def tools(self) -> list[Message]:
        if self.config is None:
            return list(BUILTIN_TOOLS.values())
        return [BUILTIN_TOOLS[t.builtin] if t.builtin is not None else t.spec() for t in self.config.tools]

    async def reset(self, task: Task, sandbox: Sandbox) -> list[Message]:
        if task.env != self.name:
            raise ValueError(f"task {task.id} is for {task.env!r}, not {self.name!r}")
        self.task, self.sandbox, self.submitted, self.done = task, sandbox, None, False
        if self.config is None:
            return opening(SYSTEM, task)
        how = ("call `submit` with the answer alone." if "submit" in self.config.builtins()
               else "state it in your last message as \"answer: ...\".")
        return opening(CONFIG_SYSTEM.format(how=how), task)

    async def step(self, tool_name: str, arguments: dict[str, Any] | str | None) -> str:
        custom = self.config.custom() if self.config is not None else {}
        if tool_name not in custom:
            return await super().step(tool_name, arguments)
        tool = custom[tool_name]
        try:
            return tool.respond(check_arguments(tool.parameters or {}, arguments))
        except ToolError as e:
            return error(f"{tool_name}: {e}")

    async def tool_python(self, code: str) -> str:
        if self.sandbox is None:
            raise SandboxError("python called before reset")
        return (await self.sandbox.arun(["python3", "-"], stdin=code)).observation()

    async def tool_submit(self, answer: str | float) -> str:
        if self.done:
            return f"An answer was already submitted ({self.submitted}); it stands."
        self.submitted, self.done = str(answer), True
        return f"Submitted: {self.submitted}"

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        if self.task is None:
            raise ValueError("verify called before reset")
        source, text = "submit", self.submitted
        if text is None:
            last = next((m for m in reversed(messages or []) if m.get("role") == "assistant"), None)
            source, text = ("message", _text(last)) if last is not None else ("none", "")
        if "answer_text" in self.task.data:
            expected_text = str(self.task.data["answer_text"])
            passed = text_matches(text, expected_text, submitted=source == "submit")
            return Verdict.of(passed, expected=expected_text, source=source, answer=text[-500:])
        expected = Fraction(self.task.data["answer"])
        got = parse_number(text)
        details: dict[str, Any] = {"expected": self.task.data["answer"], "source": source,
                                   "answer": None if got is None else _decimal_or_float(got)}
        return Verdict.of(got is not None and correct(got, expected), **details)


_TEXT_ANSWER = re.compile(r"answer\s*(?:is|:|=)\s*\**\s*(.+)", re.IGNORECASE)


def _norm(text: str) -> str:
    return " ".join(text.casefold().replace("*", " ").split()).strip(" .")


def text_matches(text: str, expected: str, *, submitted: bool) -> bool:
    """A text answer: the submitted one, or the final message's \\boxed{…} / "answer: …",
    equal to `expected` ignoring case and spacing; else, in a final message, `expected`
    found in it as a whole phrase."""
    want = _norm(expected)
    if submitted:
        return _norm(text) == want
    for pattern in (_BOXED, _TEXT_ANSWER):
        found = pattern.findall(text)
        if found:
            return _norm(found[-1].splitlines()[0] if found[-1] else "") == want
    return re.search(rf"(?<!\w){re.escape(want)}(?!\w)", _norm(text)) is not None


def _decimal_or_float(x: Fraction) -> str:
    try:
        return _decimal(x)
    except ValueError:
        return repr(float(x))
