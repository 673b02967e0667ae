"""The serving tokenizer (model/tokenizer.py) answers as transformers' tokenizer does: tokens, text,
special ids and rendered chat prompts, tools included; on the default model through the weight cache,
and on tiny tokenizers built here (BPE with a BOS post-processor, WordPiece with clean-up)."""
from __future__ import annotations

import jinja2
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from iterserve.engine.detokenizer import Detokenizer
from iterserve.model import cache_entry, loader, tokenizer as serving, tokenizer_cache, weight_cache

TEXTS = ["Hello, world!", "  spaces\tand\nnewlines  ", "<|im_start|>user\nhé 漢字 🙂<|im_end|>", "don't . , ? ! it's",
         "", " ", "<|im_end|><|im_end|>", "def f(x):\n    return {'a': x}  # ½ ∑", "<|endoftext|>x<|im_start|>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 🙂"}, {"role": "user", "content": "Again, with <b>html</b> & \"quotes\""}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}],
    [{"role": "user", "content": "Think"}, {"role": "assistant", "content": "42", "reasoning": "hmm"}],
]
# a Hermes-style template that reads tools, with what transformers' environment adds: tojson (no HTML
# escaping), raise_exception, namespace, loop controls, strftime_now, the special tokens as variables
TOOL_TEMPLATE = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>{{ strftime_now('%Y') | length }}
{% endif %}
{%- for m in messages -%}
{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif -%}
{%- if m.role == 'system' and loop.index > 1 %}{% continue %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
<|im_start|>{{ m.role }}
{% if m.content is defined %}{{ m.content }}{% endif %}
{%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{%- for c in m.tool_calls | default([]) %}<tool_call>{{ c.function | tojson(indent=1) }}</tool_call>{% endfor %}
{{ eos_token }}
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant ({{ ns.n }})
{% endif %}"""


def assert_same(light, tok, templates=(None,)) -> None:
    assert type(light) is serving.ServingTokenizer
    for t in TEXTS:
        for add in (True, False):
            assert light.encode(t, add_special_tokens=add) == list(tok.encode(t, add_special_tokens=add)), (t, add)
        ids = list(tok.encode(t))
        for skip in (False, True):
            assert light.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), (t, skip)
        assert light.convert_ids_to_tokens(ids) == tok.convert_ids_to_tokens(ids)
        assert light.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
            tok.convert_ids_to_tokens(ids, skip_special_tokens=True)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "bos_token", "eos_token"):
        assert getattr(light, name) == getattr(tok, name), name
    assert sorted(light.all_special_ids) == sorted(tok.all_special_ids)
    assert len(light) == len(tok) and light.get_vocab() == tok.get_vocab()
    for template in templates:
        for chat in CHATS:
            for tools in (None, TOOLS):
                for gen in (False, True):
                    kw = dict(tools=tools, add_generation_prompt=gen, tokenize=False, chat_template=template)
                    assert render(light, chat, kw) == render(tok, chat, kw), (chat, kw)


def render(tok, chat, kw) -> str:
    """The prompt, or the error's type and message: a template that fails must fail alike."""
    try:
        return tok.apply_chat_template(chat, **kw)
    except jinja2.TemplateError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_the_default_models_serving_tokenizer_is_transformers(default_model_path, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tokenizer)  # the GGUF converted once, by the fixture
    first = weight_cache.load_tokenizer(default_model_path)  # written, then read back light
    again = weight_cache.load_tokenizer(default_model_path)
    assert_same(first, tokenizer, templates=(None, TOOL_TEMPLATE))
    assert_same(again, tokenizer)
    # incremental detokenization reads only the backend: the same text as transformers' decode
    ids = tokenizer.encode(" The café's 🙂 menu:\n- soup", add_special_tokens=False)
    d = Detokenizer(again, tokenizer.encode("<|im_start|>assistant\n"), stop=[])
    for i in ids:
        d.add(i)
    assert d.text == tokenizer.decode(ids)


def test_an_entry_from_before_is_upgraded_in_place(default_model_path, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tokenizer)
    weight_cache.load_tokenizer(default_model_path)
    saved = cache_entry.entry_dir(default_model_path) / "tokenizer"
    (saved / serving.META).unlink()  # as an older iterserve left it: transformers' files only
    assert type(weight_cache.load_tokenizer(default_model_path)) is not serving.ServingTokenizer
    assert type(weight_cache.load_tokenizer(default_model_path)) is serving.ServingTokenizer


def test_a_broken_entry_is_rebuilt(default_model_path, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tokenizer)
    weight_cache.load_tokenizer(default_model_path)
    saved = cache_entry.entry_dir(default_model_path) / "tokenizer"
    (saved / serving.BACKEND).write_text("{not json")
    tok = weight_cache.load_tokenizer(default_model_path)
    assert tok.encode("Hello") == list(tokenizer.encode("Hello"))
    assert type(weight_cache.load_tokenizer(default_model_path)) is serving.ServingTokenizer


def test_template_errors_are_jinjas_as_in_transformers(default_model_path, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tokenizer)
    weight_cache.load_tokenizer(default_model_path)
    light = weight_cache.load_tokenizer(default_model_path)
    bad = [{"role": "narrator", "content": "x"}]
    for tok in (light, tokenizer):
        with pytest.raises(jinja2.TemplateError, match="bad role narrator"):
            tok.apply_chat_template(bad, chat_template=TOOL_TEMPLATE, tokenize=False)
        with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox: no dunder attributes
            tok.apply_chat_template(CHATS[0], chat_template="{{ messages.__class__.__name__ }}", tokenize=False)
    with pytest.raises(ValueError):
        light.apply_chat_template([], tokenize=False)


# ---------------------------------------------------------------- tiny tokenizers built here

def _bpe_llama_style():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz▁,.!'")}}
    vocab |= {"▁h": 40, "he": 41, "ll": 42, "▁he": 43}
    merges = [("▁", "h"), ("h", "e"), ("l", "l"), ("▁h", "e")]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return backend, dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _wordpiece_with_cleanup():
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", ",", ".", "!", "?", "'", "s", "it", "don", "t", "n"]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return backend, dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                         eos_token="[SEP]", clean_up_tokenization_spaces=True)


@pytest.mark.parametrize("build", [_bpe_llama_style, _wordpiece_with_cleanup])
def test_tiny_tokenizers_served_as_transformers(build, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    backend, special = build()
    PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=TOOL_TEMPLATE, **special).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)  # as the weight cache reads an entry back
    tokenizer_cache._describe(tok, tmp_path)
    light = serving.ServingTokenizer.from_dir(tmp_path)
    assert light.clean_up_tokenization_spaces == ("clean_up_tokenization_spaces" in special)
    assert_same(light, tok)
    assert light.as_transformers().encode("hello, world") == tok.encode("hello, world")  # xgrammar's view of it
