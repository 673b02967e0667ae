"""Where the weight cache's entries live (weight_cache.py's top describes one) and the key of a model
file's entry: what its cached bytes depend on."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from importlib import metadata
from pathlib import Path

from iterserve.model.cpu_build import cache_dir

logger = logging.getLogger("iterserve.model")

FORMAT = 5  # bump when what an entry holds changes (2: q/k/v and gate/up fused; 3, 4: int8, int4 panels in
# pairs; 5: int8/int4 from a quantized GGUF's codes, native.safetensors, torch's int8/int4 layouts)
_EDGE = 1 << 20  # bytes hashed at each end of the model file
_WEIGHTS, _NATIVE, _TABLE, _TOKENIZER = "model.safetensors", "native.safetensors", "tensors.json", "tokenizer"


def cache_root() -> Path | None:
    """Where entries live, or None when the cache is off or cannot be made."""
    value = os.environ.get("ITERSERVE_WEIGHT_CACHE", "")
    if value == "0":
        return None
    root = Path(value) if value else cache_dir() / "weights"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.warning("weight cache off: cannot make %s (%s)", root, exc)
        return None
    return root


def file_key(path: str) -> str:
    """What the cached bytes depend on: the file (cheaply: size, mtime, both ends) and the code that reads it."""
    st = os.stat(path)
    versions = [_version(p) for p in ("gguf", "transformers", "tokenizers")]
    h = hashlib.sha256(repr((FORMAT, st.st_size, st.st_mtime_ns, versions)).encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        f.seek(max(0, st.st_size - _EDGE))
        h.update(f.read(_EDGE))
    return h.hexdigest()[:16]


@functools.cache
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def entry_dir(path: str) -> Path | None:
    """This model file's entry (made on first use), or None when the file is not cached."""
    root = cache_root()
    if root is None or not _cacheable(path):
        return None
    entry = root / f"{_entry_prefix(path)}{file_key(path)}"
    try:
        entry.mkdir(exist_ok=True)
    except OSError as exc:
        logger.warning("weight cache off for %s: %s", path, exc)
        return None
    return entry


def _cacheable(path: str) -> bool:
    """GGUF files only: a Hugging Face directory's safetensors are read with mmap as they are."""
    return os.path.isfile(path) and path.endswith(".gguf")


def _entry_prefix(path: str) -> str:
    where = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:8]
    return f"{Path(path).stem}-{where}-"
