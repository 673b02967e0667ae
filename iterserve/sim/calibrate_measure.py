"""What `iterserve calibrate` measures: matmul throughput and memory bandwidth, real step times of the
loaded model on hand-made plans (the points), the engine's host work per step, and the P/D hand-off;
each alone or beside a neighbour process that keeps another step running."""
from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np

from iterserve.config import EngineConfig
from iterserve.kv.spec import KVCacheSpec
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput, StepResult

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

    from iterserve.executor.kv_pool import lazy_zeros, scatter_blocks
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
