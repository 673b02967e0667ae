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
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from iterserve.config import CPU_KV_CACHE_MEMORY, EngineConfig
from iterserve.executor.base import KVCacheSpec, kv_head_width, num_blocks_for
from iterserve.executor.cuda_graphs import CudaGraphRunner, DecodeInputs
from iterserve.executor.dtypes import kv_dtype_name, pick_device, pick_dtype, storage_dtype
from iterserve.executor.kv_pool import gather_blocks, lazy_zeros, pool_on_huge_pages, populate_pool, scatter_blocks
from iterserve.executor.logits_processors import make_adjust
from iterserve.executor.model_inputs import _hidden_rows, _logits_rows, _num_hidden_rows, prepare_inputs
from iterserve.executor.request_state import RequestStates
from iterserve.executor.runner_sampling import (_drafts, _prompt_logprobs, _row_index, _sampling_rows,
                                                _verify_greedy, _verify_random)
from iterserve.executor.sampler import make_batch, sample
from iterserve.model.attention import in_pairs, pairs_to_rows, rows_to_pairs
from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.llama import LlamaModel
from iterserve.model import cpu_paths, weight_cache
from iterserve.model.cpu_kernels import prebuild
from iterserve.model.loader import ModelArch, default_model_path
from iterserve.model.lora import LoRASlots
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import ScheduledRequest, SchedulerOutput, StepResult

logger = logging.getLogger("iterserve.executor")
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


def _weights_line(asked: str | None, served: str | None, path: str | None) -> str:
    """The start line's word on the weights: what they are served as, and why where --quantization auto chose."""
    what = served or "floats"
    if asked == "auto" and served is not None:
        return f"{what} (what {os.path.basename(path)} holds: --quantization auto; none for floats)"
    return what


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
            if cc.populate_kv_cache:
                populate_pool(self.kv_cache)
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
            lora = None if not self.lora_adapters else self.lora.batch(  # no per-step lists while none is loaded
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
        return prepare_inputs(plan, nrows, self.block_size, self.kv_cache, self.device)

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


def _load_tokenizer_aside(path: str) -> Future:
    """The tokenizer, loaded on a worker thread while this one reads and packs the weights: it parses
    files and runs no torch op (a second thread running ops would start a second OpenMP pool)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="iterserve-tokenizer")
    future = pool.submit(weight_cache.load_tokenizer, path)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future
