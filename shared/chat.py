"""Chat templating and prompt token ids: the model's own template, exactly, and fast.

The collector turns an OpenAI request into the prompt ids it sends to the engine:

    tpl = ChatTemplate.from_pretrained(path)
    ids = tpl.encode(messages, tools)            # the rendering, client text as plain text
    ids, cache = tpl.encode_incremental(messages, tools, cache)   # the same ids, cheaper

`encode` is the definition: prompt ids are the tokenization of the chat template's
rendering in which only the template's own markers are control tokens. Text the client
wrote (contents, names, tool-call arguments, tool results, tool definitions) is
tokenized as plain characters even when it spells `<|im_end|>` or `<tool_call>`, so a
message can never forge a turn boundary or a tool call, neither for the engine nor
for the trainer, which both get these ids. `encode_incremental` returns exactly the
same ids but, given the `PromptCache` of an earlier request of the same conversation,
tokenizes only what is new (docs/design.md#hot-paths: agents resend the whole history on
every call).

Control tokens are the added tokens marked special, plus the added tokens the chat
template writes or a tool-call or reasoning parser looks for (`<tool_call>`,
`<think>`: often plain added tokens, yet markers all the same). Other added tokens
(extra words, whitespace runs) are ordinary text everywhere.

Keeping client text plain (`render_prompt`, then `encode_rendering`):
1. Nothing to do unless some client string contains a control token's text, ends
   with the start of one or starts with the end of one (so that it could complete
   one with the text next to it): one regular-expression scan of the request's
   strings. Then the ids are the tokenizer's ids of the rendering, as always.
2. Otherwise the template renders the request again with those strings replaced by
   sentinels, and the two renderings are aligned (`shared.chat_messages`): the
   character spans the client strings occupy (`Rendering.client_spans`).
3. The rendering is tokenized as usual; a control token that overlaps a client span
   is forged. Each stretch between two of the template's own control tokens that
   holds a forged one is tokenized again on its own with control tokens disabled
   (the tokenizer's `encode_special_tokens`, on a copy where every control token is
   special). Since a tokenizer splits its input at added tokens before anything
   else, every other stretch keeps the ids it had: without forged tokens the result
   is exactly the plain tokenization. The one caveat: a re-tokenized stretch is
   tokenized as if it started the input, which only matters for tokenizers that
   treat the input's start specially (Metaspace with prepend_scheme="first"); for
   byte-level BPE tokenizers it is what the stretch would be in place.

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
simply a full encode. Cut points are read from the tokenizer's own offsets, and only
the template's own tokens are cut points. Client text does not change this: its
stretches never contain a cut point, so a prefix is reused only when the client spans
before the cut are the same too (the same text with other owners, e.g. a user message
spelling out the next turn, has other ids).

What the template renders is probed once per template: whether it writes tools at all
(`renders_tools`: SmolLM2's ignores them; the collector says so) and whether it writes a
system message that is not the first (`renders_late_system`); where it does not, such a
message (a Claude Code environment entry, a later developer message) is rendered as a
user message, so the model reads it rather than losing it.

`PromptCache` is small and JSON-serializable (the collector keeps it in Redis next to
the pending turn): the rendered text, its ids, the cut points as (character offset
just after a cut token, number of ids up to and including it), and the client spans
(only when a client string needed them; absent from the JSON otherwise).
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from shared.chat_messages import (
    ChatTemplateError,
    ControlText,
    client_strings,
    locate_client_text,
    mask_client_strings,
    normalize_messages,
    normalize_tools,
)
from shared.errors import MalformedMessage, SettingsError
from shared.schemas import describe
from shared.toolcalls import THINK_CLOSE, THINK_OPEN, SpecialText
from shared.toolparsers import get_tool_parser, tool_parser_names

__all__ = ["ChatTemplate", "ChatTemplateError", "PromptCache", "Rendering"]

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
    # client text tokenized as plain text (Rendering.client_spans)
    spans: list[tuple[int, int]] = []

    @model_validator(mode="after")
    def _consistent(self) -> PromptCache:
        last_off, last_n = 0, 0
        for off, n in self.cuts:
            if not (last_off < off <= len(self.text) and last_n < n <= len(self.ids)):
                raise ValueError(f"cut ({off}, {n}) is out of order or out of range")
            last_off, last_n = off, n
        last_end = 0
        for start, end in self.spans:
            if not last_end <= start < end <= len(self.text):
                raise ValueError(f"span ({start}, {end}) is out of order or out of range")
            last_end = end
        return self

    def to_json(self) -> str:
        return self.model_dump_json(exclude={"spans"} if not self.spans else None)

    @classmethod
    def from_json(cls, data: str | bytes) -> PromptCache:
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise MalformedMessage(f"not a valid PromptCache: {describe(exc)}") from None


@dataclass(frozen=True, slots=True)
class Rendering:
    """A chat template's text, and where in it the client's strings that touch control
    tokens are (sorted, disjoint character spans; empty for ordinary requests)."""

    text: str
    client_spans: tuple[tuple[int, int], ...] = ()


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
        self.special_texts: tuple[str, ...] = tuple(
            t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content
        )  # what a decode that skips special tokens drops
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._cut_tokens: dict[int, str] = self._find_cut_tokens()
        self._control: dict[int, str] = self._find_control_tokens()
        self._control_text = ControlText(self._control.values(), self._client_normalizer())
        self._output_text: dict[frozenset[str], SpecialText] = {}
        log.debug("chat template ready; cut tokens %s", sorted(self._cut_tokens.values()))

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, chat_template: str | None = None, **tokenizer_kwargs: Any
    ) -> ChatTemplate:
        """Load the tokenizer at `path` (an HF folder or hub id; `gguf_file=` etc. pass through).

        `chat_template` overrides the tokenizer's own. EOS ids from the folder's
        `generation_config.json`, when present, join the tokenizer's EOS.
        """
        try:
            tokenizer = load_tokenizer(path, **tokenizer_kwargs)
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

    @property
    def control_tokens(self) -> dict[int, str]:
        """The tokens client text never becomes (id -> text): special added tokens, and
        added tokens the template writes or a tool-call or reasoning parser looks for."""
        return dict(self._control)

    def output_special_text(self, markers: Iterable[str]) -> SpecialText | None:
        """How the output must be decoded for `markers` (`shared.toolcalls.output_markers`)
        to reach the parser. None: as engines do by default, skipping special tokens (none
        of the markers is one). Otherwise keeping special tokens (`skip_special_tokens:
        False`), and the returned `SpecialText` removes all other special tokens' text."""
        keep = frozenset(markers) & frozenset(self.special_texts)
        if not keep:
            return None
        if keep not in self._output_text:
            self._output_text[keep] = SpecialText(t for t in self.special_texts if t not in keep)
        return self._output_text[keep]

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
        return self._apply(msgs, normalize_tools(tools), add_generation_prompt, template_kwargs)

    def render_prompt(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> Rendering:
        """`render(...)` and the spans of client text in it that must stay plain text."""
        msgs = normalize_messages(messages)
        tool_list = normalize_tools(tools)
        text = self._apply(msgs, tool_list, add_generation_prompt, template_kwargs)
        risky = self._control_text.find(client_strings(msgs, tool_list))
        if not risky:
            return Rendering(text)
        masked = mask_client_strings(msgs, tool_list, risky.__contains__, text)
        try:
            masked_text = self._apply(
                masked.messages, masked.tools, add_generation_prompt, template_kwargs
            )
        except ChatTemplateError as exc:
            raise ChatTemplateError(
                "the messages contain control-token text (e.g. <|im_end|>) and the chat "
                f"template fails when that text is set apart: {exc}"
            ) from None
        return Rendering(text, tuple(locate_client_text(text, masked_text, masked)))

    # -- what the template renders (probed once) ----------------------------------------

    def _probe(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str | None:
        try:
            text = self.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)  # fmt: skip
        except Exception:  # a template that raises on the probe renders none of it
            return None
        return text if isinstance(text, str) else None

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template writes the tools it is given (SmolLM2's ignores them):
        a conversation rendered with a tool differs from the same without."""
        msgs = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "nextstate_probe", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
        with_tools, without = self._probe(msgs, [tool]), self._probe(msgs)
        return with_tools is not None and with_tools != without

    @functools.cached_property
    def renders_late_system(self) -> bool:
        """Whether the template writes a system message that is not the first message
        (many write only messages[0]'s, and skip or refuse the others)."""
        probe = "nextstate-probe-late-system"
        text = self._probe([{"role": "user", "content": "hi"}, {"role": "system", "content": probe},
                            {"role": "user", "content": "go"}])  # fmt: skip
        return text is not None and probe in text

    def _late_system_as_user(self, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """System messages after the first, as user messages, for a template that would
        drop or refuse them (`renders_late_system`): the model reads them either way."""
        if not any(m["role"] == "system" for m in msgs[1:]) or self.renders_late_system:
            return msgs
        return [msgs[0], *({**m, "role": "user"} if m["role"] == "system" else m for m in msgs[1:])]

    def _apply(
        self,
        msgs: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> str:
        msgs = self._late_system_as_user(msgs)
        try:
            text = self.tokenizer.apply_chat_template(
                msgs,
                tools=tools,
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
        """Prompt ids: `render(...)` tokenized, client text as plain text, no added BOS/EOS."""
        rendering = self.render_prompt(messages, tools, add_generation_prompt, **template_kwargs)
        if not rendering.client_spans:
            return self.encode_text(rendering.text)
        return self._encode_piece(rendering.text, list(rendering.client_spans))[0]

    def encode_text(self, text: str) -> list[int]:
        """The tokenizer's ids of `text`, all of it trusted: every control token's text in
        it becomes that control token. For a rendering of messages use `encode`."""
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
        rendering = self.render_prompt(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode_rendering(rendering, cache)

    def encode_text_incremental(
        self, text: str, cache: PromptCache | None = None
    ) -> tuple[list[int], PromptCache]:
        """`encode_text(text)` (trusted text), tokenizing only what follows the last shared cut."""
        return self.encode_rendering(Rendering(text), cache)

    def encode_rendering(
        self, rendering: Rendering, cache: PromptCache | None = None
    ) -> tuple[list[int], PromptCache]:
        """The prompt ids of a `render_prompt` result, tokenizing only what follows the
        last cut point it shares with `cache` (text and client spans before it)."""
        text, spans = rendering.text, list(rendering.client_spans)
        if cache is not None and self._cut_tokens:
            if text == cache.text and spans == cache.spans:
                return list(cache.ids), cache
            k = self._shared_cut(text, spans, cache)
            if k is not None:
                off, n = cache.cuts[k]
                tail = [(a - off, b - off) for a, b in spans if a >= off]
                new_ids, new_cuts = self._encode_piece(text[off:], tail)
                ids = cache.ids[:n] + new_ids
                cuts = cache.cuts[: k + 1] + [(off + o, n + m) for o, m in new_cuts]
                return list(ids), PromptCache.model_construct(
                    text=text, ids=ids, cuts=cuts, spans=spans
                )
        ids, cuts = self._encode_piece(text, spans)
        return list(ids), PromptCache.model_construct(text=text, ids=ids, cuts=cuts, spans=spans)

    def _encode_piece(
        self, text: str, spans: list[tuple[int, int]]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and cut points of `text`, the control tokens overlapping `spans` made plain."""
        if not spans:
            if not self._cut_tokens:
                return self.encode_text(text), []
            enc = self._backend.encode(text, add_special_tokens=False)
            return enc.ids, self._cuts_in(enc, enc.ids, text)
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a slow tokenizer: no offsets
            raise ChatTemplateError(
                "the messages contain control-token text (e.g. <|im_end|>), which this "
                "(slow) tokenizer cannot keep as plain text"
            ) from None
        ids: list[int] = list(enc["input_ids"])
        offs: list[tuple[int, int]] = [(a, b) for a, b in enc["offset_mapping"]]
        ends = [b for _, b in spans]
        owned: list[int] = []  # the template's own control tokens
        fake: list[int] = []  # control tokens that overlap client text
        for i, t in enumerate(ids):
            if t in self._control:
                j = bisect.bisect_right(ends, offs[i][0])
                forged = j < len(spans) and spans[j][0] < offs[i][1]
                (fake if forged else owned).append(i)
        if not fake:
            return ids, [(offs[i][1], i + 1) for i in owned if self._is_cut(ids[i], offs[i], text)]
        out: list[int] = []
        cuts: list[tuple[int, int]] = []
        prev, f = -1, 0  # the last owned token; the next forged one
        for b in [*owned, len(ids)]:
            if f < len(fake) and fake[f] < b:  # tokenize this stretch again, plainly
                start = offs[prev][1] if prev >= 0 else 0
                end = offs[b][0] if b < len(ids) else len(text)
                out += self._plain_ids(text[start:end])
                while f < len(fake) and fake[f] < b:
                    f += 1
            else:
                out += ids[prev + 1 : b]
            if b < len(ids):
                out.append(ids[b])
                if self._is_cut(ids[b], offs[b], text):
                    cuts.append((offs[b][1], len(out)))
            prev = b
        return out, cuts

    def _plain_ids(self, text: str) -> list[int]:
        """`text` tokenized with every control token disabled (its characters as text)."""
        if self._plain is not None:
            ids: list[int] = self._plain.encode(text, add_special_tokens=False).ids
        else:
            ids = list(
                self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)[
                    "input_ids"
                ]
            )
        if any(t in self._control for t in ids):
            raise ChatTemplateError(
                "the messages contain control-token text that this tokenizer cannot "
                "tokenize as plain text"
            )
        return ids

    def _is_cut(self, tid: int, off: tuple[int, int], text: str) -> bool:
        content = self._cut_tokens.get(tid)
        return content is not None and text[off[0] : off[1]] == content

    def _shared_cut(
        self, text: str, spans: list[tuple[int, int]], cache: PromptCache
    ) -> int | None:
        """Index of the last cut of `cache` whose prefix `text` shares, with the same
        client spans before it, if it checks out."""
        limit = _first_difference(spans, cache.spans)
        cuts = cache.cuts[: bisect.bisect_right(cache.cuts, (limit, len(cache.ids)))]
        if not cuts:
            return None
        if text.startswith(cache.text[: cuts[-1][0]]):
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

    # -- control tokens --------------------------------------------------------------

    def _find_control_tokens(self) -> dict[int, str]:
        template = self.tokenizer.chat_template
        sources = list(template.values()) if isinstance(template, dict) else [template]
        markers = {THINK_OPEN, THINK_CLOSE}
        for name in tool_parser_names():
            parser = get_tool_parser(name)
            markers.update(m for m in (parser.start, parser.end) if m)
        return {
            tid: tok.content
            for tid, tok in self.tokenizer.added_tokens_decoder.items()
            if tok.content
            and (
                tok.special
                or tok.content in markers
                or (_markup(tok.content) and any(tok.content in s for s in sources))
            )
        }

    def _client_normalizer(self) -> Any:
        """The backend's normalizer, when a control token is matched after normalization
        (client text must then be checked both as written and normalized)."""
        normalizer = getattr(self._backend, "normalizer", None)
        if normalizer is None:
            return None
        added = self.tokenizer.added_tokens_decoder
        return normalizer.normalize_str if any(added[t].normalized for t in self._control) else None

    @functools.cached_property
    def _plain(self) -> Any:
        """A copy of the backend on which every control token is special and special
        tokens are not matched: client text tokenizes to its characters' ids. (Made on
        first use: only requests with control-token text need it.)"""
        if self._backend is None or not self._control:
            return None
        from tokenizers import Tokenizer  # installed with transformers' fast tokenizers

        data = json.loads(self._backend.to_str())
        control = set(self._control.values())
        for tok in data.get("added_tokens") or []:
            if tok.get("content") in control:
                tok["special"] = True
        plain = Tokenizer.from_str(json.dumps(data))
        plain.no_truncation()
        plain.no_padding()
        plain.encode_special_tokens = True
        return plain

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


def _markup(text: str) -> bool:
    """Does an added token look like a marker (`<tool_call>`, `[INST]`), not like a word
    or a run of whitespace (which some tokenizers add, and a template may contain too)?"""
    return any(not (c.isalnum() or c.isspace() or c == "_") for c in text)


def _first_difference(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """The first offset where two span lists differ (a very large number when equal)."""
    for x, y in zip(a, b, strict=False):
        if x != y:
            return min(x[0], y[0])
    if len(a) != len(b):
        return (a[len(b)] if len(a) > len(b) else b[len(a)])[0]
    return 1 << 62


# Model types whose folders AutoTokenizer answers with the plain tokenizers backend when
# their tokenizer_config.json names it (checked against AutoTokenizer in tests/unit/
# test_tokenizer_load.py). Not e.g. qwen2: transformers overrides the class it declares.
PLAIN_BACKEND_MODEL_TYPES = frozenset({"llama"})
PLAIN_BACKEND_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(path: str | Path, **tokenizer_kwargs: Any) -> Any:
    """What `AutoTokenizer.from_pretrained(path, **tokenizer_kwargs)` returns, in a third
    of the time where we know its answer without asking it.

    Importing AutoTokenizer imports torch and every model configuration (3 s of a
    service's start here, more on a busy machine). A local folder whose
    tokenizer_config.json names the plain tokenizers backend, with no custom code, of a
    model type AutoTokenizer keeps that class for (`plain_backend_folder`), gets that
    backend directly; anything else goes through AutoTokenizer.
    """
    if not tokenizer_kwargs and plain_backend_folder(Path(path)):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer  # heavy: import only when a service loads a model

    return AutoTokenizer.from_pretrained(str(path), **tokenizer_kwargs)


def plain_backend_folder(folder: Path) -> bool:
    """`folder` holds a tokenizer AutoTokenizer loads as the plain tokenizers backend."""
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(tok_cfg, dict) and isinstance(cfg, dict)
        and (folder / "tokenizer.json").is_file()
        and not (folder / "tekken.json").exists()  # Mistral's own format: AutoTokenizer may pick it
        and tok_cfg.get("tokenizer_class") in PLAIN_BACKEND_CLASSES
        and "auto_map" not in tok_cfg and "auto_map" not in cfg
        and cfg.get("model_type") in PLAIN_BACKEND_MODEL_TYPES
    )  # fmt: skip


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
