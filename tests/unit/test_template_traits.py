"""What a chat template renders, probed once per template: tools (SmolLM2's writes none,
and the collector says so once in its log and counts every such request) and system
messages after the first (rendered as user messages where the template would drop them)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.collector import metrics as M
from services.collector.completion import ChatService
from services.collector.request import make_call
from services.collector.settings import CollectorConfig
from shared.chat import ChatTemplate
from tests.unit.test_chat import TOOLS

# SmolLM2-135M-Instruct's own template (role and content of each message, nothing else):
# the real one is checked in test_chat.py (test_smollm2_renders_no_tools).
PLAIN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_tokenizer)


@pytest.fixture(scope="module")
def smol(tiny_tokenizer: Path) -> ChatTemplate:
    """A template that writes no tools, as SmolLM2's."""
    return ChatTemplate.from_pretrained(tiny_tokenizer, chat_template=PLAIN_TEMPLATE)


def test_which_templates_render_tools(smol: ChatTemplate, tiny: ChatTemplate) -> None:
    assert not smol.renders_tools  # role and content only
    assert tiny.renders_tools
    messages = [{"role": "user", "content": "weather?"}]
    assert smol.render(messages, TOOLS) == smol.render(messages)
    assert "get_weather" in tiny.render(messages, TOOLS)


def test_late_system_messages_are_user_messages_where_the_template_drops_them(
    smol: ChatTemplate, tiny: ChatTemplate,
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "system", "content": "# Environment\ncwd /tmp"}]  # fmt: skip
    assert smol.renders_late_system  # writes every message with its own role
    assert "<|im_start|>system\n# Environment" in smol.render(messages)
    assert not tiny.renders_late_system  # writes messages[0]'s system prompt only
    text = tiny.render(messages)
    assert "<|im_start|>system\nbe brief" in text and "<|im_start|>user\n# Environment" in text
    # The ids are those of the rendering (what the engine gets and the trainer trains on).
    assert tiny.encode(messages) == tiny.encode_text(text)


async def test_tools_the_template_leaves_out_are_said_once_and_counted(
    smol: ChatTemplate, caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = CollectorConfig()
    service = ChatService(cfg, None, smol, None, "smollm2")  # type: ignore[arg-type]
    call = make_call([{"role": "user", "content": "weather?"}], TOOLS, tools_enabled=True,
                     headers={"x-turn-type": "side"}, cfg=cfg)  # fmt: skip
    before = M.UNRENDERED_TOOLS._value.get()
    with caplog.at_level(logging.WARNING, logger="services.collector.completion"):
        for _ in range(3):
            await service.prepare(call)
    assert M.UNRENDERED_TOOLS._value.get() - before == 3
    warnings = [r for r in caplog.records if "renders no tools" in r.getMessage()]
    assert len(warnings) == 1
    plain = make_call([{"role": "user", "content": "hi"}], None, tools_enabled=True,
                      headers={"x-turn-type": "side"}, cfg=cfg)  # fmt: skip
    await service.prepare(plain)
    assert M.UNRENDERED_TOOLS._value.get() - before == 3  # no tools offered: nothing to say
