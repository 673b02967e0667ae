"""Prometheus metrics in the `iterserve:` namespace, named after vLLM's and with vLLM's meanings, so
dashboards carry over (docs/operations.md lists them). A request with n > 1 sequences counts once:
one success, one TTFT / e2e / queue observation, its prompt once; its generated tokens are all of
its sequences'.

Updated on the engine thread after every step (prometheus-client is thread-safe); each server
owns its own registry, so several servers in one process (tests) never collide.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from iterserve.engine.stats import EngineStats
from iterserve.outputs import RequestOutput
from iterserve.request import RequestTimes

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's
_LENGTH_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000


@dataclass(slots=True)
class _Request:
    """What a finished request reports: one sequence's, or an n > 1 request's over all its sequences."""

    times: RequestTimes
    prompt_tokens: int
    generation_tokens: int
    finish_reason: str
    longest: int  # tokens of its longest sequence (its decode ran that many steps)
    remaining: int = 1  # sequences still running (n > 1)

    def merge(self, out: RequestOutput) -> None:
        """Another sequence of the same request finished: the request ends when its last one does."""
        t, o = self.times, out.times
        self.times = RequestTimes(t.arrival, _min(t.first_scheduled, o.first_scheduled),
                                  _min(t.first_token, o.first_token),
                                  max(t.token_times, o.token_times, key=lambda x: x[-1] if x else float("-inf")),
                                  finished=max(t.finished or 0.0, o.finished or 0.0))
        self.generation_tokens += len(out.token_ids)
        self.longest = max(self.longest, len(out.token_ids))
        if self.finish_reason not in ("error", "abort"):  # a failed sequence fails the request
            self.finish_reason = out.finish_reason or "unknown"
        self.remaining -= 1


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        p = "iterserve:"

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS) -> Histogram:
            return Histogram(p + name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(p + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:  # prometheus-client appends _total
            return Counter(p + name, doc, labels, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first output token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to finish.")
        self.queue_time = hist("request_queue_time_seconds", "Time from arrival to first scheduled.")
        self.prefill_time = hist("request_prefill_time_seconds", "Time from first scheduled to the first token.")
        self.decode_time = hist("request_decode_time_seconds", "Time from the first token to the last.")
        self.inference_time = hist("request_inference_time_seconds", "Time from first scheduled to the last token.")
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Per request: decode time / (generated tokens - 1).")
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per finished request.",
                                          _LENGTH_BUCKETS)
        self.request_generation_tokens = hist("request_generation_tokens",
                                              "Generated tokens per finished request (all its sequences).",
                                              _LENGTH_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed per engine step.", _STEP_TOKEN_BUCKETS)
        self.batch_size = hist("batch_size", "Requests computed per engine step.", _BATCH_BUCKETS)
        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (recompute-preempted "
                                 "ones included).")
        self.num_swapped = gauge("num_requests_swapped", "Requests swapped out to the host KV pool.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.step_batch = gauge("batch_size_last_step", "Requests computed in the latest step.")
        self.preemptions = counter("num_preemptions", "Requests preempted (cumulative).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Requests' steps that carried draft tokens "
                                   "(speculative decoding).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.finished = Counter(p + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.diagnostic = Gauge(p + "diagnostic", "1 while a capacity diagnostic holds (GET /v1/diagnostics).",
                                ["model_name", "kind"], registry=r)
        self._cache_info = Gauge(p + "cache_config_info", "The KV cache configuration (labels; value 1).",
                                 ["model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype",
                                  "enable_prefix_caching", "watermark"], registry=r)
        # process_* (memory, CPU, open fds), python_info and python_gc_*, as the default registry has them
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.model_name = model_name
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0}
        self._last_step = 0
        self._parents: dict[str, _Request] = {}  # n > 1 requests with sequences still running
        self._first_token_seen: set[str] = set()  # n > 1 requests whose TTFT is counted

    def set_cache_config(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, cache_dtype: str,
                         enable_prefix_caching: bool, watermark: float) -> None:
        self._cache_info.labels(self.model_name, str(block_size), str(num_gpu_blocks), str(num_cpu_blocks),
                                cache_dtype, str(enable_prefix_caching), str(watermark)).set(1)

    def set_diagnostics(self, kinds) -> None:
        """The active diagnostics' kinds: 1 for each, 0 for every other known kind."""
        from iterserve.engine.diagnostics import KINDS
        for kind in KINDS:
            self.diagnostic.labels(self.model_name, kind).set(1 if kind in kinds else 0)

    def on_step(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        """Engine thread: after each step (and after each abort, with just that output)."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_usage)
        self._inc(self.preemptions, "preemptions", stats.num_preemptions)
        self._inc(self.prefix_queries, "queries", stats.num_prefix_queries)
        self._inc(self.prefix_hits, "hits", stats.num_prefix_hits)
        self._inc(self.spec_drafts, "drafts", stats.num_spec_drafts)
        self._inc(self.spec_draft_tokens, "draft_tokens", stats.num_spec_draft_tokens)
        self._inc(self.spec_accepted_tokens, "accepted", stats.num_spec_accepted_tokens)
        if stats.num_steps != self._last_step and stats.last_step is not None:
            self._last_step = stats.num_steps
            rec = stats.last_step
            n = len(rec.prefill_ids) + len(rec.decode_ids)
            self.batch_size.observe(n)
            self.step_batch.set(n)
            self.iteration_tokens.observe(rec.num_batched_tokens)
        for out in outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            t = out.times
            if out.new_token_ids and len(out.token_ids) == len(out.new_token_ids) and t.ttft is not None:
                if out.n == 1:
                    self.ttft.observe(t.ttft)
                elif out.parent_id not in self._first_token_seen:  # the request's first token, of any sequence
                    self._first_token_seen.add(out.parent_id)
                    self.ttft.observe(t.ttft)
            elif out.new_token_ids and len(t.token_times) > len(out.new_token_ids):
                # the gap since the sequence's previous step (a speculative step brings several tokens at once)
                self.itl.observe(t.token_times[-1] - t.token_times[-1 - len(out.new_token_ids)])
            if out.finished:
                self._sequence_finished(out)

    def _sequence_finished(self, out: RequestOutput) -> None:
        done = _Request(out.times, out.num_prompt_tokens, len(out.token_ids), out.finish_reason or "unknown",
                        len(out.token_ids))
        if out.n > 1:
            parent = self._parents.get(out.parent_id)
            if parent is None:
                done.remaining = out.n - 1
                self._parents[out.parent_id] = parent = done
            else:
                parent.merge(out)
            if parent.remaining > 0:
                return
            del self._parents[out.parent_id]
            self._first_token_seen.discard(out.parent_id)
            done = parent
        self._finished(done)

    def _finished(self, r: _Request) -> None:
        """Once per request, whatever its n: vLLM's per-request histograms."""
        t = r.times
        self.finished.labels(self.model_name, r.finish_reason).inc()
        self.prompt_tokens.inc(r.prompt_tokens)
        self.request_prompt_tokens.observe(r.prompt_tokens)
        self.request_generation_tokens.observe(r.generation_tokens)
        if t.e2e is not None:
            self.e2e.observe(t.e2e)
        if t.queue_time is not None:
            self.queue_time.observe(t.queue_time)
        last = t.token_times[-1] if t.token_times else None
        if t.first_scheduled is not None and t.first_token is not None:
            self.prefill_time.observe(t.first_token - t.first_scheduled)
            self.inference_time.observe(last - t.first_scheduled)
            self.decode_time.observe(last - t.first_token)
            if r.longest > 1:
                self.request_tpot.observe((last - t.first_token) / (r.longest - 1))

    def _inc(self, counter: Counter, key: str, total: int) -> None:
        # The engine keeps running totals; Prometheus counters only go up by deltas.
        delta = total - self._seen[key]
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RelayMetrics:
    """TTFT, ITL and e2e latency measured where a front end relays each request's outputs to its client
    (the Ray ingress), labelled with the replica that served the request. Measured there rather than
    taken from the replicas' own clocks, so they include what the client pays on top of the engine:
    routing, a retry after a replica died before the first output, and the hop from the replica."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "replica"]

        def hist(name: str, doc: str) -> Histogram:
            return Histogram("iterserve:" + name, doc, labels, registry=r, buckets=_LATENCY_BUCKETS)

        self.ttft = hist("time_to_first_token_seconds", "Time from the ingress taking the request to its first "
                         "output token reaching the ingress.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output deltas of one sequence, "
                        "as the ingress relays them.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from the ingress taking the request to its end.")
        self.finished = Counter("iterserve:request_success", "Ended requests by finish reason.",
                                ["model_name", "replica", "finished_reason"], registry=r)

    def timer(self, replica: str, arrival: float) -> "RelayTimer":
        return RelayTimer(self, replica, arrival)


@dataclass(slots=True)
class RelayTimer:
    """One request's latencies, from the monotonic times its outputs reach the relay."""

    metrics: RelayMetrics
    replica: str
    arrival: float
    first_token: float | None = None
    last: dict[int, float] = field(default_factory=dict)  # sequence index -> when its latest delta came
    finish_reason: str | None = None
    ended: bool = False

    def on_output(self, out: RequestOutput, now: float) -> None:
        if out.new_token_ids:
            if self.first_token is None:  # the request's first token, of any of its n sequences
                self.first_token = now
                self.metrics.ttft.labels(self.metrics.model_name, self.replica).observe(now - self.arrival)
            elif out.index in self.last:
                self.metrics.itl.labels(self.metrics.model_name, self.replica).observe(now - self.last[out.index])
            self.last[out.index] = now
        if out.finished and self.finish_reason not in ("error", "abort"):  # a failed sequence fails the request
            self.finish_reason = out.finish_reason or "unknown"

    def on_end(self, now: float, reason: str | None = None) -> None:
        """Once: the stream ended (`reason` overrides what the outputs said: the replica died, the client left)."""
        if self.ended:
            return
        self.ended = True
        m = self.metrics
        m.e2e.labels(m.model_name, self.replica).observe(now - self.arrival)
        m.finished.labels(m.model_name, self.replica, reason or self.finish_reason or "unknown").inc()
