"""Chat templating and prompt token ids: the model's own template, exactly, and fast.

The collector turns an OpenAI request into the prompt ids it sends to the engine:

    tpl = ChatTemplate.from_pretrained(path)
    ids = tpl.encode(messages, tools)            # tokenizer(render(...), add_special_tokens=False)
    ids, cache = tpl.encode_incremental(messages, tools, cache)   # the same ids, cheaper

`encode` is the definition: prompt ids are the tokenization of the chat template's
rendering. `encode_incremental` returns exactly the same ids but, given the
`PromptCache` of an earlier request of the same conversation, tokenizes only what is
new (DESIGN.md "Hot paths": agents resend the whole history on every call).

Why reusing a prefix is exact. A HF fast tokenizer first splits its input on added
tokens (`<|im_start|>`, `<|im_end|>`, `<tool_call>`...), then normalizes,
pre-tokenizes and runs BPE on each piece between them separately. So if a rendering
T has such a token ending at character p, then ids(T) = ids(T[:p]) + ids(T[p:]), and
ids(T[:p]) is the cached ids up to that token whenever the new rendering shares T[:p]
with the cached one. This holds for a token that (a) no other added token can cover
the end of (by containing it, or by starting inside it and running past it: else a
match could span p), (b) does not strip or require whitespace around itself (rstrip,
single_word), does not end in whitespace (nor in a word character, if any added token
is single_word), and (c) is matched before normalization (or the tokenizer has no
normalizer). The tokenizer is also probed at
load: for each candidate, ids(h + token + t) == ids(h + token) + ids(t) on a set of
heads and tails, which rejects pre-tokenizers that treat the start of the input
specially (e.g. Metaspace with prepend_scheme="first"). Candidates are the added
tokens that appear in the chat template; if none qualifies, incremental encoding is
simply a full encode. Cut points are read from the tokenizer's own offsets, so a
token that appears in user text counts only where the tokenizer matched it.

`PromptCache` is small and JSON-serializable (the collector keeps it in Redis next to
the pending turn): the rendered text, its ids, and the cut points as
(character offset just after a cut token, number of ids up to and including it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from shared.chat_messages import ChatTemplateError, normalize_messages, normalize_tools
from shared.errors import MalformedMessage, SettingsError
from shared.schemas import describe

__all__ = ["ChatTemplate", "ChatTemplateError", "PromptCache"]

log = logging.getLogger(__name__)

# Tokens that end a turn in common chat formats; those the tokenizer has are stop ids.
END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
)

_PROBE_HEADS = ("", "hi", "a b ", "\n", "é ")
_PROBE_TAILS = (
    "", "x", " x", "  y z", "\n\nz", "assistant\n", "Hello world!", "'s", "東京 café",
    "\t1 2", " \n ", "{\"a\": 1}",
)  # fmt: skip


class PromptCache(BaseModel):
    """A rendering, its exact ids, and where it can be cut without changing them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    ids: list[int]
    # (character offset just after a cut token, number of ids up to and including it)
    cuts: list[tuple[int, int]]

    @model_validator(mode="after")
    def _consistent(self) -> PromptCache:
        last_off, last_n = 0, 0
        for off, n in self.cuts:
            if not (last_off < off <= len(self.text) and last_n < n <= len(self.ids)):
                raise ValueError(f"cut ({off}, {n}) is out of order or out of range")
            last_off, last_n = off, n
        return self

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> PromptCache:
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise MalformedMessage(f"not a valid PromptCache: {describe(exc)}") from None


class ChatTemplate:
    """A tokenizer and its chat template: render, encode (fully or incrementally), decode."""

    def __init__(self, tokenizer: Any, *, extra_eos_token_ids: Sequence[int] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise SettingsError(
                "the tokenizer has no chat template: use a chat/instruct model or pass "
                "chat_template= to ChatTemplate.from_pretrained"
            )
        self.tokenizer = tokenizer
        added: dict[str, int] = dict(tokenizer.get_added_vocab())
        eos = [tokenizer.eos_token_id] if isinstance(tokenizer.eos_token_id, int) else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))
        turn_ends = [added[t] for t in END_OF_TURN if t in added]
        self.stop_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*self.eos_token_ids, *turn_ends])
        )
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._cut_tokens: dict[int, str] = self._find_cut_tokens()
        log.debug("chat template ready; cut tokens %s", sorted(self._cut_tokens.values()))

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, chat_template: str | None = None, **tokenizer_kwargs: Any
    ) -> ChatTemplate:
        """Load the tokenizer at `path` (an HF folder or hub id; `gguf_file=` etc. pass through).

        `chat_template` overrides the tokenizer's own. EOS ids from the folder's
        `generation_config.json`, when present, join the tokenizer's EOS.
        """
        from transformers import AutoTokenizer  # heavy: import only when a service loads a model

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), **tokenizer_kwargs)
        except (OSError, ValueError) as exc:
            raise SettingsError(f"cannot load a tokenizer from {path}: {exc}") from exc
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        return cls(tokenizer, extra_eos_token_ids=_generation_config_eos(Path(path)))

    @property
    def cut_tokens(self) -> dict[int, str]:
        """The added tokens after which a rendering is cut safely (id -> text); empty: no
        incremental encoding for this tokenizer (every call encodes in full)."""
        return dict(self._cut_tokens)

    # -- rendering -------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for these OpenAI messages (normalized first, see
        `shared.chat_messages`). Raises `ChatTemplateError` when they cannot be rendered."""
        msgs = normalize_messages(messages)
        tool_list = normalize_tools(tools)
        try:
            text = self.tokenizer.apply_chat_template(
                msgs,
                tools=tool_list,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template cannot render these messages: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    # -- encoding --------------------------------------------------------------------

    def encode(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt ids: the tokenization of `render(...)`, without added BOS/EOS."""
        return self.encode_text(
            self.render(messages, tools, add_generation_prompt, **template_kwargs)
        )

    def encode_text(self, text: str) -> list[int]:
        """The canonical tokenization of a rendered prompt."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_incremental(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        cache: PromptCache | None = None,
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> tuple[list[int], PromptCache]:
        """`encode(...)`, reusing `cache`'s ids for the part of the rendering it shares.

        Returns the ids and the cache for this rendering (pass it to the next call of
        the same conversation). The ids always equal `encode(...)`'s.
        """
        text = self.render(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode_text_incremental(text, cache)

    def encode_text_incremental(
        self, text: str, cache: PromptCache | None = None
    ) -> tuple[list[int], PromptCache]:
        """`encode_text(text)`, tokenizing only what follows the last shared cut point."""
        if cache is not None and self._cut_tokens:
            if text == cache.text:
                return list(cache.ids), cache
            k = self._shared_cut(text, cache)
            if k is not None:
                off, n = cache.cuts[k]
                suffix = text[off:]
                enc = self._backend.encode(suffix, add_special_tokens=False)
                new_ids: list[int] = enc.ids
                ids = cache.ids[:n] + new_ids
                cuts = cache.cuts[: k + 1] + [
                    (off + o, n + m) for o, m in self._cuts_in(enc, new_ids, suffix)
                ]
                return list(ids), PromptCache.model_construct(text=text, ids=ids, cuts=cuts)
        return self._encode_full(text)

    def _encode_full(self, text: str) -> tuple[list[int], PromptCache]:
        if not self._cut_tokens:
            ids = self.encode_text(text)
            return list(ids), PromptCache.model_construct(text=text, ids=ids, cuts=[])
        enc = self._backend.encode(text, add_special_tokens=False)
        ids = enc.ids
        cuts = self._cuts_in(enc, ids, text)
        return list(ids), PromptCache.model_construct(text=text, ids=ids, cuts=cuts)

    def _shared_cut(self, text: str, cache: PromptCache) -> int | None:
        """Index of the last cut of `cache` whose prefix `text` shares, if it checks out."""
        cuts = cache.cuts
        if not cuts:
            return None
        if text.startswith(cache.text):
            k = len(cuts) - 1
        else:  # the template rewrote history: binary search the last shared cut
            lo, hi = 0, len(cuts) - 1
            k = -1
            while lo <= hi:
                mid = (lo + hi) // 2
                off = cuts[mid][0]
                if text[:off] == cache.text[:off]:
                    k, lo = mid, mid + 1
                else:
                    hi = mid - 1
            if k < 0:
                return None
        off, n = cuts[k]
        content = self._cut_tokens.get(cache.ids[n - 1]) if 0 < n <= len(cache.ids) else None
        if content is None or not cache.text.startswith(content, off - len(content)):
            log.debug("prompt cache does not match this tokenizer; encoding in full")
            return None
        return k

    def _cuts_in(self, enc: Any, ids: list[int], text: str) -> list[tuple[int, int]]:
        """(char offset after, ids through) for every cut token the tokenizer matched."""
        cut = self._cut_tokens
        out: list[tuple[int, int]] = []
        for i in [i for i, t in enumerate(ids) if t in cut]:
            start, end = enc.token_to_chars(i)
            if text[start:end] == cut[ids[i]]:
                out.append((end, i + 1))
        return out

    # -- finding the cut tokens ------------------------------------------------------

    def _find_cut_tokens(self) -> dict[int, str]:
        backend = self._backend
        if backend is None:
            return {}
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        template = self.tokenizer.chat_template
        sources = list(template.values()) if isinstance(template, dict) else [template]
        added = dict(self.tokenizer.added_tokens_decoder)
        others = [t.content for t in added.values() if t.content]
        plain = backend.normalizer is None
        word_bound = any(t.single_word for t in added.values())
        found: dict[int, str] = {}
        for tid, tok in added.items():
            c = tok.content
            if not c or c[-1].isspace() or not any(c in s for s in sources):
                continue
            if tok.rstrip or tok.single_word or (tok.normalized and not plain):
                continue
            if word_bound and (c[-1].isalnum() or c[-1] == "_"):
                continue  # a single_word token right after it would see a different boundary
            if any(_crosses_end(c, other) for other in others):
                continue
            if self._splits_cleanly(tid, c):
                found[tid] = c
        if found and not self._backend_is_canonical(found):
            log.warning("tokenizer wrapper and backend disagree: incremental encoding disabled")
            return {}
        return found

    def _splits_cleanly(self, tid: int, content: str) -> bool:
        def ids(s: str) -> list[int]:
            return list(self._backend.encode(s, add_special_tokens=False).ids)

        tails = (*_PROBE_TAILS, content, "x" + content)
        for head in _PROBE_HEADS:
            pre = ids(head + content)
            if not pre or pre[-1] != tid:
                return False
            if any(ids(head + content + tail) != pre + ids(tail) for tail in tails):
                return False
        return True

    def _backend_is_canonical(self, cut_tokens: dict[int, str]) -> bool:
        text = "".join(tail + c for tail in _PROBE_TAILS for c in cut_tokens.values())
        backend_ids = list(self._backend.encode(text, add_special_tokens=False).ids)
        return backend_ids == self.encode_text(text)

    # -- decoding --------------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (e.g. the stop token) are dropped by default."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def _crosses_end(token: str, other: str) -> bool:
    """Could a match of `other` cover the end of `token`: contain it, or start inside it
    and run past its end? (Added tokens are matched in two passes, non-normalized then
    normalized, so an `other` from the first pass can start inside `token`.)"""
    if other == token:
        return False
    if token in other:
        return True
    return any(
        other.startswith(token[k:]) and len(other) > len(token) - k for k in range(1, len(token))
    )


def _generation_config_eos(path: Path) -> list[int]:
    """EOS ids from `generation_config.json` next to the tokenizer, if there is one."""
    try:
        cfg = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return []
    eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [e for e in eos if isinstance(e, int)]
    return []
