"""Benchmarks: seeded workloads, per-request and aggregate metrics, a driver for several targets."""
from iterserve.bench.metrics import RequestMetrics, Slo, TargetResult, request_metrics, summarize
from iterserve.bench.runner import build_report, format_table, run_bench, run_targets, run_trace
from iterserve.bench.workload import LengthDist, Trace, TraceRequest, make_trace, materialize_prompts

__all__ = ["LengthDist", "RequestMetrics", "Slo", "TargetResult", "Trace", "TraceRequest", "build_report",
           "format_table", "make_trace", "materialize_prompts", "request_metrics", "run_bench", "run_targets",
           "run_trace", "summarize"]
