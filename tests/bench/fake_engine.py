"""A tiny stand-in for iterserve.engine.Engine on a virtual clock: each step costs a fixed time
plus a little per token, so continuous vs static differ only in scheduling, as in the real one."""
from __future__ import annotations

from types import SimpleNamespace

from iterserve.config import EngineConfig
from iterserve.outputs import RequestOutput, StepRecord
from iterserve.request import RequestTimes
from iterserve.sampling_params import SamplingParams


class VirtualClock:
    def __init__(self) -> None:
        self.t = 100.0  # not zero: the driver must use times relative to its start

    def now(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        assert t >= self.t - 1e-9, (t, self.t)
        self.t = max(self.t, t)


class _Req:
    __slots__ = ("rid", "prompt", "params", "times", "out", "prefilled")

    def __init__(self, rid, prompt, params, times):
        self.rid, self.prompt, self.params, self.times = rid, prompt, params, times
        self.out: list[int] = []
        self.prefilled = False


class FakeEngine:
    def __init__(self, max_num_seqs: int = 4, scheduling: str = "continuous", step_time: float = 0.01,
                 per_token: float = 0.0001) -> None:
        self.vclock = VirtualClock()
        self.clock = self.vclock.now  # a bound method: the driver must find advance_to through it
        self.tokenizer = None
        self.max_num_seqs, self.static = max_num_seqs, scheduling == "static"
        self.step_time, self.per_token = step_time, per_token
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.step_records: list[StepRecord] = []
        self.config = EngineConfig(max_num_seqs=max_num_seqs, scheduling=scheduling)
        self.stats = SimpleNamespace(num_preemptions=0, num_kv_blocks=0)  # the fields the bench reads
        self.executor = SimpleNamespace(kv_cache_spec=SimpleNamespace(dtype="none"))
        self.arrivals: list[tuple[str, float, float]] = []  # (id, arrival_time given, clock when added)

    def add_request(self, prompt, params: SamplingParams, request_id=None, arrival_time=None, priority=0) -> str:
        now = self.clock()
        self.arrivals.append((request_id, arrival_time, now))
        self.waiting.append(_Req(request_id, list(prompt), params, RequestTimes(now if arrival_time is None
                                                                                 else arrival_time)))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        start = self.clock()
        if not self.running or not self.static:
            while self.waiting and len(self.running) < self.max_num_seqs:
                r = self.waiting.pop(0)
                r.times.first_scheduled = start
                self.running.append(r)
        prefill = [r for r in self.running if not r.prefilled]
        decode = [r for r in self.running if r.prefilled and len(r.out) < r.params.max_tokens]
        tokens = sum(len(r.prompt) for r in prefill) + len(decode)
        self.vclock.advance_to(start + self.step_time + self.per_token * tokens)
        now, outputs = self.clock(), []
        for r in prefill + decode:
            r.prefilled = True
            r.out.append(7)
            r.times.token_times.append(now)
            if r.times.first_token is None:
                r.times.first_token = now
            done = len(r.out) >= r.params.max_tokens
            if done:
                r.times.finished = now
            outputs.append(RequestOutput(r.rid, r.prompt, list(r.out), "", [7], "", done,
                                         "length" if done else None, r.times))
        left = [r for r in self.running if len(r.out) < r.params.max_tokens]
        if not self.static or not left:
            self.running = left
        self.step_records.append(StepRecord(start, now, len(self.running), len(self.waiting), tokens, 0.5,
                                            [r.rid for r in prefill], [r.rid for r in decode], []))
        return outputs
