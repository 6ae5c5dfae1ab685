"""The tokenizer every engine component uses: encode/decode, special ids, chat templates, streaming decode.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust HF tokenizer, attribute `.hf`) plus what a
`tokenizer.json` alone does not say: BOS/EOS/PAD, whether to add BOS, the chat template. It is built from
an HF model directory (`from_dir`) or from GGUF metadata (`from_gguf`), and `save` writes a directory
`from_dir` reads back (used to cache GGUF conversions).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import tokenizers

from deepinfer.engine.json_file import read_json_object
from deepinfer.errors import InvalidRequestError, ModelLoadError

# Tokens that end a turn in common chat formats. They count as end-of-generation ids when the model's
# chat template writes them, because then the model was trained to emit them where it stops.
_END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>",
    "<|endoftext|>", "</s>", "<|return|>", "<｜end▁of▁sentence｜>",
)
# Document-end tokens that always stop generation when the vocabulary marks them special.
_ALWAYS_EOS_TOKENS = ("<|endoftext|>",)

# The roles a message may have: the OpenAI chat roles that HF chat templates are written for.
# Most templates (ChatML, Llama-3) print message['role'] verbatim as the turn header, so a typo
# ("assitant") or a made-up role would reach the model, silently, as a turn it was never trained on.
CHAT_ROLES = ("system", "user", "assistant", "tool")

_TOKENIZER_CONFIG = "tokenizer_config.json"
_TOKENIZER_JSON = "tokenizer.json"
_CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A text tokenizer with the model's special tokens and chat template.

    Attributes: `hf` (the wrapped `tokenizers.Tokenizer`), `vocab_size` (including added tokens),
    `bos_token_id`, `eos_token_ids` (every id that ends generation, main EOS first), `pad_token_id`,
    `unk_token_id`, `special_token_ids`, `chat_template`, `add_bos`.
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.bos_token_id = self._id_of(bos_token)
        self.pad_token_id = self._id_of(pad_token)
        self.unk_token_id = self._id_of(unk_token)
        self.chat_template = chat_template or None
        self.add_bos = bool(add_bos) and self.bos_token_id is not None
        added = hf.get_added_tokens_decoder()
        self.special_token_ids: set[int] = {i for i, tok in added.items() if tok.special}
        for i in (self.bos_token_id, self._id_of(eos_token), self.pad_token_id, self.unk_token_id):
            if i is not None:
                self.special_token_ids.add(i)
        self.eos_token_ids: list[int] = self._collect_eos_ids(eos_token, extra_eos_token_ids)
        self._template = None  # compiled lazily: most users never render a chat

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    def _collect_eos_ids(self, eos_token: str | None, extra: Iterable[int]) -> list[int]:
        ids: list[int] = []

        def add(i: int | None) -> None:
            if i is not None and 0 <= i < self.vocab_size and i not in ids:
                ids.append(int(i))

        add(self._id_of(eos_token))
        for i in extra:
            add(i)
        template = self.chat_template or ""
        for tok in _END_OF_TURN_TOKENS:
            i = self.hf.token_to_id(tok)
            if i is not None and tok in template:
                add(i)
        for tok in _ALWAYS_EOS_TOKENS:
            i = self.hf.token_to_id(tok)
            if i is not None and i in self.special_token_ids:
                add(i)
        return ids

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`, `generation_config.json`)."""
        d = Path(path)
        tj = d / _TOKENIZER_JSON
        if not tj.is_file():
            raise ModelLoadError(f"no {_TOKENIZER_JSON} in {d}: DeepInfer needs a fast (tokenizers) tokenizer file")
        try:
            hf = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
            raise ModelLoadError(f"cannot parse {tj}: {e}") from e
        cfg = read_json_object(d / _TOKENIZER_CONFIG) if (d / _TOKENIZER_CONFIG).is_file() else {}
        template = _pick_chat_template(cfg.get("chat_template"))
        if (d / _CHAT_TEMPLATE_FILE).is_file():
            template = (d / _CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        bos = _token_content(cfg.get("bos_token"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(hf, bos)
        extra: list[int] = [int(i) for i in cfg.get("deepinfer_eos_token_ids", [])]
        gen = d / "generation_config.json"
        if gen.is_file():
            eos = read_json_object(gen).get("eos_token_id")
            extra += [eos] if isinstance(eos, int) else [int(i) for i in (eos or [])]
        return cls(
            hf,
            bos_token=bos,
            eos_token=_token_content(cfg.get("eos_token")),
            pad_token=_token_content(cfg.get("pad_token")),
            unk_token=_token_content(cfg.get("unk_token")),
            add_bos=bool(add_bos),
            chat_template=template,
            extra_eos_token_ids=extra,
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (`reader` is a `gguf.GGUFReader`)."""
        from deepinfer.engine.loader.gguf_tokenizer import tokenizer_parts_from_gguf

        hf, meta = tokenizer_parts_from_gguf(reader)
        return cls(hf, **meta)

    def save(self, path: str | os.PathLike) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json` that `from_dir` (and transformers) read back."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(d / _TOKENIZER_JSON))
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "add_bos_token": self.add_bos,
            "deepinfer_eos_token_ids": self.eos_token_ids,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (d / _TOKENIZER_CONFIG).write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. `<|im_start|>`) map to their ids.

        `add_special_tokens=True` prepends BOS when the model wants one (`add_bos`). Text rendered by a
        chat template usually carries its own BOS already, so encode that with the default False.
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"encode expects a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: the Rust tokenizer would raise a bare TypeError
            raise InvalidRequestError(
                f"text is not valid Unicode: {text[e.start:e.end]!r} at index {e.start} cannot be encoded as UTF-8"
            ) from e
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 byte runs come out as U+FFFD."""
        ids = list(ids)
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise InvalidRequestError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The vocabulary string of token `i` (byte-level spelling for BPE vocabularies)."""
        tok = self.hf.id_to_token(i) if 0 <= i < self.vocab_size else None
        if tok is None:
            raise InvalidRequestError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return tok

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None."""
        return self.hf.token_to_id(token)

    def __len__(self) -> int:
        return self.vocab_size

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template.

        Extra keyword arguments reach the template as variables (e.g. `enable_thinking=False`).
        Raises InvalidRequestError for malformed messages, a missing template, or a template that
        rejects the conversation via `raise_exception`.
        """
        if self.chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template; pass a plain prompt instead")
        msgs = _validate_messages(messages)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                unk_token=self.unk_token or "",
                **kwargs,
            )
        except InvalidRequestError:
            raise
        except Exception as e:  # a template bug on this input (e.g. a jinja TypeError): say which
            raise InvalidRequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------- streaming decode
class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text, only ever emitting complete characters.

    A byte-level BPE token can hold part of a UTF-8 character, so decoding token by token would emit
    U+FFFD and then the right character. This keeps a small window of token ids: `prefix` (already
    emitted, kept as context so decoders that strip a leading space behave as in a full decode) and
    the unread tail; text is emitted once the window no longer ends in an incomplete character.
    `text` is everything so far including anything held back; `flush()` returns what is held back
    at the end of a stream. The concatenation of `add` results plus `flush()` equals
    `tokenizer.decode(all ids)` (when no prompt context is given).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        prompt = list(prompt_ids or [])
        # A few prompt tokens of context make the first generated token decode as it would mid-text.
        self._ids: list[int] = prompt[-6:]
        self._prefix = max(len(self._ids) - 5, 0)
        self._read = len(self._ids)
        self._n_context = len(self._ids)
        self._emitted: list[str] = []
        self.token_ids: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.hf.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text (maybe "")."""
        if not 0 <= token_id < self.tokenizer.vocab_size:
            raise InvalidRequestError(f"token id {token_id} is outside the vocabulary")
        self._ids.append(int(token_id))
        self.token_ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            self._emitted.append(delta)
            return delta
        return ""

    def _pending(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a trailing U+FFFD for truly invalid bytes) at stream end."""
        rest = self._pending()
        if rest:
            self._prefix, self._read = self._read, len(self._ids)
            self._emitted.append(rest)
        return rest

    @property
    def text(self) -> str:
        """All generated text so far, including any not-yet-emitted tail."""
        return "".join(self._emitted) + self._pending()


# ---------------------------------------------------------------------- helpers
def _pick_chat_template(value: Any) -> str | None:
    """tokenizer_config.json holds one template string, or a list of {name, template}; take 'default'."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _post_processor_adds(hf: tokenizers.Tokenizer, bos: str | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (when tokenizer_config.json does not say)."""
    if bos is None:
        return False
    try:
        post = json.loads(hf.to_str()).get("post_processor") or {}
    except Exception:
        return False
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            first = (p.get("single") or [{}])[0]
            return first.get("SpecialToken", {}).get("id") == bos
    return False


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"message {n} must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role is None:
            raise InvalidRequestError(f"message {n} has no 'role' (one of {', '.join(CHAT_ROLES)} is required)")
        if not isinstance(role, str):
            raise InvalidRequestError(f"message {n}: 'role' must be a string, got {role!r} ({type(role).__name__})")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(f"message {n} has unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}")
        if "content" not in m and not m.get("tool_calls"):
            raise InvalidRequestError(f"message {n} (role {role!r}) has no 'content'")
        content = m.get("content")
        if isinstance(content, list):
            # OpenAI-style parts: text-only lists become one string, which every template understands.
            if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                m = dict(m, content="".join(p["text"] for p in content))
            else:
                raise InvalidRequestError(f"message {n}: only text content parts are supported")
        elif content is not None and not isinstance(content, str):
            raise InvalidRequestError(f"message {n}: 'content' must be a string, got {type(content).__name__}")
        elif content is None and not m.get("tool_calls"):
            raise InvalidRequestError(f"message {n} (role {role!r}) has content None and no tool_calls")
        out.append(m)
    return out


def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise InvalidRequestError(f"chat template rejected the messages: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        # HF templates expect tojson without HTML escaping and without forced ASCII.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # trim_blocks/lstrip_blocks match how HF renders templates; immutable sandbox: templates are untrusted.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ModelLoadError(f"the model's chat template does not compile: {e}") from e
