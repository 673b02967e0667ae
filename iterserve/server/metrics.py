"""Prometheus metrics in the `iterserve:` namespace, named after vLLM's so dashboards carry over.

Updated on the engine thread after every step (prometheus-client is thread-safe); each server
owns its own registry, so several servers in one process (tests) never collide.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from iterserve.engine import Engine
from iterserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


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
        self.batch_size = hist("batch_size", "Requests computed per engine step.", _BATCH_BUCKETS)
        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.step_batch = gauge("batch_size_last_step", "Requests computed in the latest step.")
        self.preemptions = counter("num_preemptions", "Requests preempted (cumulative).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.finished = Counter(p + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}
        self._last_step = 0

    def on_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        """Engine thread: after each step (and after each abort, with just that output)."""
        s = engine.scheduler
        self.num_running.set(s.num_running)
        self.num_waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_usage)
        self._inc(self.preemptions, "preemptions", s.num_preemptions)
        self._inc(self.prefix_queries, "queries", s.kv.num_prefix_queries)
        self._inc(self.prefix_hits, "hits", s.kv.num_prefix_hits)
        if engine.num_steps != self._last_step and engine.step_records:
            self._last_step = engine.num_steps
            rec = engine.step_records[-1]
            n = len(rec.prefill_ids) + len(rec.decode_ids)
            self.batch_size.observe(n)
            self.step_batch.set(n)
        for out in outputs:
            self.generation_tokens.inc(len(out.new_token_ids))
            t = out.times
            if out.new_token_ids and len(out.token_ids) == len(out.new_token_ids) and t.ttft is not None:
                self.ttft.observe(t.ttft)
            elif out.new_token_ids and len(t.token_times) >= 2:
                self.itl.observe(t.token_times[-1] - t.token_times[-2])
            if out.finished:
                self._finished(out)

    def _finished(self, out: RequestOutput) -> None:
        t = out.times
        self.finished.labels(self.model_name, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        if t.e2e is not None:
            self.e2e.observe(t.e2e)
        if t.queue_time is not None:
            self.queue_time.observe(t.queue_time)

    def _inc(self, counter: Counter, key: str, total: int) -> None:
        # The engine keeps running totals; Prometheus counters only go up by deltas.
        delta = total - self._seen[key]
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
