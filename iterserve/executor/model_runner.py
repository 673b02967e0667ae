"""ModelRunner: a scheduler plan in, sampled tokens out, on the real model.

execute(plan): block swaps/copies -> flat inputs (loops over requests, never tokens) -> model ->
sampler. Everything per token is built with numpy/torch ops over whole requests.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from iterserve.config import EngineConfig
from iterserve.executor.sampler import make_batch, sample
from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.llama import LlamaModel
from iterserve.model.loader import default_model_path, load_model_config, load_tokenizer, load_weights
from iterserve.scheduler.output import SchedulerOutput, StepResult

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_bf16() -> bool:
    """avx512_bf16 or AMX: bf16 matmuls run natively, at half the weight bytes of float32."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        path = config.model or default_model_path()
        self.model_config = cfg = load_model_config(path)
        self.tokenizer = load_tokenizer(path)
        self.eos_token_id = self._eos_id()
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.block_size = config.block_size
        self.model = LlamaModel(cfg, load_weights(path, cfg, self.dtype, self.device), config.block_size,
                                max_positions=max(self.max_model_len, cfg.max_position_embeddings))
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self.bytes_per_block = 2 * cfg.num_layers * config.block_size * cfg.num_kv_heads * cfg.head_dim * elem
        self.num_kv_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory // self.bytes_per_block)
        self.num_host_blocks = config.swap_space // self.bytes_per_block
        self.kv_cache = self._alloc_kv(self.num_kv_blocks, self.device)
        self.host_kv_cache = self._alloc_kv(self.num_host_blocks, torch.device("cpu"))
        self._generators: dict[str, torch.Generator] = {}

    def _alloc_kv(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        c = self.model_config
        shape = (c.num_layers, 2, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)

    def _eos_id(self) -> int:
        ids = list(self.model_config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        return ids[0] if ids else (tok_eos if tok_eos is not None else -1)

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the model's and the tokenizer's (they may differ)."""
        ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------ one step

    def execute(self, plan: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        self._move_blocks(plan)
        for rid in plan.finished_ids:
            self._generators.pop(rid, None)
        if not plan.scheduled:
            return StepResult(sampled=[], logprobs=None, step_time=time.perf_counter() - t0)
        with torch.inference_mode():
            inputs = self._prepare(plan)
            logits = self.model.forward(*inputs)
            sampled, logprobs = self._sample(plan, logits)
        return StepResult(sampled=sampled, logprobs=logprobs, step_time=time.perf_counter() - t0)

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        """Whole blocks across all layers: kv[:, :, block] is every layer's K and V of that block."""
        if plan.swap_out:
            src, dst = zip(*plan.swap_out)
            self.host_kv_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)].to("cpu")
        if plan.swap_in:
            src, dst = zip(*plan.swap_in)
            self.kv_cache[:, :, list(dst)] = self.host_kv_cache[:, :, list(src)].to(self.device)
        if plan.copy_blocks:
            src, dst = zip(*plan.copy_blocks)
            self.kv_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)]

    def _prepare(self, plan: SchedulerOutput):
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
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev), query_start_loc=torch.from_numpy(starts).to(dev, torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev, torch.int32), max_query_len=max(q_lens),
            max_seq_len=max(seq_lens), query_lens_list=q_lens, seq_lens_list=seq_lens)
        # logits for every request's last token: padding seats pay for theirs too, as a padded batch would
        logits_indices = torch.from_numpy(starts[1:] - 1).to(dev)
        return (torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev), self.kv_cache, md, logits_indices)

    def _sample(self, plan: SchedulerOutput, logits: torch.Tensor):
        rows = [i for i, r in enumerate(plan.scheduled) if r.sample and not r.is_padding]
        sampled = [-1] * len(plan.scheduled)
        if not rows:
            return sampled, None
        params = [plan.scheduled[i].sampling_params for i in rows]
        gens = [self._generator(plan.scheduled[i]) for i in rows]
        batch = make_batch(params, gens, logits.shape[-1], logits.device)
        sel = logits if len(rows) == len(plan.scheduled) else logits[torch.tensor(rows, device=logits.device)]
        tokens, lps = sample(sel, batch)
        logprobs = [None] * len(plan.scheduled) if lps is not None else None
        for j, i in enumerate(rows):
            sampled[i] = tokens[j]
            if lps is not None:
                logprobs[i] = lps[j]
        return sampled, logprobs

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
