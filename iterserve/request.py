"""One request's state: its tokens, how many are in the KV cache, and its life's timestamps."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from iterserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute: blocks freed, back in the waiting queue
    SWAPPED = "swapped"  # swap: blocks copied to the host pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    # Members are singletons, so identity is Enum's own equality; hashing it in C keeps the status
    # checks of every request in every step (`status in _FINISHED`) off Enum's Python-level __hash__.
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})


@dataclass(slots=True)
class RequestTimes:
    """Monotonic timestamps (seconds) of every transition; all latency metrics derive from these."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    preempted: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1), as vLLM's benchmark defines it."""
        if self.finished is None or self.first_token is None or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.first_token) / (len(self.token_times) - 1)

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    times: RequestTimes
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output, grows by one per decode
    output_token_ids: list[int] = field(default_factory=list)  # the output alone, appended alongside
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    arrival_seq: int = 0  # tie-breaker for FCFS order, set by the scheduler
    stop_reason: int | str | None = None
    # Chained prefix hashes of its full blocks (kv/), each computed once: a full block's tokens never
    # change after it is hashed, and prefix lookups, promises, registration and the P/D hand-off all
    # read this list (the only copy: the KV manager keeps just how many of them it has registered).
    block_hashes: list[bytes] = field(default_factory=list)
    pooled: list[float] | None = None  # a pooling request's embedding, set when its prompt is done

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def prefix_salt(self) -> str | None:
        """What salts its prefix hashes: the cache salt and the LoRA adapter, so the same prompt under two
        adapters (whose K/V differ) never shares a block. An adapter's salt starts with a NUL, which no
        cache salt holds (Engine.add_request), and carries the name's length: no two pairs meet."""
        lora = self.sampling_params.lora_name
        return self.cache_salt if lora is None else f"\0lora:{len(lora)}:{lora}{self.cache_salt or ''}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    @property
    def prompt_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status in _FINISHED
