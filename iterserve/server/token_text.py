"""Each token's own bytes and the string a logprobs entry shows for it.

Decoding one token alone turns a piece of a multi-byte character (an emoji is often split over
two or three byte-level tokens) into U+FFFD, so distinct tokens collapsed into one '\ufffd' entry.
Instead the bytes come from the vocabulary itself (byte-level BPE's byte alphabet, or
SentencePiece's <0xNN> byte fallback), and a token that is not whole UTF-8 is shown as OpenAI
shows it: "bytes:\\xf0\\x9f".
"""
from __future__ import annotations

import functools
import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (as transformers' convert_slow_tokenizer
    has it; written out here so that serving does not import transformers)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenText:
    """Per tokenizer: token id -> bytes and display string, cached as asked for."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = type(tokenizer.backend_tokenizer.decoder).__name__ if tokenizer is not None else ""
        self._byte_level = {c: b for b, c in bytes_to_unicode().items()} if decoder == "ByteLevel" else None
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, tuple[bytes, str]] = {}

    def bytes(self, token_id: int) -> bytes:
        return self._entry(token_id)[0]

    def str(self, token_id: int) -> str:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[bytes, str]:
        entry = self._cache.get(token_id)
        if entry is None:
            b = self._bytes(token_id)
            try:
                s = b.decode("utf-8")
            except UnicodeDecodeError:
                s = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            entry = self._cache[token_id] = (b, s)
        return entry

    def _bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return str(token_id).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode()
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word-start mark is a space
