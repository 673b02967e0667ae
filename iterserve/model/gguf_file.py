"""A GGUF file's parsed header, shared while the file is unchanged: its fields, a tensor's values, the vocabulary."""
from __future__ import annotations

import functools
import os


def _gguf_reader(path: str):
    """Parsing a GGUF header takes seconds (the vocab arrays); config, weights and template share one
    while the file is unchanged (a rewritten file gets a new reader, not the old one's stale mapping)."""
    st = os.stat(path)
    return _gguf_reader_of(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _gguf_reader_of(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader
    return GGUFReader(path)


def forget_gguf_files() -> None:
    """Drop the parsed headers (and the file mappings) once the model is built from them."""
    _gguf_reader_of.cache_clear()


def _gguf_fields(path: str) -> dict:
    reader = _gguf_reader(path)
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            continue  # large arrays the config does not need
        try:
            out[name] = f.contents()
        except Exception:  # noqa: BLE001 - an odd field must not stop loading
            pass
    out["_tensor_names"] = {t.name for t in reader.tensors}
    return out


def _gguf_tensor(path: str, name: str) -> list[float]:
    from gguf.quants import dequantize
    t = next(t for t in _gguf_reader(path).tensors if t.name == name)
    return dequantize(t.data, t.tensor_type).reshape(-1).tolist()


def _gguf_vocab(path: str) -> list:
    return _gguf_reader(path).fields["tokenizer.ggml.tokens"].contents()
