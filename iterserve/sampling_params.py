"""What the user asks of one request's generation: length, randomness, penalties, stops, logprobs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


MAX_N = 64  # most parallel sequences one request may ask for


@dataclass(slots=True, frozen=True)
class StructuredOutputs:
    """One constraint on the output, compiled by xgrammar (executor/structured_output.py).
    Frozen and hashable: it is the key of the compiled-grammar cache."""
    json: str | None = None  # a JSON schema, serialized
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF-style), as xgrammar reads it

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if sum(given) != 1:
            raise ValueError("structured output: give exactly one of json, json_object, regex, choice, grammar")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured output: choice must be a non-empty list of non-empty strings")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N: the sampled token's logprob plus the top N
    n: int = 1
    skip_special_tokens: bool = True
    # vLLM's semantics: presence/frequency subtract from the logits of tokens already generated;
    # repetition divides positive (multiplies negative) logits of tokens in the prompt or output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS, stop token ids and stop strings are ignored until this many tokens
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # None: off; N: each prompt token's logprob plus the top N
    structured_outputs: StructuredOutputs | None = None
    # A prompt-only request (an embedding): its prompt is computed, its final-norm hidden states pooled
    # ("last" token or "mean" over the prompt, L2-normalized) and it ends there, with no token sampled.
    pooling: str | None = None
    # The LoRA adapter the request runs under, by its loaded name (model/lora.py); None: the base model.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be 0 or -1 (off) or a positive integer, got {self.top_k!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s or len(s) > 1024 for s in self.stop):
            raise bad("stop", "must be at most 16 non-empty strings of at most 1024 characters")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not _finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        if self.logit_bias is not None and (len(self.logit_bias) > 1024 or any(
                not _int(t) or t < 0 or not _finite(b) or not -100 <= b <= 100 for t, b in self.logit_bias.items())):
            raise bad("logit_bias", "must map at most 1024 token ids (integers >= 0) to biases in [-100, 100]")
        if not _int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.prompt_logprobs is not None and (not _int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise bad("lora_name", f"must be a non-empty string, got {self.lora_name!r}")
        if self.pooling not in (None, "last", "mean"):
            raise bad("pooling", f"must be 'last' or 'mean', got {self.pooling!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
