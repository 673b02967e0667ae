"""`iterserve calibrate`: measure this machine and fit the simulator's `cpu-local` profile.

Four measurements, each a few seconds:
1. matmul throughput (float32 and bfloat16 GEMMs): the peak FLOP/s the roofline divides by;
2. memory bandwidth (a large tensor summed): the bytes/s the roofline divides by;
3. real step times of the loaded model (ModelRunner.execute on hand-made plans: decode at a few
   batch sizes and contexts, prefill at a few lengths);
4. the engine's host work per step (schedule, update, detokenize) with a zero-cost executor.

Then the efficiency factors are fitted to (3) by a grid search over (memory, linear, attention)
efficiency with the overheads solved by least squares for each point, minimising squared
relative error; (4) is added to the fixed and per-request overheads. The profile is JSON.
"""
from __future__ import annotations


import argparse
import contextlib
import itertools
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from iterserve.config import CPU_KV_CACHE_MEMORY, EngineConfig
from iterserve.entrypoints.args import HelpFormatter, fail
from iterserve.kv.spec import KVCacheSpec, num_blocks_for
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput, StepResult
from iterserve.sim.cost_model import CostModel
from iterserve.sim.hardware import HardwareSpec, default_cpu_profile_path
from iterserve.sim.model_spec import ModelSpec

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


# ---------------------------------------------------------------- microbenchmarks

def _best_time(fn, reps: int) -> float:
    fn()  # warm-up: allocation, thread pool, kernel selection
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_matmul(dtype_name: str, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of an n x n GEMM; best of reps, since other processes share the cores."""
    import torch
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b), reps)


def measure_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes/s streaming a tensor far larger than the last-level cache."""
    import torch
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    return x.numel() * 4 / _best_time(lambda: x.sum(), reps)


# ---------------------------------------------------------------- real step times

def fill_pool(runner) -> None:
    """Values in every block of the pool: the hand-made plans read context no prompt pass wrote, and
    unwritten pages of the (private, anonymous) pool all read as one zero page, which stays in cache."""
    runner.kv_cache.normal_(0, 0.1)


def _decode_plan(batch: int, context: int, block_size: int, first_block: int = 0) -> SchedulerOutput:
    """`batch` requests, each decoding its token number `context`, on disjoint blocks."""
    per = -(-context // block_size)
    reqs = [ScheduledRequest(f"c{i}", [100 + i], context - 1,
                             list(range(first_block + i * per, first_block + (i + 1) * per)), True, GREEDY, 1)
            for i in range(batch)]
    return SchedulerOutput(reqs, block_size)


def _prefill_plan(batch: int, length: int, block_size: int, cached: int = 0, first_block: int = 0) -> SchedulerOutput:
    """`batch` prompt chunks of `length` tokens, each after `cached` tokens already in the cache
    (a prefix-cache hit or an earlier chunk): its attention reads them through the block table."""
    per = -(-(cached + length) // block_size)
    reqs = [ScheduledRequest(f"p{i}", [(7 * j + i) % 1000 + 10 for j in range(length)], cached,
                             list(range(first_block + i * per, first_block + (i + 1) * per)), True, GREEDY, 0)
            for i in range(batch)]
    return SchedulerOutput(reqs, block_size)


def _plan(point: tuple, block_size: int) -> SchedulerOutput:
    """A point's step: decode rows, prompt chunks, or (mixed) the decode rows then the chunks, as the
    scheduler orders a step that continues running requests and starts prompts."""
    kind, batch, length, cached = point[:4]
    if kind == "decode":
        return _decode_plan(batch, length, block_size)
    if kind == "prefill":
        return _prefill_plan(batch, length, block_size, cached)
    decode = _decode_plan(batch, length, block_size)
    first = batch * -(-length // block_size)
    chunks, chunk, chunk_cached = point[4]
    prompt = _prefill_plan(chunks, chunk, block_size, chunk_cached, first_block=first)
    return SchedulerOutput(decode.scheduled + prompt.scheduled, block_size)


def _point_blocks(point: tuple) -> int:
    kind, batch, length, cached = point[:4]
    blocks = batch * -(-(length + cached) // 16)
    return blocks + (point[4][0] * -(-(point[4][1] + point[4][2]) // 16) if kind == "mixed" else 0)


def parse_points(spec: str) -> list[tuple]:
    """`decode:16:1024,prefill:1:64@1024,mixed:16:100+512@1024` -> [(kind, batch, length, cached)], a mixed
    point (B decode rows at context C plus one chunk of LEN after CACHED) as ("mixed", B, C, 0, (1, LEN, CACHED));
    ValueError names a bad one."""
    points = []
    usage = "use decode:BATCH:CONTEXT, prefill:BATCH:LENGTH[@CACHED] or mixed:BATCH:CONTEXT+LENGTH[@CACHED]"
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, rest = item.partition(":")
        batch, _, length = rest.partition(":")
        context, _, chunk = length.partition("+")  # mixed: the decodes' context, then the chunk
        if kind == "prefill":
            chunk = length
        chunk, _, cached = chunk.partition("@")
        try:
            if kind == "decode":
                point = (kind, int(batch), int(length), 0)
            elif kind == "prefill":
                point = (kind, int(batch), int(chunk), int(cached or 0))
            else:
                point = (kind, int(batch), int(context), 0, (1, int(chunk), int(cached or 0)))
        except ValueError:
            point = None
        if kind not in ("decode", "prefill", "mixed") or point is None or min(point[1:3]) < 1 or point[3] < 0 \
                or kind == "mixed" and (point[4][1] < 2 or point[4][2] < 0):
            raise ValueError(f"bad point {item!r}: {usage}")
        points.append(point)
    if not points:
        raise ValueError("--points lists no point")
    return points


def measure_steps(runner, points: list[tuple], reps: int) -> list[dict]:
    """Median wall time of runner.execute for each (kind, batch, length, cached) point."""
    rows = []
    for point in points:
        kind, batch, length, cached = point[:4]
        plan = _plan(point, runner.block_size)
        runner.execute(plan)  # warm-up
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            runner.execute(plan)
            times.append(time.perf_counter() - t)
        q = [len(s.token_ids) for s in plan.scheduled]
        rows.append({"kind": kind, "batch": batch, "length": length, "cached": cached, "q_lens": q,
                     "ctx_lens": [s.start_pos + len(s.token_ids) for s in plan.scheduled],
                     "measured_s": statistics.median(times)})
        if kind == "mixed":
            rows[-1]["chunk"], rows[-1]["chunk_cached"] = point[4][1], point[4][2]
        ms = rows[-1]["measured_s"] * 1e3
        print(f"  {kind:<7} batch {batch:>3} len {_point_label(rows[-1]):>14}: {ms:8.1f} ms", flush=True)
    return rows


def measure_kv_handoff(runner, tokens: int = 2048, reps: int = 3) -> tuple[float, float]:
    """(send, receive) bytes/s of a P/D hand-off of a `tokens`-token prompt through the same-host
    transport, as two engines pay it: this process reads the blocks (read_blocks) and sends them
    (ShmConnector.send, the copy into a new shared-memory segment); a second process receives each
    and writes it as write_blocks does into blocks of a pool of its own that were never written: a
    decode engine's pool is committed as its blocks are first used, and a run of minutes writes
    mostly such blocks (blocks written before take about a third of the time). Best of reps, like
    the other microbenchmarks."""
    import torch.multiprocessing as mp

    from iterserve.kv_transfer.shm_connector import ShmConnector
    block_ids = list(range(-(-tokens // runner.block_size)))
    ctx = mp.get_context("spawn")
    connector, timings = ShmConnector(ctx.Queue()), ctx.Queue()
    receiver = ctx.Process(target=_handoff_receiver, args=(connector.queue, timings, reps + 1), daemon=True)
    receiver.start()
    try:
        send_s, receive_s = float("inf"), float("inf")
        for _ in range(reps + 1):  # the first round warms up (and waits for the receiver to start)
            t0 = time.perf_counter()
            blocks = runner.read_blocks(block_ids)
            connector.send("calibrate", blocks, [], None)
            send_s = min(send_s, time.perf_counter() - t0)
            receive_s = min(receive_s, timings.get(timeout=300))
        nbytes = blocks.nbytes
    finally:
        receiver.join(30)
        if receiver.is_alive():
            receiver.kill()
        connector.close()
    return nbytes / send_s, nbytes / receive_s


def _handoff_receiver(queue, timings, rounds: int) -> None:
    """measure_kv_handoff's decode side: receive, write into fresh blocks of a pool, report the seconds that took."""
    import torch

    from iterserve.executor.model_runner import lazy_zeros, scatter_blocks
    from iterserve.kv_transfer.shm_connector import ShmConnector
    torch.set_num_threads(1)
    connector, pool = ShmConnector(queue), None
    for r in range(rounds):
        transfer = connector.receive(timeout=300)
        t0 = time.perf_counter()
        blocks = transfer.blocks
        n = blocks.shape[2]
        if pool is None:  # an engine's pool of the same layout, with fresh blocks for every round
            pool = lazy_zeros((*blocks.shape[:2], n * rounds, *blocks.shape[3:]), blocks.dtype)
        scatter_blocks(pool, range(r * n, (r + 1) * n), blocks)
        timings.put(time.perf_counter() - t0)


def _point_label(row: dict) -> str:
    """length[@cached]; a mixed step: context+chunk[@cached]."""
    if row["kind"] == "mixed":
        return f"{row['length']}+{row['chunk']}" + (f"@{row['chunk_cached']}" if row["chunk_cached"] else "")
    return f"{row['length']}@{row['cached']}" if row.get("cached") else str(row["length"])


class _NullExecutor:
    """No model: the engine's own host work (schedule, update, detokenize) is all that is timed."""

    eos_token_ids = frozenset()
    vocab_size = None

    def __init__(self, tokenizer, num_kv_blocks: int, max_model_len: int, token_id: int):
        self.tokenizer, self.max_model_len, self.token_id = tokenizer, max_model_len, token_id
        # Shapes are placeholders: nothing is allocated, only the block count matters to the scheduler.
        self.kv_cache_spec = KVCacheSpec(16, num_kv_blocks, 0, 1, 1, 1, "bfloat16")
        self.batches: list[int] = []
        self.ends: list[float] = []
        self.starts: list[float] = []

    def execute(self, plan: SchedulerOutput) -> StepResult:
        self.starts.append(time.perf_counter())
        self.batches.append(len(plan.scheduled))
        out = StepResult([self.token_id if s.sample else -1 for s in plan.scheduled])
        self.ends.append(time.perf_counter())
        return out

    def shutdown(self) -> None:
        """Nothing to release."""


def measure_host_overhead(tokenizer, batch_sizes: list[int], steps: int = 40) -> tuple[float, float]:
    """(seconds per step, seconds per request per step) of the engine around the executor:
    the gap between one execute's end and the next one's start, fitted linearly in batch size."""
    from iterserve.engine.engine import Engine
    token = (tokenizer.encode(" the", add_special_tokens=False) or [100])[-1] if tokenizer else 100
    xs, ys = [], []
    for b in batch_sizes:
        ex = _NullExecutor(tokenizer, 4096, 4096, token)
        engine = Engine(EngineConfig(max_num_seqs=b, num_kv_blocks=4096), executor=ex)
        for i in range(b):
            engine.add_request([100 + (i * 13 + j) % 500 for j in range(64)],
                               SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        for k in range(2, len(ex.starts)):  # skip the prefill step
            xs.append(ex.batches[k - 1])
            ys.append(ex.starts[k] - ex.ends[k - 1])
    a = np.vstack([np.ones(len(xs)), np.asarray(xs, float)]).T
    (fixed, per_seq), *_ = np.linalg.lstsq(a, np.asarray(ys), rcond=None)
    return max(0.0, float(fixed)), max(0.0, float(per_seq))


# ---------------------------------------------------------------- fit

def _part_times(model: ModelSpec, base: HardwareSpec, rows: list[dict], part: str, **efficiencies) -> np.ndarray:
    """Each row's modelled seconds in one part of the step (linear_s or attention_s) at these efficiencies."""
    cm = CostModel(model, replace(base, **efficiencies))
    return np.array([getattr(cm.breakdown(r["q_lens"], r["ctx_lens"]), part) for r in rows])


# Above 1: a prefetched read of packed weights over huge pages outruns the copy the bandwidth is
# measured with (a copy also writes, and over 4 KiB pages).
EFFICIENCY_GRID = [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5]
# CPU attention gathers K/V through block tables and upcasts: far below the roofline, so its
# factors reach down to 0.5%.
ATTENTION_GRID = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8]


def fit_profile(model: ModelSpec, base: HardwareSpec, rows: list[dict]) -> tuple[HardwareSpec, float]:
    """Grid over efficiencies, least squares for the two overheads; minimise squared relative error.
    Mixed steps (decode rows and prompt chunks together) take no part in that: what they cost beyond
    their parts priced so is fitted afterwards (fit_mixed)."""
    pure = [r for r in rows if r["kind"] != "mixed"]
    y = np.array([r["measured_s"] for r in pure])
    batch = np.array([len(r["q_lens"]) for r in pure], float)
    a = np.vstack([np.ones_like(y), batch]).T / y[:, None]  # rows scaled by 1/y: relative residuals
    best = (float("inf"), base)
    zero = {"step_overhead_s": 0.0, "layer_overhead_s": 0.0, "seq_overhead_s": 0.0, "mixed_step_overhead_s": 0.0,
            "mixed_seq_overhead_s": 0.0}
    # the linear part depends on the memory and linear efficiencies only, attention on its own two:
    # each is priced once per pair of its own, and the grid adds them
    linear = {(mem, lin): _part_times(model, base, pure, "linear_s", mem_efficiency=mem, flops_efficiency=lin)
              for mem, lin in itertools.product(EFFICIENCY_GRID, EFFICIENCY_GRID)}
    attention = {(att, att_mem): _part_times(model, base, pure, "attention_s", attn_efficiency=att,
                                             attn_mem_efficiency=att_mem)
                 for att, att_mem in itertools.product(ATTENTION_GRID, ATTENTION_GRID)}
    for (mem, lin), (att, att_mem) in itertools.product(linear, attention):
        roof = linear[mem, lin] + attention[att, att_mem]
        coef, *_ = np.linalg.lstsq(a, (y - roof) / y, rcond=None)
        coef = np.maximum(coef, 0.0)
        pred = roof + coef[0] + coef[1] * batch
        err = float(np.sum(((pred - y) / y) ** 2))
        if err < best[0]:
            hw = replace(base, mem_efficiency=mem, flops_efficiency=lin, attn_efficiency=att,
                         attn_mem_efficiency=att_mem, **zero)
            best = (err, replace(hw, step_overhead_s=float(coef[0]), seq_overhead_s=float(coef[1])))
    err, hw = best
    mixed = [r for r in rows if r["kind"] == "mixed"]
    if not mixed:
        return hw, err
    hw = fit_mixed(model, hw, mixed)
    return hw, err + sum((p / r["measured_s"] - 1) ** 2 for r, p in zip(mixed, predict_rows(model, hw, mixed)))


def fit_mixed(model: ModelSpec, hw: HardwareSpec, rows: list[dict]) -> HardwareSpec:
    """The mixed-step overheads (per step, per decode row in it): least squares on what the mixed points
    measured beyond their price without them, relative like the main fit; none below zero. One point, or
    points that all have the same number of decode rows, give the per-step term alone."""
    y = np.array([r["measured_s"] for r in rows])
    excess = (y - np.array(predict_rows(model, hw, rows))) / y  # relative to each step, like the main fit
    count = np.array([sum(q == 1 for q in r["q_lens"]) for r in rows], float)
    ones, decodes = 1 / y, count / y
    fixed = per_row = -1.0
    if len(set(count)) > 1:
        (fixed, per_row), *_ = np.linalg.lstsq(np.vstack([ones, decodes]).T, excess, rcond=None)
    if fixed < 0 or per_row < 0:  # the best non-negative fit has one term alone (or zero)
        terms = (ones, decodes) if len(set(count)) > 1 else (ones,)
        alone = [(max(0.0, float(excess @ x / (x @ x))), x) for x in terms]
        c, x = min(alone, key=lambda f: float(np.sum((excess - f[0] * f[1]) ** 2)))
        fixed, per_row = (c, 0.0) if x is ones else (0.0, c)
    return replace(hw, mixed_step_overhead_s=float(fixed), mixed_seq_overhead_s=float(per_row))


def refit(path: str) -> dict:
    """Fit a profile again from the step times it recorded (no new measurements)."""
    profile = json.loads(Path(path).read_text())
    m = profile["measured"]
    from iterserve.sim.model_spec import get_model_spec
    spec = get_model_spec(profile["model"]["path"], profile["model"]["dtype_bytes"])
    base = HardwareSpec.from_json(profile["hardware"])
    hw, err = fit_profile(spec, base, m["steps"])
    for r, p in zip(m["steps"], predict_rows(spec, hw, m["steps"])):
        r["predicted_s"], r["error"] = p, p / r["measured_s"] - 1
    hw = HardwareSpec(**{**hw.to_json(), "step_overhead_s": hw.step_overhead_s + m["host_step_s"],
                         "seq_overhead_s": hw.seq_overhead_s + m["host_seq_s"]})
    profile["hardware"] = hw.to_json()
    m["fit_rms_rel_error"] = float(np.sqrt(err / len(m["steps"])))
    return profile


def predict_rows(model: ModelSpec, hw: HardwareSpec, rows: list[dict]) -> list[float]:
    cm = CostModel(model, hw)
    return [cm.step_time(r["q_lens"], r["ctx_lens"]) for r in rows]


# ---------------------------------------------------------------- command

# The default step shapes: kind:batch:length[@cached]. A profile is most accurate on the shapes its
# workload runs (long contexts, chunks after a cached prefix): pass those with --points.
QUICK_POINTS = ("decode:1:128,decode:8:128,decode:32:128,decode:32:512,decode:8:1024,"
                "prefill:1:128,prefill:1:512,prefill:4:128")
MORE_POINTS = "decode:4:256,decode:16:256,decode:64:256,prefill:1:32"


def _neighbour_loop(point: tuple, runner_kwargs: dict, ready, stop) -> None:
    """Another engine on the same host, busy: one point's step run over and over until told to stop."""
    import torch
    from iterserve.executor.model_runner import ModelRunner
    if runner_kwargs.get("num_threads"):
        torch.set_num_threads(runner_kwargs["num_threads"])
    runner = ModelRunner(EngineConfig(**runner_kwargs))
    fill_pool(runner)
    plan = _plan(point, runner.block_size)
    runner.execute(plan)
    ready.set()
    while not stop.is_set():
        runner.execute(plan)


@contextlib.contextmanager
def neighbour(point: tuple | None, runner_kwargs: dict, start_timeout_s: float = 600.0):
    """With a point: a second process runs that step in a loop for the whole block, as the other engine
    of a P/D pair does beside this one (the prefill engine's chunks beside a decode engine: they share
    the cores' memory bus and caches). Without: nothing."""
    if point is None:
        yield
        return
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_neighbour_loop, args=(point, runner_kwargs, ready, stop), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not ready.wait(0.5):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the neighbour process did not start (exit code {proc.exitcode})")
        yield
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def calibrate(model_path: str | None, quick: bool = False, dtype: str = "auto", reps: int = 3,
              num_threads: int | None = None, points: list[tuple] | None = None,
              neighbour_point: tuple | None = None) -> dict:
    """neighbour_point: every measurement taken while a second process runs that step in a loop."""
    import torch
    if num_threads:
        torch.set_num_threads(num_threads)
    if points is None:
        points = parse_points(QUICK_POINTS if quick else f"{QUICK_POINTS},{MORE_POINTS}")
    blocks = max(1200, max(_point_blocks(p) for p in [*points, *filter(None, [neighbour_point])]))
    runner_kwargs = dict(model=model_path, dtype=dtype, num_kv_blocks=blocks, max_num_seqs=64, num_threads=num_threads)
    with neighbour(neighbour_point, runner_kwargs):
        return _calibrate(model_path, runner_kwargs, reps, points, neighbour_point)


def _calibrate(model_path: str | None, runner_kwargs: dict, reps: int, points: list[tuple],
               neighbour_point: tuple | None) -> dict:
    import torch

    from iterserve.executor.model_runner import ModelRunner
    from iterserve.sim.model_spec import get_model_spec
    from iterserve.model.loader import default_model_path
    path = model_path or default_model_path()
    print(f"calibrating on {torch.get_num_threads()} threads with {path}", flush=True)
    flops = {d: measure_matmul(d) for d in ("float32", "bfloat16")}
    bw = measure_bandwidth()
    print(f"  matmul {flops['float32'] / 1e9:.1f} GFLOP/s fp32, {flops['bfloat16'] / 1e9:.1f} GFLOP/s bf16; "
          f"memory {bw / 1e9:.1f} GB/s", flush=True)
    runner = ModelRunner(EngineConfig(**runner_kwargs))  # one point's requests at a time
    fill_pool(runner)
    elem = runner.storage_dtype.itemsize  # the weights' and the KV's bytes
    spec = get_model_spec(path, elem)
    rows = measure_steps(runner, points, reps)
    base = HardwareSpec("cpu-local", memory_bytes=_total_memory(), mem_bandwidth=bw,
                        peak_flops=flops["bfloat16" if runner.dtype == torch.bfloat16 else "float32"],
                        reserved_bytes=0, kind="cpu",
                        interconnect_bandwidth=bw, host_link_bandwidth=bw, fused_attention=False)
    hw, err = fit_profile(spec, base, rows)
    host_fixed, host_seq = measure_host_overhead(runner.tokenizer, [1, 8, 32])
    print(f"  engine host work: {host_fixed * 1e3:.2f} ms/step + {host_seq * 1e6:.0f} us/request", flush=True)
    kv_send, kv_receive = measure_kv_handoff(runner)
    print(f"  P/D hand-off of a 2,048-token prompt (shared memory): send {kv_send / 1e9:.2f} GB/s, "
          f"receive {kv_receive / 1e9:.2f} GB/s", flush=True)
    for r, p in zip(rows, predict_rows(spec, hw, rows)):  # the runner's steps: without the host work
        r["predicted_s"] = p
        r["error"] = p / r["measured_s"] - 1
    # the engine's steps = the runner's + its own host work (schedule, update, detokenize)
    hw = HardwareSpec(**{**hw.to_json(), "step_overhead_s": hw.step_overhead_s + host_fixed,
                         "seq_overhead_s": hw.seq_overhead_s + host_seq, "kv_send_bandwidth": kv_send,
                         "kv_receive_bandwidth": kv_receive})
    return {"hardware": hw.to_json(),
            "model": {"path": path, "name": spec.name, "dtype_bytes": elem},
            "measured": {"matmul_flops": flops, "mem_bandwidth": bw, "threads": torch.get_num_threads(),
                         "host_step_s": host_fixed, "host_seq_s": host_seq, "kv_send_bandwidth": kv_send,
                         "kv_receive_bandwidth": kv_receive, "steps": rows,
                         "fit_rms_rel_error": float(np.sqrt(err / len(rows))),
                         **({"neighbour": list(neighbour_point)} if neighbour_point else {})},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S")}


# ---------------------------------------------------------------- validation

# Bench workloads (the flags of `iterserve bench`), scaled to run in minutes on two shared cores.
VALIDATION_WORKLOADS = [
    ["--num-requests", "32", "--prompt-len", "128", "--output-dist", "exponential", "--output-mean", "32",
     "--output-max", "128", "--max-num-seqs", "8", "--seed", "0"],
    ["--num-requests", "32", "--prompt-len", "64", "--output-dist", "uniform", "--output-min", "16",
     "--output-max", "64", "--max-num-seqs", "16", "--seed", "1"],
]
FIGURES = (("out tok/s", lambda t: t["output_tokens_per_s"]), ("TTFT mean", lambda t: t["ttft_s"]["mean"]),
           ("TPOT mean", lambda t: t["tpot_s"]["mean"]))


def validate(profile_path: str, workloads: list[list[str]] | None = None, num_threads: int | None = None,
             save_dir: str | None = None) -> list[dict]:
    """Each workload through the real engine and through the simulator on the profile; the
    relative error of each figure, per target."""
    from iterserve.bench import cli as bench_cli
    from iterserve.bench.runner import build_report, run_targets
    from iterserve.sim.cli import build_parser as sim_parser, engine_factory, resolve
    rows = []
    for flags in workloads or VALIDATION_WORKLOADS:
        threads = ["--num-threads", str(num_threads)] if num_threads else []
        args = sim_parser().parse_args([*flags, *threads, "--hardware", "cpu-local", "--hardware-profile", profile_path])
        trace, kw = bench_cli.trace_from_args(args), bench_cli.engine_kwargs_from_args(args)
        real = build_report({}, run_targets(trace, ["continuous", "static"], kw))["targets"]
        if save_dir:  # the real runs are the expensive half: keep them for later comparisons
            Path(save_dir, f"real-{len(rows) // 2}.json").write_text(json.dumps({"flags": flags, "targets": real}))
        model, hw = resolve(args)
        sim_kw = {**kw, "num_kv_blocks": kw.get("num_kv_blocks") or _real_kv_blocks(kw)}
        sim = build_report({}, run_targets(trace, ["continuous", "static"], sim_kw,
                                           engine_factory=engine_factory(model, hw)))["targets"]
        for r, m in zip(real, sim):
            row = {"workload": " ".join(flags), "target": r["name"]}
            for name, get in FIGURES:
                row[name] = (get(r), get(m), get(m) / get(r) - 1 if get(r) else None)
            rows.append(row)
            print(format_validation([row]).splitlines()[-1], flush=True)
    return rows


def _real_kv_blocks(kw: dict) -> int:
    """The pool the real engine would size from kv_cache_memory, so both runs share one KV budget."""
    from iterserve.config import parse_bytes
    from iterserve.model.loader import default_model_path
    from iterserve.sim.model_spec import get_model_spec, with_kv_cache_dtype
    from iterserve.executor.model_runner import pick_device, storage_dtype
    elem = storage_dtype(kw.get("dtype", "auto"), pick_device("auto"), kw.get("quantization")).itemsize
    spec = with_kv_cache_dtype(get_model_spec(kw.get("model") or default_model_path(), elem),
                               kw.get("kv_cache_dtype", "auto"))
    block = kw.get("block_size", 16) * spec.kv_bytes_per_token
    return num_blocks_for(parse_bytes(kw.get("kv_cache_memory") or CPU_KV_CACHE_MEMORY), block)


def format_validation(rows: list[dict]) -> str:
    head = f"{'target':<11}" + "".join(f"{n + ' real':>15}{'sim':>9}{'err':>7}" for n, _ in FIGURES)
    out = [head]
    for r in rows:
        line = f"{r['target']:<11}"
        for name, _ in FIGURES:
            real, sim, err = r[name]
            line += f"{real:>15.3f}{sim:>9.3f}{'-' if err is None else f'{err * 100:+.0f}%':>7}"
        out.append(line)
    return "\n".join(out)


def _total_memory() -> int:
    try:
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="iterserve calibrate", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="model to time (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--output", default=None, help=f"profile path (default: {default_cpu_profile_path()})")
    p.add_argument("--quick", action="store_true", help="fewer step-time points")
    p.add_argument("--reps", type=int, default=3, help="timings per step-time point (the median is kept)")
    p.add_argument("--points", default=None, metavar="SPEC",
                   help="step shapes to time instead of the default grid, e.g. "
                        "decode:16:1024,prefill:1:64@1024 (BATCH requests; LENGTH new tokens after CACHED)")
    p.add_argument("--neighbor", default=None, metavar="POINT",
                   help="measure while a second process runs this step (same threads) over and over, as the "
                        "other engine of a P/D pair on this host does: a decode engine's profile beside "
                        "prefill:1:512, a prefill engine's beside decode:16:100")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads for every measurement (1 is steadier when other work shares the cores)")
    p.add_argument("--validate", action="store_true",
                   help="after fitting, run bench workloads for real and simulated and print the error table")
    p.add_argument("--validate-only", default=None, metavar="PROFILE", help="validate an existing profile")
    p.add_argument("--save-runs", default=None, metavar="DIR", help="validation: keep the real runs' reports here")
    p.add_argument("--refit", default=None, metavar="PROFILE",
                   help="fit an existing profile again from its recorded step times, in place")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.refit:
        if not Path(args.refit).is_file():
            fail(f"no profile at {args.refit}")
        profile = refit(args.refit)
        Path(args.refit).write_text(json.dumps(profile, indent=2))
        _print_fit(profile)
        print(f"wrote {args.refit}")
        return 0
    if args.validate_only:
        if not Path(args.validate_only).is_file():
            fail(f"no profile at {args.validate_only} (write one with `iterserve calibrate`)")
        print(format_validation(validate(args.validate_only, num_threads=args.num_threads, save_dir=args.save_runs)))
        return 0
    try:
        points = parse_points(args.points) if args.points else None
        neighbour_points = parse_points(args.neighbor) if args.neighbor else [None]
    except ValueError as exc:
        fail(str(exc))
    if len(neighbour_points) != 1:
        fail(f"--neighbor takes one point, got {len(neighbour_points)}")
    profile = calibrate(args.model, args.quick, args.dtype, args.reps, args.num_threads, points, neighbour_points[0])
    out = Path(args.output) if args.output else default_cpu_profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2))
    _print_fit(profile)
    print(f"wrote {out}")
    if args.validate:
        rows = validate(str(out), num_threads=args.num_threads, save_dir=args.save_runs)
        print("workloads:\n" + "\n".join(f"  iterserve bench {' '.join(w)}" for w in VALIDATION_WORKLOADS))
        print(format_validation(rows))
        profile["validation"] = rows
        out.write_text(json.dumps(profile, indent=2))
    return 0


def _print_fit(profile: dict) -> None:
    hw = profile["hardware"]
    print(f"fitted: memory eff {hw['mem_efficiency']:.2f}, linear eff {hw['flops_efficiency']:.2f}, "
          f"attention eff {hw['attn_efficiency']:.2f}, overhead {hw['step_overhead_s'] * 1e3:.2f} ms/step "
          f"+ {hw['seq_overhead_s'] * 1e6:.0f} us/request; step-time fit error "
          f"{profile['measured']['fit_rms_rel_error'] * 100:.1f}% rms")
    print(f"{'kind':<8}{'batch':>6}{'len':>15}{'measured ms':>13}{'model ms':>10}{'error':>8}")
    for r in profile["measured"]["steps"]:
        print(f"{r['kind']:<8}{r['batch']:>6}{_point_label(r):>15}{r['measured_s'] * 1e3:>13.1f}"
              f"{r['predicted_s'] * 1e3:>10.1f}{r['error'] * 100:>7.1f}%")
