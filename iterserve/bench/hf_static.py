"""The hf-static target: transformers' generate in padded static batches, the traditional framework
this engine is measured against."""
from __future__ import annotations

import time

from iterserve.bench.metrics import RequestMetrics, TargetResult, request_metrics
from iterserve.bench.progress import _progress
from iterserve.bench.workload import Trace, materialize_prompts
from iterserve.outputs import StepRecord
from iterserve.request import RequestTimes


def resolve_dtype(dtype: str, device: str = "auto"):
    """The engine's own rule, so hf-static runs in the dtype the engine runs in (bf16 on a CPU
    with native bf16, float32 on one without)."""
    from iterserve.executor.dtypes import pick_device, pick_dtype
    return pick_dtype(dtype, pick_device(device))


class _StepTimes:
    """A generate() streamer that only timestamps: put() is called once with the prompt, then
    once per generated step with that step's tokens for the whole batch."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def load_hf_model(model_path: str | None, dtype: str):
    from iterserve.model.loader import default_model_path, load_tokenizer, load_transformers_model
    path = model_path or default_model_path()
    return load_transformers_model(path, resolve_dtype(dtype)), load_tokenizer(path)


def run_hf_static(trace: Trace, max_num_seqs: int, model_path: str | None = None, dtype: str = "auto",
                  progress: bool = False, model=None, tokenizer=None) -> TargetResult:
    """The traditional framework: wait for the running batch to end, take up to max_num_seqs
    arrived requests in arrival order, left-pad, generate the batch's longest target for all.

    Timing: generate() is called with a streamer that timestamps each step, so a request's
    token times are the real times its batch produced each of its first output_len tokens. Its
    `finished` is when generate() returns, because that is when a batch framework hands results
    back. TTFT is therefore honest for a caller that could stream; queue time is arrival -> batch
    start. Tokens past a request's target are padding work and are not counted."""
    import torch
    if model is None:
        model, tokenizer = load_hf_model(model_path, dtype)
    if any(r.prompt_token_ids is None for r in trace.requests):
        materialize_prompts(trace, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    order = sorted(trace.requests, key=lambda r: r.arrival_time)
    seats = min(max_num_seqs, trace.concurrency or max_num_seqs)
    bar = _progress(len(order), "hf-static", progress)
    metrics: list[RequestMetrics] = []
    steps: list[StepRecord] = []
    with torch.inference_mode():  # warm up the kernels on a tiny batch, like the engine targets
        model.generate(torch.tensor([order[0].prompt_token_ids[:8]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)
    t0, i = time.monotonic(), 0
    while i < len(order):
        now = time.monotonic() - t0
        if not trace.concurrency and order[i].arrival_time > now:
            time.sleep(order[i].arrival_time - now)
            now = time.monotonic() - t0
        batch = [r for r in order[i:i + seats] if trace.concurrency or r.arrival_time <= now]
        i += len(batch)
        longest_prompt, longest_out = max(r.prompt_len for r in batch), max(r.output_len for r in batch)
        ids = torch.full((len(batch), longest_prompt), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, longest_prompt - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[row, longest_prompt - r.prompt_len:] = 1
        streamer, start = _StepTimes(), time.monotonic()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest_out, min_new_tokens=longest_out,
                           do_sample=False, pad_token_id=pad, streamer=streamer)
        end = time.monotonic()
        token_times = streamer.times[1:]  # [0] is the prompt being handed over
        for r in batch:
            arrival = start if trace.concurrency else t0 + r.arrival_time
            times = RequestTimes(arrival=arrival, first_scheduled=start, first_token=token_times[0],
                                 token_times=token_times[:r.output_len], finished=end)
            metrics.append(request_metrics(r.request_id, r.prompt_len, r.output_len, times, t0))
        prev = start
        for k, t in enumerate(token_times):  # one record per generate step, for the batch plots
            live = [r.request_id for r in batch if r.output_len > k]
            steps.append(StepRecord(prev - t0, t - t0, len(batch), len(order) - i,
                                    len(batch) * (longest_prompt if k == 0 else 1), 0.0,
                                    live if k == 0 else [], [] if k == 0 else live, []))
            prev = t
        bar.update(len(batch))
    bar.close()
    by_id = {m.request_id: m for m in metrics}
    return TargetResult("hf-static", [by_id[r.request_id] for r in trace.requests],
                        max(m.finished for m in metrics), steps, 0,
                        {"max_num_seqs": max_num_seqs, "dtype": str(next(model.parameters()).dtype),
                         "kv_usage_known": False,
                         "timing": "token times from a per-step streamer; finished = when generate() returns"})
