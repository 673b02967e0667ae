"""The serving tokenizer without transformers: the `tokenizers` backend plus the few facts transformers
adds on top of it (special tokens, clean-up, the chat template), rendered with jinja2 as transformers does.

Importing transformers costs a second or more of a server's start, and everything the serving path
asks of a tokenizer (encode, decode, incremental detokenization, special and EOS ids, the chat
template with tools) is the Rust backend plus a Jinja render. The facts come from a transformers
tokenizer once, when the weight cache writes its entry (`describe`), and are kept beside the
backend's tokenizer.json; the entry is used only if this class then gives the same answers as
transformers on a set of probes (`same_as`), so what a warm start serves is what transformers would.

Anything beyond that (xgrammar's TokenizerInfo wants a transformers tokenizer) goes through
`as_transformers()`, which loads transformers' own tokenizer from the same directory on first use.
"""
from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

META = "serving.json"  # the facts below, beside transformers' save_pretrained files
BACKEND = "serving-tokenizer.json"  # the backend as transformers holds it once loaded
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers aliases these for templates


class ServingTokenizer:
    """The subset of transformers' tokenizer API that iterserve uses, with the same results."""

    def __init__(self, backend: Backend, meta: dict, source: str | None = None) -> None:
        backend.no_padding()  # transformers resets both before every plain encode
        backend.no_truncation()
        backend.encode_special_tokens = bool(meta.get("split_special_tokens", False))
        self._backend = backend
        self.special_tokens_map: dict[str, Any] = dict(meta["special_tokens_map"])
        self.chat_template: str | dict | None = meta.get("chat_template")
        self.all_special_ids: list[int] = list(meta["all_special_ids"])
        self.all_special_tokens: list[str] = list(meta["all_special_tokens"])
        self.clean_up_tokenization_spaces = bool(meta.get("clean_up_tokenization_spaces", False))
        for name in ("bos", "eos", "pad", "unk"):
            setattr(self, f"{name}_token", meta.get(f"{name}_token"))
            setattr(self, f"{name}_token_id", meta.get(f"{name}_token_id"))
        self._source = source
        self._hf = None
        self._hf_lock = threading.Lock()

    def __getstate__(self) -> dict:  # Ray ships the tokenizer to its replicas: no lock, no transformers copy
        return {k: v for k, v in self.__dict__.items() if k not in ("_hf", "_hf_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _hf=None, _hf_lock=threading.Lock())

    @classmethod
    def from_dir(cls, directory: str | Path) -> ServingTokenizer:
        """A directory holding BACKEND and META (and transformers' files, for as_transformers)."""
        d = Path(directory)
        meta = json.loads((d / META).read_text())
        return cls(Backend.from_file(str(d / BACKEND)), meta, str(d))

    # ---- the transformers API used by the engine and the server
    @property
    def backend_tokenizer(self) -> Backend:
        return self._backend

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self._backend.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs):
        """transformers' apply_chat_template for one conversation: the text, or (tokenize) its ids."""
        template = self._pick_template(chat_template, tools)
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if tools is not None and not all(isinstance(t, dict) for t in tools):
            raise ValueError("Tools should be JSON schemas (dicts) here")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        messages = [{k: v for k, v in _plain(m).items() if v is not None} if isinstance(m, Mapping) else m
                    for m in conversation]
        for m in messages:
            if not isinstance(m, dict):
                raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r}.")
        text = _compile(template).render(
            messages=[_alias_reasoning(m) for m in messages], tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **_plain({**self.special_tokens_map, **kwargs}))
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _pick_template(self, chat_template: str | None, tools) -> str:
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError(f"This model has multiple chat templates with no default specified: {sorted(own)}")
        template = chat_template or own
        if template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        return template

    def as_transformers(self):
        """transformers' own tokenizer of the same files (xgrammar wants one), loaded on first use."""
        with self._hf_lock:
            if self._hf is None:
                if self._source is None:
                    raise ValueError("this tokenizer was not loaded from a directory")
                from transformers import AutoTokenizer
                self._hf = AutoTokenizer.from_pretrained(self._source)
                if self.chat_template is not None:
                    self._hf.chat_template = self.chat_template
        return self._hf


# ---------------------------------------------------------------- written once, from transformers

def describe(tok) -> dict:
    """What ServingTokenizer needs from a transformers tokenizer, as JSON."""
    cleanup = bool(getattr(tok, "clean_up_tokenization_spaces", False))
    if cleanup and type(tok.backend_tokenizer.model).__name__ == "BPE" and not getattr(
            tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False):
        cleanup = False  # transformers skips it for BPE (with a warning)
    meta = {"special_tokens_map": {k: str(v) if not isinstance(v, list) else [str(x) for x in v]
                                   for k, v in tok.special_tokens_map.items()},
            "chat_template": tok.chat_template, "all_special_ids": list(tok.all_special_ids),
            "all_special_tokens": [str(t) for t in tok.all_special_tokens], "clean_up_tokenization_spaces": cleanup,
            "split_special_tokens": bool(getattr(tok, "split_special_tokens", False))}
    for name in ("bos", "eos", "pad", "unk"):
        token = getattr(tok, f"{name}_token", None)
        meta[f"{name}_token"] = None if token is None else str(token)
        meta[f"{name}_token_id"] = getattr(tok, f"{name}_token_id", None)
    return meta


_PROBE_TEXTS = ["Hello, world!", "  leading spaces and\ttabs\nnew lines\r\n", "naïve café — 東京 🙂 ½",
                "don't stop . , ? ! it's", "def f(x):\n    return x ** 2  # comment"]


def same_as(light: ServingTokenizer, tok) -> str | None:
    """None when `light` answers as transformers' `tok` does on the probes; else what differs."""
    specials = " ".join(dict.fromkeys(light.all_special_tokens))
    texts = _PROBE_TEXTS + [f"{specials} between {specials}"]
    for t in texts:
        for add in (True, False):
            if light.encode(t, add_special_tokens=add) != list(tok.encode(t, add_special_tokens=add)):
                return f"encode({t!r}, add_special_tokens={add})"
        ids = list(tok.encode(t))
        for skip in (False, True):
            if light.decode(ids, skip_special_tokens=skip) != tok.decode(ids, skip_special_tokens=skip):
                return f"decode of {t!r} (skip_special_tokens={skip})"
    if len(light) != len(tok) or light.eos_token_id != tok.eos_token_id or light.bos_token_id != tok.bos_token_id:
        return "length or special ids"
    if light.chat_template is not None and not isinstance(light.chat_template, dict):
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[2]},
                {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Again?"}]
        try:
            theirs = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that fails in transformers fails the same way here
            return None
        if light.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) != theirs:
            return "the chat template's render"
    return None


# ---------------------------------------------------------------- as transformers renders a template

def _clean_up(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _plain(value: Any) -> Any:
    """What the template may see: plain JSON-like data (transformers' _plain_template_data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    """transformers' sandboxed environment: the same options, globals and tojson filter."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %} marks assistant text for masks; rendering keeps the body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 - jinja's Namespace signature, so namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(template)
