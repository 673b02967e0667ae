"""Incremental detokenization and stop strings for one request.

tokenizers' DecodeStream never emits half a multi-byte character. Text that might be the start
of a stop string is held back until it is known not to be one, so a stream never shows it.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 4  # prompt tokens fed first, so the first output token keeps its leading space


class Detokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=prompt_token_ids[-_PRIME_TOKENS:],
                                    skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_emitted = 0  # characters of self.text already handed out

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string if the text now contains one (text cut before it,
        or after it with include_stop). check_stop False: min_tokens not reached yet."""
        chunk = self._stream.step(self._backend, token_id)
        if not chunk or not check_stop:
            self.text += chunk or ""
            return None
        start = max(0, len(self.text) - self._hold)
        self.text += chunk
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1:
                self.text = self.text[:at + len(s) if self.include_stop else at]
                return s
        return None

    def take_new_text(self, finished: bool) -> str:
        """The text not handed out yet, minus a tail that might still become a stop string."""
        end = len(self.text) if finished or not self.stop else max(self.num_emitted, len(self.text) - self._hold)
        new = self.text[self.num_emitted:end]
        self.num_emitted = end
        return new
