"""The tokenizer of a weight-cache entry (weight_cache.py's top): transformers' GGUF vocabulary
conversion once per file, and beside it what the serving tokenizer reads without transformers."""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from iterserve.model import loader, tokenizer
from iterserve.model.cache_entry import _TOKENIZER, entry_dir

logger = logging.getLogger("iterserve.model")


def load_tokenizer(path: str):
    """loader.load_tokenizer through the cache: transformers' GGUF vocabulary conversion runs once per
    file, and a warm start reads the entry without importing transformers (model/tokenizer.py)."""
    entry = entry_dir(path)
    if entry is None:
        return loader.load_tokenizer(path)
    saved = entry / _TOKENIZER
    if (saved / tokenizer.META).is_file():
        light = _read_serving_tokenizer(saved)
        if light is not None:
            return light
    if saved.is_dir():
        tok = _read_tokenizer(saved)
        if tok is not None:
            _describe(tok, saved)  # an entry from before the serving tokenizer: serve it lightly next time
            return tok
    tok = loader.load_tokenizer(path)
    if not _write_tokenizer(tok, saved):
        return tok
    reread = _read_tokenizer(saved)
    if reread is None:
        return tok
    _describe(reread, saved)
    return _read_serving_tokenizer(saved) or reread


def _read_serving_tokenizer(saved: Path):
    try:
        return tokenizer.ServingTokenizer.from_dir(saved)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception; a broken entry is rebuilt
        logger.warning("weight cache: the tokenizer in %s is unreadable (%s); rebuilding it", saved, exc)
        shutil.rmtree(saved, ignore_errors=True)
        return None


def _describe(tok, saved: Path) -> None:
    """Write what the serving tokenizer needs beside transformers' files, only if it then answers as
    transformers does (tokenizer.same_as); otherwise this entry keeps loading through transformers."""
    meta = tokenizer.describe(tok)
    light = tokenizer.ServingTokenizer(tokenizer.Backend.from_str(tok.backend_tokenizer.to_str()), meta)
    differs = tokenizer.same_as(light, tok)
    if differs is not None:
        logger.warning("weight cache: %s loads through transformers (the light tokenizer differs in %s)",
                       saved, differs)
        return
    tmp = saved / f"{os.getpid()}.tmp"
    try:  # the backend as transformers holds it after loading, then the facts: their presence marks the entry done
        tok.backend_tokenizer.save(str(tmp))
        os.rename(tmp, saved / tokenizer.BACKEND)
        tmp.write_text(json.dumps(meta))
        os.rename(tmp, saved / tokenizer.META)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        logger.warning("weight cache: cannot write %s (%s)", saved / tokenizer.META, exc)


def _read_tokenizer(saved: Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(saved))
    except Exception as exc:  # noqa: BLE001 - a broken entry is rebuilt, never fatal
        logger.warning("weight cache: the tokenizer in %s is unreadable (%s); rebuilding it", saved, exc)
        shutil.rmtree(saved, ignore_errors=True)
        return None


def _write_tokenizer(tok, saved: Path) -> bool:
    tmp = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
    try:
        tok.save_pretrained(str(tmp))
        os.rename(tmp, saved)  # atomic; fails if a concurrent start got there first, whose copy is as good
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if saved.is_dir():
            return True
        logger.warning("weight cache: cannot write %s (%s); this start is not cached", saved, exc)
        return False
    return True
