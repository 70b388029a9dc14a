"""Assistant-output parsing: tool calls, reasoning, content; and the streaming parser, whose
deltas must add up to the whole-text parse under any chunking."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

import pytest

from shared.toolcalls import (
    AssistantMessage,
    ContentDelta,
    Delta,
    ParsedCall,
    ReasoningDelta,
    SpecialText,
    StreamParser,
    ToolCallDelta,
    ToolParser,
    delta_dicts,
    finish_reason,
    get_tool_parser,
    message_dict,
    output_markers,
    parse_assistant,
    prompt_opens_reasoning,
    register_tool_parser,
    tool_parser_names,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


def calls_of(msg: AssistantMessage) -> list[tuple[str, str]]:
    return [(tc.function.name, tc.function.arguments) for tc in msg.tool_calls]


# -- whole-text parsing ----------------------------------------------------------------------


def test_plain_text_is_content() -> None:
    msg = parse_assistant("Hello!", tools_enabled=True)
    assert msg == AssistantMessage(content="Hello!", reasoning_content=None, tool_calls=[])
    assert finish_reason(msg, "length") == "length" and finish_reason(msg, None) == "stop"


def test_hermes_call_with_text_around() -> None:
    text = f"Let me check.\n{CALL}\n" + CALL.replace("Paris", "東京") + "\nOne moment."
    msg = parse_assistant(text, tools_enabled=True, parser="hermes")
    assert msg.content == "Let me check.\n\n\nOne moment."
    assert calls_of(msg) == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "東京"}'),
    ]
    assert all(ID.match(tc.id) and tc.type == "function" for tc in msg.tool_calls)
    assert len({tc.id for tc in msg.tool_calls}) == 2
    assert finish_reason(msg, "stop") == "tool_calls"


def test_hermes_call_only_has_null_content_and_valid_json_arguments() -> None:
    text = '<tool_call>{"name": "f", "parameters": {"x": [1, 2]}}</tool_call>\n'
    msg = parse_assistant(text, tools_enabled=True)
    assert msg.content is None
    assert json.loads(msg.tool_calls[0].function.arguments) == {"x": [1, 2]}
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert calls_of(parse_assistant(as_string, tools_enabled=True)) == [("f", '{"a": 1}')]
    no_args = '<tool_call>{"name": "ping"}</tool_call>'
    assert calls_of(parse_assistant(no_args, tools_enabled=True)) == [("ping", "{}")]


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {"x": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}',  # never closed
        "<tool_call>" + "[" * 5000 + "</tool_call>",  # too deep for json
    ],
)
def test_malformed_calls_stay_content(bad: str) -> None:
    text = f"Before {bad} after"
    msg = parse_assistant(text, tools_enabled=True)
    assert msg.content == text and msg.tool_calls == []


def test_good_call_after_a_malformed_one() -> None:
    text = f"<tool_call>oops</tool_call>{CALL}"
    msg = parse_assistant(text, tools_enabled=True)
    assert msg.content == "<tool_call>oops</tool_call>" and len(msg.tool_calls) == 1


def test_tools_disabled_leaves_markers_as_text() -> None:
    msg = parse_assistant(CALL, tools_enabled=False)
    assert msg.content == CALL and msg.tool_calls == []


def test_reasoning_block() -> None:
    text = f"  <think>\nweigh options\n</think>\n\nAnswer: {CALL}"
    msg = parse_assistant(text, tools_enabled=True, reasoning=True)
    assert msg.reasoning_content == "weigh options"
    assert msg.content == "Answer: " and len(msg.tool_calls) == 1
    off = parse_assistant(text, tools_enabled=False, reasoning=False)
    assert off.reasoning_content is None and off.content == text.strip("\n")


def test_reasoning_opened_by_the_template() -> None:
    text = "the user wants X\n</think>\n\nX it is."
    for opened in (None, True):
        msg = parse_assistant(text, tools_enabled=False, reasoning=True, reasoning_open=opened)
        assert (msg.reasoning_content, msg.content) == ("the user wants X", "X it is.")
    msg = parse_assistant(text, tools_enabled=False, reasoning=True, reasoning_open=False)
    assert msg.reasoning_content is None and msg.content == text
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_edge_cases() -> None:
    unterminated = parse_assistant("<think>still thinking", tools_enabled=False, reasoning=True)
    assert (unterminated.reasoning_content, unterminated.content) == ("still thinking", "")
    opened = parse_assistant(
        "still thinking", tools_enabled=False, reasoning=True, reasoning_open=True
    )
    assert (opened.reasoning_content, opened.content) == ("still thinking", "")
    empty = parse_assistant("<think>\n\n</think>\n\nHi", tools_enabled=False, reasoning=True)
    assert (empty.reasoning_content, empty.content) == (None, "Hi")
    inside = parse_assistant(
        f"<think>maybe {CALL}</think>no call", tools_enabled=True, reasoning=True
    )
    assert inside.tool_calls == [] and inside.content == "no call"
    late = parse_assistant(
        "Hi <think>x</think>", tools_enabled=False, reasoning=True, reasoning_open=False
    )
    assert late.content == "Hi <think>x</think>" and late.reasoning_content is None


def test_mistral_formats() -> None:
    old = (
        'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    )
    msg = parse_assistant(old, tools_enabled=True, parser="mistral")
    assert msg.content == "Sure. " and calls_of(msg) == [("a", '{"x": 1}'), ("b", "{}")]
    new = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    assert calls_of(parse_assistant(new, tools_enabled=True, parser="mistral")) == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]
    bad = 'Sure. [TOOL_CALLS] [{"name": "a"}, {"nope": 1}]'
    assert parse_assistant(bad, tools_enabled=True, parser="mistral").content == bad


def test_registry(unique: str) -> None:
    assert {"hermes", "mistral"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")

    @register_tool_parser(f"fn-{unique}")
    class FnParser(ToolParser):
        start = "<fn "
        end = "/>"

        def parse(self, body: str) -> list[ParsedCall] | None:
            name, _, args = body.partition(" ")
            return [ParsedCall(name, args or "{}")] if name.isidentifier() else None

    assert isinstance(get_tool_parser(f"fn-{unique}"), FnParser)
    msg = parse_assistant('ok <fn go {"a": 1}/>', tools_enabled=True, parser=f"fn-{unique}")
    assert msg.content == "ok " and calls_of(msg) == [("go", '{"a": 1}')]
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("hermes")(FnParser)


# -- streaming ----------------------------------------------------------------------------------


@dataclass
class Config:
    tools_enabled: bool
    parser: str
    reasoning: bool
    reasoning_open: bool | None

    def kw(self) -> dict[str, Any]:
        return self.__dict__.copy()


def chunk(text: str, rng: random.Random, mode: str) -> list[str]:
    if mode == "chars":
        return list(text)
    if mode == "whole":
        return [text]
    out, i = [], 0
    while i < len(text):
        n = rng.randint(0, 9)  # empty deltas too
        out.append(text[i : i + n])
        i += n
    return out


def stream(text: str, cfg: Config, pieces: list[str]) -> tuple[list[Delta], StreamParser]:
    sp = StreamParser(**cfg.kw())
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += sp.feed(piece)
    deltas += sp.finish()
    return deltas, sp


def assert_same(text: str, cfg: Config, deltas: list[Delta], sp: StreamParser) -> None:
    whole = parse_assistant(text, **cfg.kw())
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert content == (whole.content or ""), (text, cfg)
    assert reasoning == (whole.reasoning_content or ""), (text, cfg)
    assert [(d.name, d.arguments) for d in calls] == calls_of(whole), (text, cfg)
    assert [d.index for d in calls] == list(range(len(calls)))
    assert all(d.id is not None and ID.match(d.id) for d in calls)
    streamed = sp.message()
    assert (streamed.content, streamed.reasoning_content) == (
        whole.content,
        whole.reasoning_content,
    )
    assert [tc.id for tc in streamed.tool_calls] == [d.id for d in calls]
    assert sp.finish_reason("stop") == finish_reason(whole, "stop")


_PIECES = [
    "Hello", " world", "\n", "\n\n", "  ", "\t", "東京", "é", "🙂", "<", ">", "/",
    "<think>", "</think>", "<thi", "</thin", "<tool_call>", "</tool_call>", "<tool_",
    "</tool_c", '{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "x"',
    "\n" + CALL + "\n", "[TOOL_CALLS]", "[TOOL_", '[{"name": "f", "arguments": {}}]',
    'f[ARGS]{"a": 1}', "[ARGS]", "<tool_call><tool_call>", "</think></think>",
]  # fmt: skip

CORPUS = [
    "",
    "Hello",
    "\n\nHello\n\n",
    CALL,
    f"Text {CALL} more {CALL}",
    f"<think>why\n</think>\n\n{CALL}",
    f"reason</think>{CALL}tail",
    "<tool_call>{bad}</tool_call> and <tool_call>",
    "<tool_",
    "a <tool_call",
    "<think",
    " <think> a </think> b",
    '[TOOL_CALLS][{"name": "f", "arguments": {"x": "y"}}]',
    "ok [TOOL_CALLS] not json",
]


def configs() -> list[Config]:
    return [
        Config(tools, parser, reasoning, opened)
        for tools in (False, True)
        for parser in ("hermes", "mistral")
        for reasoning in (False, True)
        for opened in ((None, True, False) if reasoning else (None,))
    ]


@pytest.mark.parametrize("mode", ["chars", "random", "whole"])
def test_stream_equals_whole_parse(mode: str) -> None:
    rng = random.Random(["chars", "random", "whole"].index(mode))
    texts = CORPUS + [
        "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 14))) for _ in range(250)
    ]
    cfgs = configs()
    for text in texts:
        for cfg in cfgs if len(text) < 60 else rng.sample(cfgs, 4):
            deltas, sp = stream(text, cfg, chunk(text, rng, mode))
            assert_same(text, cfg, deltas, sp)


def test_special_text_removed_alike_whole_and_streamed() -> None:
    """Output decoded keeping special tokens (so a special tool-call marker reaches the
    parser) loses every other special token's text, whatever the chunking, before parsing."""
    words = ["<|im_end|>", "<|im_start|>", "<|python_tag|>", "</s>", "<s>", "ab", "bcd"]
    drop = SpecialText(words)
    rng = random.Random(3)
    alphabet = ["<", "|", "im_", "end", "start", "|>", "/s>", "s>", "a", "b", "c", "d", " ", "x"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        st = drop.stream()
        streamed = "".join(st.feed(p) for p in chunk(text, rng, "random")) + st.finish()
        assert streamed == drop.remove(text), text
    pieces = [*_PIECES, "<|im_end|>", "<|im_start|>", "<|im_", "<s>"]
    drop = SpecialText(["<|im_end|>", "<|im_start|>", "<s>"])
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        for cfg in rng.sample(configs(), 4):
            sp = StreamParser(**cfg.kw(), drop=drop)
            deltas = [d for p in chunk(text, rng, "random") for d in sp.feed(p)] + sp.finish()
            assert_same(drop.remove(text), cfg, deltas, sp)
            whole = parse_assistant(text, **cfg.kw(), drop=drop)
            assert calls_of(whole) == calls_of(parse_assistant(drop.remove(text), **cfg.kw()))


def test_output_markers() -> None:
    assert output_markers("hermes", tools_enabled=True, reasoning=False) == (
        "<tool_call>",
        "</tool_call>",
    )
    assert output_markers("mistral", tools_enabled=True, reasoning=True) == (
        "[TOOL_CALLS]",
        "<think>",
        "</think>",
    )
    assert output_markers("mistral", tools_enabled=False, reasoning=False) == ()


def test_stream_emits_early_and_holds_only_possible_markers() -> None:
    sp = StreamParser(tools_enabled=True, parser="hermes")
    assert sp.feed("Hello <tool_") == [ContentDelta("Hello ")]
    assert sp.feed("x> more\n") == [ContentDelta("<tool_x> more")]  # not a marker after all
    assert sp.feed("<tool_call>") == []
    assert sp.feed('{"name": "f", "arguments": {}}') == []  # a call goes out whole, once closed
    (delta,) = sp.feed("</tool_call>")
    assert isinstance(delta, ToolCallDelta) and (delta.index, delta.name) == (0, "f")
    assert sp.feed("\n\n") == [] and sp.finish() == []  # trailing newlines are dropped
    assert sp.message().content == "Hello <tool_x> more"
    with pytest.raises(RuntimeError):
        sp.feed("x")


def test_stream_reasoning_goes_out_as_it_comes() -> None:
    sp = StreamParser(tools_enabled=False, reasoning=True, reasoning_open=True)
    assert sp.feed("thinking hard") == [ReasoningDelta("thinking hard")]
    assert sp.feed(" still</th") == [ReasoningDelta(" still")]
    assert sp.feed("ink>\n\nDone") == [ContentDelta("Done")]
    sp = StreamParser(tools_enabled=False, reasoning=True)
    assert sp.feed("<think>a") == [ReasoningDelta("a")]
    auto = StreamParser(tools_enabled=False, reasoning=True)  # may have started inside <think>
    assert auto.feed("either") == [] and auto.finish() == [ContentDelta("either")]


def test_stream_is_linear_on_long_calls() -> None:
    body = json.dumps({"name": "write", "arguments": {"text": "x" * 40000}})
    text = "<tool_call>" + body + "</tool_call>"
    sp = StreamParser(tools_enabled=True)
    deltas = [d for ch in text for d in sp.feed(ch)] + sp.finish()
    assert len(deltas) == 1 and isinstance(deltas[0], ToolCallDelta)


# -- OpenAI shapes -------------------------------------------------------------------------------


def test_message_and_delta_dicts() -> None:
    msg = parse_assistant(f"<think>r</think>Hi {CALL}", tools_enabled=True, reasoning=True)
    d = message_dict(msg)
    assert d == {
        "role": "assistant",
        "content": "Hi ",
        "reasoning_content": "r",
        "tool_calls": [
            {
                "id": msg.tool_calls[0].id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert message_dict(parse_assistant("x", tools_enabled=False)) == {
        "role": "assistant",
        "content": "x",
    }
    deltas: list[Delta] = [
        ReasoningDelta("a"),
        ReasoningDelta("b"),
        ContentDelta("c"),
        ContentDelta("d"),
        ToolCallDelta(0, "call_1", "f", "{}"),
        ToolCallDelta(0, None, None, '{"more": 1}'),
    ]
    assert delta_dicts(deltas) == [
        {"reasoning_content": "ab"},
        {"content": "cd"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"more": 1}'}}]},
    ]  # fmt: skip
