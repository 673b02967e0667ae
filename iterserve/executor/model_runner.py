"""ModelRunner: a scheduler plan in, sampled tokens out, on the real model.

execute(plan): block swaps/copies -> flat inputs (loops over requests, never tokens) -> model ->
sampler. Everything per token is built with numpy/torch ops over whole requests.

On CUDA (docs/gpu.md): attention runs through the Triton kernels (model/attention_backend.py);
with config.use_cuda_graphs, every pure-decode step of at most max_num_seqs requests replays a CUDA
graph captured at start-up, one per batch-size bucket (executor/cuda_graphs.py); prompt and mixed
steps run eagerly. The KV pool is sized from the free device memory after a profiling forward pass.
"""
from __future__ import annotations

import logging
import math
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch

from iterserve.config import CPU_KV_CACHE_MEMORY, EngineConfig
from iterserve.executor.base import KVCacheSpec, kv_head_width, num_blocks_for
from iterserve.executor.cuda_graphs import CudaGraphRunner, DecodeInputs
from iterserve.executor.logits_processors import make_adjust
from iterserve.executor.request_state import RequestStates
from iterserve.executor.sampler import make_batch, prompt_logprobs, sample, verify_random_drafts
from iterserve.heap import advise_huge_pages
from iterserve.model.attention import in_pairs, pairs_to_rows, rows_to_pairs
from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.llama import LlamaModel
from iterserve.model import cpu_paths, weight_cache
from iterserve.model.cpu_kernels import linear_kernel, prebuild
from iterserve.model.loader import ModelArch, default_model_path
from iterserve.model.lora import LoRASlots
from iterserve.model.quant import weight_only_on_panels
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput, StepResult

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger("iterserve.executor")
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch sees no CUDA device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The arithmetic's dtype (activations, logits)."""
    if name == "bf16-storage":
        return torch.float32
    if name != "auto":
        return _DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" or cpu_paths.current().bf16_arithmetic else torch.float32


def storage_dtype(name: str, device: torch.device, quantization: str | None = None) -> torch.dtype:
    """The dtype the weights and the KV cache are kept in: the arithmetic's, except under bf16-storage
    (asked for, or `auto` on a CPU without bf16 instructions), where bfloat16 halves the bytes every step
    streams while the panel kernel widens them in registers for float32 arithmetic. Weight-only int8/int4
    on the kernel's own panels (AVX2) run under it too: their codes come from the bfloat16 weights, and the
    KV cache and the other weights stay bfloat16."""
    compute = pick_dtype(name, device)
    quantization = None if quantization in ("auto", "none") else quantization  # unresolved (the simulator): floats'
    panels = quantization is None or weight_only_on_panels(quantization)
    if name == "bf16-storage":
        if device.type != "cpu" or linear_kernel() is None:
            raise ValueError("--dtype bf16-storage needs the CPU linear kernel (cpu_linear.cpp: AVX-512, or AVX2 with FMA); "
                             "use --dtype float32 or bfloat16 here")
        if not panels:
            raise ValueError(f"--dtype bf16-storage runs --quantization {quantization} on this CPU's build only "
                             "through PyTorch's kernels, which take the arithmetic's dtype: use --dtype float32")
        return torch.bfloat16
    if name == "auto" and compute == torch.float32 and device.type == "cpu" and panels and linear_kernel() is not None:
        return torch.bfloat16
    return compute


def _weights_line(asked: str | None, served: str | None, path: str | None) -> str:
    """The start line's word on the weights: what they are served as, and why where --quantization auto chose."""
    what = served or "floats"
    if asked == "auto" and served is not None:
        return f"{what} (what {os.path.basename(path)} holds: --quantization auto; none for floats)"
    return what


def kv_dtype_name(kv_cache_dtype: str, dtype: torch.dtype, attention: str) -> str:
    """The KV pool's dtype (executor.base.DTYPE_BYTES): the model's, or int8 where attention can read it."""
    if kv_cache_dtype == "auto":
        return str(dtype).removeprefix("torch.")
    if attention != "torch":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is read by the torch/CPU attention path only, not by "
                         f"the {attention} kernels: use --kv-cache-dtype auto here (or ITERSERVE_ATTENTION=torch)")
    return kv_cache_dtype


def eos_token_ids(arch: ModelArch, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the model's (Llama 3 lists several) and the tokenizer's."""
    ids = set(arch.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class ModelRunner:
    supports_pooling = True  # StepResult.pooled: embeddings (SamplingParams.pooling)

    def __init__(self, config: EngineConfig, arch: ModelArch | None = None,
                 weights: dict[str, torch.Tensor] | None = None, tokenizer=None, tp=None):
        """Loads config.model. Or, given arch and weights (HF names, already on the device, in
        float32 or bfloat16 under a float32 runner, else in the runner's dtype), builds from memory with no file: benchmarks run random-weight models
        of any shape that way (tokenizer None: prompts must be token ids). Under tensor parallelism
        (executor/tp_executor.py) each rank builds one from its shard, with its collectives as `tp`."""
        self.config = config
        mc, cc = config.model_config, config.cache_config
        self.device = pick_device(mc.device)
        if self.device.type == "cpu":  # a cold start compiles the kernels while the weights and tokenizer load
            prebuild()
        self.dtype = pick_dtype(mc.dtype, self.device)
        path = (mc.model or default_model_path()) if weights is None else None
        self.quantization = weight_cache.resolve_quantization(path, mc.quantization, mc.dtype)  # "auto" decided
        load_dtype = storage_dtype(mc.dtype, self.device, self.quantization)  # checks the combination too
        if self.device.type == "cpu":
            torch.set_num_threads(mc.num_threads or os.cpu_count() or 1)
        pending_tokenizer = panel_cache = None
        if weights is None:
            if self.device.type == "cpu":  # before reading a byte: a model that cannot fit is refused
                weight_cache.check_fits(path, self.quantization, load_dtype, self._planned_kv_bytes(path, load_dtype))
            pending_tokenizer = _load_tokenizer_aside(path)
            arch, weights = weight_cache.load_arch_and_weights(path, load_dtype, self.device, self.quantization)
            panel_cache = weight_cache.panel_cache(path, load_dtype, self.device, load_dtype != self.dtype,
                                                   self.quantization)
        assert arch is not None, "weights given without their arch"
        self.arch = cfg = arch
        self.vocab_size = cfg.vocab_size
        if mc.max_model_len is not None and mc.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {mc.max_model_len} exceeds the model's context of "
                             f"{cfg.max_position_embeddings} tokens")
        self.max_model_len = mc.max_model_len or cfg.max_position_embeddings
        self.block_size = cc.block_size
        self.model = LlamaModel(cfg, weights, cc.block_size, max_positions=cfg.max_position_embeddings,
                                quantization=self.quantization, tp=tp, dtype=self.dtype, panel_cache=panel_cache)
        if panel_cache is not None:
            panel_cache.save()
        del weights  # the model holds its own (fused) copies: let the loaded ones go before profiling
        self.storage_dtype = self.model.weight_dtype  # weights and KV pool; given weights as the caller made them
        if self.device.type == "cpu" and tp is None:
            logger.info("%s; this model: %s, weights %s, C decode loop %s", cpu_paths.current().summary(), self.dtype,
                        _weights_line(mc.quantization, self.quantization, path),
                        "on" if self.model.decode_layers is not None else "off")
        self.tokenizer = tokenizer if pending_tokenizer is None else pending_tokenizer.result()
        self.eos_token_ids = eos_token_ids(cfg, self.tokenizer)
        weight_cache.release_load_buffers()  # after the tokenizer: a cold one leaves the GGUF conversion's garbage
        self.kv_dtype = kv_dtype_name(cc.kv_cache_dtype, self.storage_dtype, self.model.attention.name)
        self.kv_cache_spec = KVCacheSpec(cc.block_size, 1, 0, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                         self.kv_dtype)
        num_kv_blocks = self._num_kv_blocks(self.kv_cache_spec.bytes_per_block)
        num_host_blocks = config.swap_space_bytes // self.kv_cache_spec.bytes_per_block
        self.kv_cache = self._alloc_kv(num_kv_blocks, self.device)
        self.host_kv_cache = self._alloc_kv(num_host_blocks, torch.device("cpu"))
        self._generators: dict[str, torch.Generator] = {}
        self._pool_sums: dict[str, torch.Tensor] = {}  # mean pooling: the hidden states summed over earlier chunks
        self.requests = RequestStates()  # block tables and token histories, from the plans' rows and deltas
        self.kv_cache_spec = replace(self.kv_cache_spec, num_device_blocks=num_kv_blocks,
                                     num_host_blocks=num_host_blocks)
        self.graphs: CudaGraphRunner | None = None  # the measurement below runs eagerly
        self.lora = LoRASlots.build(self.model, mc, tp)  # None under tensor parallelism
        if config.scheduler_config.preemption_mode == "auto":
            self.kv_cache_spec = replace(self.kv_cache_spec, **self._measure_preemption_costs())
        if self.device.type == "cpu":  # after the measurement's few blocks: they stay on small pages
            pool_on_huge_pages(self.kv_cache)
        # Captured last: the graphs hold the KV cache by address, and the pool is sized without them.
        if self.device.type == "cuda" and mc.use_cuda_graphs and self.model.attention.graph_safe:
            self.graphs = CudaGraphRunner(self.model.forward, self.kv_cache, config.scheduler_config.max_num_seqs,
                                          self.max_model_len, self.block_size)
            self.graphs.capture()

    @staticmethod
    def config_key(config: EngineConfig) -> str:
        """What this runner is built from: engines whose configs share the key may share one runner."""
        c = config.cache_config
        return repr((config.model_config, c.block_size, c.num_kv_blocks, c.kv_cache_memory, c.gpu_memory_utilization,
                     c.kv_cache_dtype, config.swap_space_bytes, config.scheduler_config.preemption_mode == "auto",
                     config.parallel_config.tensor_parallel_size, config.parallel_config.distributed_port))

    @property
    def device_type(self) -> str:
        """executor/base.DeviceExecutor: what the diagnostics' what-if asks of it."""
        return self.device.type

    def shutdown(self) -> None:
        """Nothing outlives the process here; multi-process executors stop their workers."""

    def _measure_preemption_costs(self) -> dict[str, float]:
        """What auto preemption weighs: a swap round trip's bandwidth and the prompt speed, timed on
        this model and device at start-up (a few blocks out and back; one prompt of up to 256 tokens)."""
        spec = self.kv_cache_spec
        n = min(spec.num_host_blocks, spec.num_device_blocks, 8)
        moves = [(i, i) for i in range(n)]
        start = time.perf_counter()
        self._move_blocks(SchedulerOutput(block_size=self.block_size, swap_out=moves, swap_in=moves))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        swap_s = time.perf_counter() - start
        length = min(256, self.max_model_len - 1, spec.num_device_blocks * self.block_size)
        plan = SchedulerOutput(block_size=self.block_size, scheduled=[ScheduledRequest(
            "measure", [0] * length, 0, list(range(-(-length // self.block_size))), True, SamplingParams())])
        timings = []
        for _ in range(2):  # the first pass pays one-time costs (kernel builds, allocations)
            timings.append(self.execute(plan).step_time)
        return {"swap_bytes_per_s": 2 * n * spec.bytes_per_block / max(swap_s, 1e-9) if n else 0.0,
                "recompute_tokens_per_s": length / max(timings[-1], 1e-9)}

    def _planned_kv_bytes(self, path: str, dtype: torch.dtype) -> int:
        """The device and host KV pools' bytes on CPU, before the model is loaded (from its arch alone)."""
        c = self.config.cache_config
        if c.num_kv_blocks:
            a = weight_cache.load_arch(path)
            kv = "int8" if c.kv_cache_dtype == "int8" else str(dtype).removeprefix("torch.")
            device = c.num_kv_blocks * KVCacheSpec(c.block_size, 1, 0, a.num_layers, a.num_kv_heads, a.head_dim,
                                                   kv).bytes_per_block
        else:
            device = c.kv_cache_memory or CPU_KV_CACHE_MEMORY
        return device + self.config.swap_space_bytes

    # ------------------------------------------------------------ KV pool size

    def _num_kv_blocks(self, block_bytes: int) -> int:
        """num_kv_blocks if given; else kv_cache_memory on CPU or when set; else, on CUDA, profiled."""
        c = self.config.cache_config
        if c.num_kv_blocks:
            return c.num_kv_blocks
        if self.device.type != "cuda" or c.kv_cache_memory is not None:
            return num_blocks_for(c.kv_cache_memory or CPU_KV_CACHE_MEMORY, block_bytes)
        return num_blocks_for(self._profile_kv_memory(block_bytes), block_bytes)

    def _profile_kv_memory(self, block_bytes: int) -> int:
        """pool = free device memory * gpu_memory_utilization - the activations' peak.

        The peak is measured by one forward pass and sampling at the largest step the scheduler can
        plan (max_num_batched_tokens prompt tokens over up to max_num_seqs requests) on a scratch
        cache. Free memory is read after the weights are loaded and the scratch freed, so it
        excludes the weights and includes the room the activations will need; the (1 - utilization)
        share is left for the CUDA graphs, the allocator's fragmentation and other processes."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        plan, num_blocks = self._profile_plan()
        with torch.inference_mode():
            nrows = _logits_rows(plan.scheduled)
            ids, pos, _, md, logits_indices = self._prepare(plan, nrows)
            scratch = self._alloc_kv(num_blocks, dev)
            self._sample(plan, self.model.forward(ids, pos, scratch, md, logits_indices), nrows)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del scratch
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(dev)
        utilization = self.config.cache_config.gpu_memory_utilization
        pool = int(free * utilization) - peak
        if pool < block_bytes:
            raise RuntimeError(f"no device memory left for the KV cache: {free / 2**30:.2f} GiB free * "
                               f"gpu_memory_utilization {utilization} - activations "
                               f"{peak / 2**30:.2f} GiB; raise gpu_memory_utilization or lower max_num_batched_tokens")
        return pool

    def _profile_plan(self) -> tuple[SchedulerOutput, int]:
        """max_num_batched_tokens dummy prompt tokens split evenly over up to max_num_seqs requests."""
        sc, bs = self.config.scheduler_config, self.block_size
        total = sc.max_num_batched_tokens
        n = max(min(sc.max_num_seqs, total), -(-total // self.max_model_len))
        plan, used = SchedulerOutput(block_size=bs), 0
        for i in range(n):
            length = total // n + (i < total % n)
            blocks = list(range(used, used + -(-length // bs)))
            used += len(blocks)
            plan.scheduled.append(ScheduledRequest(f"profile-{i}", [0] * length, 0, blocks, True, SamplingParams()))
        return plan, used

    def _alloc_kv(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        c = self.arch
        width = kv_head_width(c.head_dim, self.kv_dtype)  # an int8 pool's rows carry their scales
        shape = (c.num_layers, 2, num_blocks, self.block_size, c.num_kv_heads, width)
        dtype = torch.int8 if self.kv_dtype == "int8" else self.storage_dtype
        if device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        return lazy_zeros(shape, dtype)

    # ------------------------------------------------------------ one step

    def execute(self, plan: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        self._move_blocks(plan)
        for rid in plan.finished_ids:
            self._generators.pop(rid, None)
            self._pool_sums.pop(rid, None)
            if self._matchers is not None:
                self._matchers.drop(rid)
        plan = self.requests.resolve(plan)
        if not plan.scheduled:
            return StepResult(sampled=[], logprobs=None, step_time=time.perf_counter() - t0)
        with torch.inference_mode():
            nrows = _logits_rows(plan.scheduled)  # once per step: _prepare and _sample both read it
            inputs = self._prepare(plan, nrows)
            lora = None if self.lora is None else self.lora.batch(
                [r.sampling_params.lora_name for r in plan.scheduled], [len(r.token_ids) for r in plan.scheduled])
            hidden_rows = _hidden_rows(plan.scheduled)
            if hidden_rows is None:
                logits, pooled = self._run_model(*inputs, lora), None
            else:  # eagerly: a graph returns logits only
                logits, hidden = self.model.forward(*inputs, torch.from_numpy(hidden_rows).to(self.device), lora)
                pooled = self._pool(plan.scheduled, hidden.float())
            sampled, logprobs, prompt_lps, accepted = self._sample(plan, logits, nrows)
        return StepResult(sampled=sampled, logprobs=logprobs, accepted_drafts=accepted, prompt_logprobs=prompt_lps,
                          pooled=pooled, step_time=time.perf_counter() - t0)

    def _pool(self, reqs: list[ScheduledRequest], hidden: torch.Tensor) -> list[list[float] | None]:
        """Each pooling request's embedding once its prompt is done (L2-normalized), from the rows
        _hidden_rows picked. Mean pooling sums chunk by chunk; a chunk at position 0 starts afresh (a
        prompt recomputed after preemption). Prefix-cache hits never reach here: the scheduler serves
        mean pooling none, and last pooling needs only the last token, which is always computed."""
        out: list[list[float] | None] = [None] * len(reqs)
        offset = 0
        for i, r in enumerate(reqs):
            n = _num_hidden_rows(r)
            if not n:
                continue
            rows, offset = hidden[offset:offset + n], offset + n
            if r.sampling_params.pooling == "mean":
                total = rows.sum(0) + (self._pool_sums.pop(r.request_id) if r.start_pos else 0)
                if not r.sample:
                    self._pool_sums[r.request_id] = total
                    continue
                rows = total / r.seq_len
            out[i] = torch.nn.functional.normalize(rows.reshape(-1), dim=0).tolist()
        return out

    def _run_model(self, ids, pos, kv_cache, md: AttentionMetadata, logits_indices, lora=None) -> torch.Tensor:
        """A pure-decode batch that fits a captured bucket replays its graph; anything else (a step with
        LoRA adapters too: the graphs hold the base weights alone) runs eagerly."""
        g = self.graphs
        if (g is not None and lora is None and md.is_pure_decode and g.bucket(md.num_seqs) is not None
                and md.block_tables.shape[1] <= g.static.block_tables.shape[1]):
            return g.run(DecodeInputs(ids, pos, md.slot_mapping, md.seq_lens, md.block_tables))
        return self.model.forward(ids, pos, kv_cache, md, logits_indices, lora=lora)

    # ------------------------------------------------------------ LoRA adapters (model/lora.py)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The loaded adapters: name -> path (read-only: any thread may read it)."""
        return {} if self.lora is None else self.lora.paths

    def load_lora(self, name: str, path: str) -> None:
        self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        self.lora.unload(name)

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        """Whole blocks across all layers: kv[:, :, block] is every layer's K and V of that block."""
        if plan.swap_out:
            src, dst = zip(*plan.swap_out)
            scatter_blocks(self.host_kv_cache, dst, gather_blocks(self.kv_cache, src).to("cpu"))
        if plan.swap_in:
            src, dst = zip(*plan.swap_in)
            scatter_blocks(self.kv_cache, dst, gather_blocks(self.host_kv_cache, src).to(self.device))

    # ------------------------------------------------------------ KV hand-off (disaggregated prefill)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks on the CPU, [layers, 2, n, block_size, kv_heads, head_dim] in rows (an
        int8 pool's rows carry their scales: head_dim + 4)."""
        blocks = gather_blocks(self.kv_cache, block_ids).to("cpu")
        if in_pairs(self.model.attention.pairs, self.kv_cache):  # hand-offs travel in rows, whatever the pools keep
            blocks = torch.stack(pairs_to_rows(blocks[:, 0], blocks[:, 1]), dim=1)
        return blocks

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Fill these blocks from read_blocks' layout (another engine's, of the same model and block size)."""
        expected = (*self.kv_cache.shape[:2], len(block_ids), *self.kv_cache.shape[3:])
        if (blocks.dtype == torch.int8) != (self.kv_cache.dtype == torch.int8):
            raise ValueError(f"KV blocks in {blocks.dtype} do not fit this pool's {self.kv_cache.dtype}: "
                             "both engines need the same --kv-cache-dtype")
        if tuple(blocks.shape) != expected:
            raise ValueError(f"KV blocks of shape {tuple(blocks.shape)} do not fit this pool's {expected}")
        blocks = blocks.to(self.device, self.kv_cache.dtype)
        if in_pairs(self.model.attention.pairs, self.kv_cache):
            blocks = torch.stack(rows_to_pairs(blocks[:, 0], blocks[:, 1]), dim=1)
        scatter_blocks(self.kv_cache, block_ids, blocks)

    def _prepare(self, plan: SchedulerOutput, nrows: list[int] | None):
        """Flat step inputs; nrows: _logits_rows(plan.scheduled), the logits rows each request gets."""
        reqs, bs = plan.scheduled, plan.block_size
        assert bs == self.block_size, f"plan block_size {bs} != cache block_size {self.block_size}"
        q_lens = [len(r.token_ids) for r in reqs]
        seq_lens = [r.start_pos + n for r, n in zip(reqs, q_lens)]
        if max(q_lens) == 1:  # pure decode: one token per request, no concatenation needed
            ids = np.fromiter((r.token_ids[0] for r in reqs), np.int64, len(reqs))
            pos = np.asarray(seq_lens, np.int64) - 1
        else:
            ids = np.fromiter((t for r in reqs for t in r.token_ids), np.int64, sum(q_lens))
            pos = np.concatenate([np.arange(r.start_pos, s, dtype=np.int64) for r, s in zip(reqs, seq_lens)])
        max_blocks = max(len(r.block_table) for r in reqs)
        tables = np.zeros((len(reqs), max_blocks), np.int64)
        for i, r in enumerate(reqs):
            tables[i, : len(r.block_table)] = r.block_table
        starts = np.zeros(len(reqs) + 1, np.int64)
        np.cumsum(q_lens, out=starts[1:])
        row = np.repeat(np.arange(len(reqs)), q_lens)
        slots = tables[row, pos // bs] * bs + pos % bs
        att_seqs, att_q_lens, att_seq_lens = _attention_sequences(reqs, q_lens, seq_lens)
        att_starts = starts if att_seqs is None else np.concatenate([[0], np.cumsum(att_q_lens)])
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(att_starts).to(dev, torch.int32),
            seq_lens=torch.tensor(att_seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables if att_seqs is None else tables[att_seqs]).to(dev, torch.int32),
            max_query_len=max(att_q_lens), max_seq_len=max(att_seq_lens), query_lens_list=att_q_lens,
            seq_lens_list=att_seq_lens)
        # logits for every request's last token: padding seats pay for theirs too, as a padded batch would;
        # a request asking for prompt logprobs gets a row for each token of its chunk, one with drafts a row
        # for its own last token and each draft
        ends = starts[1:]
        rows = ends - 1 if nrows is None else np.concatenate([np.arange(e - k, e) for e, k in zip(ends, nrows)])
        logits_indices = torch.from_numpy(rows).to(dev)
        return (torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev), self.kv_cache, md, logits_indices)

    def _sample(self, plan: SchedulerOutput, logits: torch.Tensor, nrows: list[int] | None):
        """(token per request, logprobs, prompt logprobs, accepted drafts). A request with drafts has a row
        for its last own token and one per draft, each processed as a one-token step would be (drafted
        requests have no position-dependent processing: engine/spec_decode.py); then the drafts are verified."""
        scheduled = plan.scheduled
        prompt_lps = None
        if nrows is not None:  # keep each request's sampling rows: its last one, or 1 + its drafts
            prompt_lps = _prompt_logprobs(scheduled, nrows, logits)
            logits = logits[torch.from_numpy(_sampling_rows(scheduled, nrows)).to(logits.device)]
        rows = [i for i, r in enumerate(scheduled) if r.sample and not r.is_padding and r.sampling_params.pooling is None]
        sampled = [-1] * len(scheduled)
        if not rows:
            return sampled, None, prompt_lps, None
        widths = [r.num_draft_tokens + 1 for r in scheduled]
        reqs = [scheduled[i] for i in rows for _ in range(widths[i])]
        index = _row_index(widths, rows)
        sel = logits if index is None else logits[torch.tensor(index, device=logits.device)]
        tokens, lps = self._sample_rows(reqs, sel)
        logprobs = [None] * len(scheduled) if lps is not None else None
        accepted = [[] for _ in scheduled] if len(reqs) > len(rows) else None
        verified = _verify_random(scheduled, rows, widths, sel) if accepted is not None else {}
        j = 0
        for i in rows:
            w = widths[i]
            if i in verified:
                a, sampled[i] = verified[i]
            else:
                a, sampled[i] = _verify_greedy(_drafts(scheduled[i]), tokens[j:j + w])
            if accepted is not None:
                accepted[i] = _drafts(scheduled[i])[:a]
            if lps is not None:
                logprobs[i] = lps[j + w - 1]  # drafted requests ask for none: w is 1 where this is set
            j += w
        return sampled, logprobs, prompt_lps, accepted

    def _sample_rows(self, reqs: list[ScheduledRequest], sel: torch.Tensor):
        """Sample row k of `sel` with reqs[k]'s parameters."""
        gens = [self._generator(r) for r in reqs]
        vocab = sel.shape[-1]
        allowed = self._structured(reqs)
        batch = make_batch([r.sampling_params for r in reqs], gens, vocab, sel.device,
                           make_adjust(reqs, self.eos_token_ids, vocab, sel.device, allowed))
        tokens, lps = sample(sel, batch)
        if allowed is not None:
            self._matchers.accept(reqs, tokens, allowed[1])
        return tokens, lps

    _matchers = None  # structured output: made on first use (xgrammar loads only then)

    def _structured(self, reqs: list[ScheduledRequest]):
        """The grammar bitmask of the constrained rows, or None (free rows never pay for it)."""
        if all(r.sampling_params.structured_outputs is None for r in reqs):
            return None
        if self._matchers is None:
            from iterserve.executor.structured_output import Matchers, grammar_cache
            self._matchers = Matchers(grammar_cache(self.tokenizer, self.vocab_size, self.eos_token_ids))
        return self._matchers.bitmask(reqs)

    def _generator(self, r) -> torch.Generator | None:
        """Reseeded from (seed, output_len) every step: the same draw after a preemption or any batch mix."""
        seed = r.sampling_params.seed
        if seed is None or r.sampling_params.temperature == 0.0:
            return None
        g = self._generators.get(r.request_id)
        if g is None:
            g = self._generators[r.request_id] = torch.Generator(device=self.device)
        g.manual_seed((seed + r.output_len * _SEED_MIX) % (1 << 63))
        return g


def _num_prompt_logprobs(r: ScheduledRequest) -> int:
    """How many prompt tokens of this chunk get a logprob (0: not asked): the token at position p + 1
    from the logits at p, for p in the chunk and before the prompt's last token."""
    if r.sampling_params.prompt_logprobs is None:
        return 0
    return max(0, min(r.seq_len, len(r.prompt_token_ids) - 1) - r.start_pos)


def _num_hidden_rows(r: ScheduledRequest) -> int:
    """Hidden-state rows a request pools from this step: mean, its whole chunk; last, its last token once
    the prompt is done; none for the rest."""
    pooling = r.sampling_params.pooling
    if pooling is None or r.is_padding:
        return 0
    return len(r.token_ids) if pooling == "mean" else int(r.sample)


def _hidden_rows(reqs: list[ScheduledRequest]) -> np.ndarray | None:
    """The step's token rows whose final-norm hidden states are pooled, in request order; None: no pooling."""
    counts = [_num_hidden_rows(r) for r in reqs]
    if not any(counts):
        return None
    ends = np.cumsum([len(r.token_ids) for r in reqs])
    return np.concatenate([np.arange(e - k, e) for e, k in zip(ends, counts) if k])


def _logits_rows(reqs: list[ScheduledRequest]) -> list[int] | None:
    """Logits rows per request: its whole chunk if it wants prompt logprobs, else its last token and its
    drafts. None when every request has one row (the common case costs nothing)."""
    drafts = any(r.num_draft_tokens for r in reqs)
    if not drafts and (all(r.sampling_params.prompt_logprobs is None for r in reqs)
                       or not any(map(_num_prompt_logprobs, reqs))):
        return None
    return [len(r.token_ids) if _num_prompt_logprobs(r) else r.num_draft_tokens + 1 for r in reqs]


def _sampling_rows(reqs: list[ScheduledRequest], nrows: list[int]) -> np.ndarray:
    """Of the _logits_rows layout, each request's last 1 + num_draft_tokens rows."""
    ends = np.cumsum(nrows)
    return np.concatenate([np.arange(e - r.num_draft_tokens - 1, e) for e, r in zip(ends, reqs)])


def _row_index(widths: list[int], rows: list[int]) -> list[int] | None:
    """The logits rows of the sampling requests `rows` (widths: rows per request); None: all of them."""
    if len(rows) == len(widths):
        return None
    starts = np.cumsum([0, *widths[:-1]]).tolist()
    return [starts[i] + k for i in rows for k in range(widths[i])]


def _attention_sequences(reqs: list[ScheduledRequest], q_lens: list[int], seq_lens: list[int]):
    """The sequences attention sees: (request of each, q_lens, seq_lens), or (None, q_lens, seq_lens) where
    they are the requests. A request with drafts attends as 1 + k one-token sequences over its block table,
    the i-th seeing the context up to its own token: the arithmetic its one-token steps would have done
    without speculation (the decode kernel's, not the prompt kernel's, whose sums run in another order),
    so greedy tokens come out the same with speculation on and off, and a verify step is a decode step."""
    if not any(r.num_draft_tokens for r in reqs):
        return None, q_lens, seq_lens
    seqs, att_q, att_seq = [], [], []
    for i, (r, n, s) in enumerate(zip(reqs, q_lens, seq_lens)):
        split = r.num_draft_tokens > 0
        seqs += [i] * (n if split else 1)
        att_q += [1] * n if split else [n]
        att_seq += range(s - n + 1, s + 1) if split else [s]
    return seqs, att_q, att_seq


def _drafts(r: ScheduledRequest) -> list[int]:
    return r.token_ids[len(r.token_ids) - r.num_draft_tokens:]


def _verify_greedy(drafts: list[int], targets: list[int]) -> tuple[int, int]:
    """(drafts accepted, the model's own token after them): the drafts up to the first that differs from
    the argmax there (`targets`: each row's one-token sample; one row without drafts), then that argmax."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a, targets[a]


def _verify_random(scheduled: list[ScheduledRequest], rows: list[int], widths: list[int],
                   sel: torch.Tensor) -> dict[int, tuple[int, int]]:
    """Drafted requests that sample at temperature > 0: rejection sampling over their rows of `sel`, all
    in one batch, so each token has the distribution a one-token step would draw it from."""
    offsets = np.cumsum([0] + [widths[i] for i in rows]).tolist()
    pick = [(i, o) for i, o in zip(rows, offsets) if widths[i] > 1 and scheduled[i].sampling_params.temperature]
    if not pick:
        return {}
    index = torch.tensor([o + k for i, o in pick for k in range(widths[i])], device=sel.device)
    params = [scheduled[i].sampling_params for i, _ in pick for _ in range(widths[i])]
    results = verify_random_drafts(sel[index], params, [_drafts(scheduled[i]) for i, _ in pick])
    return {i: r for (i, _), r in zip(pick, results)}


def _prompt_logprobs(reqs: list[ScheduledRequest], nrows: list[int], logits: torch.Tensor):
    out: list = [None] * len(reqs)
    offset = 0
    for i, (r, k) in enumerate(zip(reqs, nrows)):
        if n := _num_prompt_logprobs(r):
            targets = torch.tensor(r.prompt_token_ids[r.start_pos + 1:r.start_pos + 1 + n], device=logits.device)
            out[i] = prompt_logprobs(logits[offset:offset + n], targets, r.sampling_params.prompt_logprobs)
        offset += k
    return out


def _load_tokenizer_aside(path: str) -> Future:
    """The tokenizer, loaded on a worker thread while this one reads and packs the weights: it parses
    files and runs no torch op (a second thread running ops would start a second OpenMP pool)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="iterserve-tokenizer")
    future = pool.submit(weight_cache.load_tokenizer, path)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future


def block_runs(block_ids) -> list[tuple[int, int, int]]:
    """(index in block_ids, first block, count) for each run of consecutive ids: a pool's blocks move
    run by run, as slice copies (a few memcpys each); indexing a pool with the id list went element by
    element, at a third of the speed (docs/disaggregation.md)."""
    runs, i = [], 0
    while i < len(block_ids):
        j = i + 1
        while j < len(block_ids) and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        runs.append((i, block_ids[i], j - i))
        i = j
    return runs


def gather_blocks(pool: torch.Tensor, block_ids) -> torch.Tensor:
    """pool[:, :, block_ids] as a new tensor: every layer's K and V of those blocks, in their order."""
    out = pool.new_empty((*pool.shape[:2], len(block_ids), *pool.shape[3:]))
    for i, first, n in block_runs(block_ids):
        out[:, :, i:i + n] = pool[:, :, first:first + n]
    return out


def scatter_blocks(pool: torch.Tensor, block_ids, blocks: torch.Tensor) -> None:
    """pool[:, :, block_ids] = blocks, in place."""
    for i, first, n in block_runs(block_ids):
        pool[:, :, first:first + n] = blocks[:, :, i:i + n]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """Zeros in an anonymous mapping, which the kernel fills with zero pages on first touch: the KV pool
    costs memory as its blocks are first used, not all of it at start-up (1 GiB written at every start).
    Unwritten pages all read as one zero page. huge_pages: see pool_on_huge_pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # private: Linux gives shared anonymous memory (shmem) huge pages only where shmem_enabled allows,
    # which it does not by default; the tensor keeps the mapping alive
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    kv = torch.frombuffer(mapping, dtype=dtype).view(shape)
    if huge_pages:
        pool_on_huge_pages(kv)
    return kv


def pool_on_huge_pages(kv: torch.Tensor) -> None:
    """Decode reads K/V block by block from all over the pool: over 4 KiB pages nearly every block is
    a TLB miss. Pages first touched from now on come 2 MiB at a time; a block touches one in each
    layer's K and V, so a start that touches a few blocks pays for 2 x layers of them."""
    advise_huge_pages(kv.data_ptr(), kv.nbytes)
