"""Price one step from first principles: a roofline per phase, plus fixed overheads.

A step runs every scheduled token through the model once. Two phases dominate:

- linear layers (QKV/O projections, MLP, and the LM head on each request's last token, as the
  runner computes it): the weights are read once
  per step for the whole batch, FLOPs are 2 * params per token. Small batches are memory-bound
  (decode), large token counts compute-bound (prefill).
- attention: each request reads its own K/V (context length * K/V bytes per token) and does
  4 * layers * heads * head_dim FLOPs per (query, key) pair; a prefill chunk of length c starting
  at s sees c * (s + (c+1)/2) pairs (causal), so prefill attention is quadratic in chunk length.

Each phase costs max(bytes / (bandwidth * eff), FLOPs / (peak * eff)); the step adds a fixed
overhead, a per-layer overhead (launches), a per-request overhead (host bookkeeping) and, under
tensor parallelism, two all-reduces of the activations per layer. With tp GPUs each holds 1/tp of
the weights, heads and K/V, so bytes and FLOPs per GPU divide by tp.
"""
from __future__ import annotations

from dataclasses import dataclass

from iterserve.kv.spec import num_blocks_for
from iterserve.scheduler.output import SchedulerOutput
from iterserve.sim.hardware import HardwareSpec
from iterserve.sim.model_spec import ModelSpec


@dataclass(slots=True)
class StepBreakdown:
    linear_s: float
    attention_s: float
    overhead_s: float
    allreduce_s: float
    transfer_s: float  # swap and block copies before the step

    @property
    def total_s(self) -> float:
        return self.linear_s + self.attention_s + self.overhead_s + self.allreduce_s + self.transfer_s


class CostModel:
    """All per-step constants are computed once here, so pricing a step is a loop over requests."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int = 1):
        if tp < 1 or model.num_heads % tp or model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ValueError(f"tensor parallel size {tp} must divide the model's heads "
                             f"({model.num_heads} query, {model.num_kv_heads} K/V)")
        self.model, self.hw, self.tp = model, hw, tp
        b = model.dtype_bytes
        self.mem_bw = hw.mem_bandwidth * hw.mem_efficiency
        self.kv_bw = hw.mem_bandwidth * hw.kv_mem_efficiency
        self.linear_flops_rate = hw.peak_flops * hw.flops_efficiency
        self.attn_flops_rate = hw.peak_flops * hw.attn_efficiency
        # bytes of weights streamed per step (the embedding is a gather of T rows: not streamed)
        self.weight_bytes_per_step = (model.num_layers * model.layer_params + model.lm_head_params) * b / tp
        self.flops_per_token = 2 * model.num_layers * model.layer_params / tp
        self.flops_per_logit_row = 2 * model.lm_head_params / tp
        # activations read+written per token per layer: residual, qkv, attn out, mlp in/out
        qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
        act = 4 * model.hidden_size + qkv / tp + (3 if model.gated_mlp else 2) * model.intermediate_size / tp
        self.act_bytes_per_token = model.num_layers * act * b
        # K/V replicated when tp > kv heads (GQA), else split
        self.kv_bytes_per_token = model.kv_bytes_per_token / min(tp, model.num_kv_heads)
        self.attn_flops_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim / tp
        self.fixed_overhead = hw.step_overhead_s + model.num_layers * hw.layer_overhead_s
        self.mixed = hw.mixed_step_overhead_s or hw.mixed_seq_overhead_s  # 0 on the GPU presets: skipped
        self.allreduce_bytes_per_token = (2 * (tp - 1) / tp) * model.hidden_size * b
        self.allreduce_count = 2 * model.num_layers if tp > 1 else 0

    # ------------------------------------------------------------ core

    def step_time(self, q_lens: list[int], ctx_lens: list[int]) -> float:
        """q_lens[i] new tokens of request i, whose context is ctx_lens[i] tokens after the step."""
        return self.breakdown(q_lens, ctx_lens).total_s

    def breakdown(self, q_lens: list[int], ctx_lens: list[int],
                  swap_blocks: int = 0, block_size: int = 16) -> StepBreakdown:
        if not q_lens:
            return StepBreakdown(0.0, 0.0, 0.0, 0.0, self.transfer_time(swap_blocks, block_size))
        tokens = sum(q_lens)
        linear_bytes = self.weight_bytes_per_step + tokens * self.act_bytes_per_token
        linear_flops = tokens * self.flops_per_token + len(q_lens) * self.flops_per_logit_row
        linear = max(linear_bytes / self.mem_bw, linear_flops / self.linear_flops_rate)
        # (query, key) pairs: a decode token sees its whole context; a chunk is causal within itself.
        # K/V of every context token is read once; the new tokens' K/V are also written.
        decode, prompt = [0, 0.0], [0, 0.0]  # [context + new tokens, pairs]
        for q, ctx in zip(q_lens, ctx_lens):
            part = decode if q == 1 else prompt
            part[0] += ctx + q
            part[1] += ctx if q == 1 else q * (ctx - q + (q + 1) / 2)
        attention = self.attention_time(decode[0], decode[1], prompt[0], prompt[1])
        overhead = self.fixed_overhead + len(q_lens) * self.hw.seq_overhead_s
        if self.mixed and decode[0] and prompt[0]:
            overhead += self.mixed_overhead(sum(q == 1 for q in q_lens))
        allreduce = 0.0
        if self.allreduce_count:
            allreduce = self.allreduce_count * (self.hw.allreduce_latency_s + tokens
                                                * self.allreduce_bytes_per_token / self.hw.interconnect_bandwidth)
        return StepBreakdown(linear, attention, overhead, allreduce,
                             self.transfer_time(swap_blocks, block_size))

    def attention_time(self, decode_kv: int, decode_pairs: float, prompt_kv: int, prompt_pairs: float) -> float:
        """K/V tokens touched and (query, key) pairs of the step's decode rows and prompt chunks. One fused
        kernel (a GPU's varlen attention) is priced as one roofline; separate kernels one after the
        other (the CPU path) as two."""
        f, rate, bw = self.attn_flops_per_pair, self.attn_flops_rate, self.kv_bw
        if self.hw.fused_attention:
            return max((decode_kv + prompt_kv) * self.kv_bytes_per_token / bw, (decode_pairs + prompt_pairs) * f / rate)
        return (max(decode_kv * self.kv_bytes_per_token / bw, decode_pairs * f / rate)
                + max(prompt_kv * self.kv_bytes_per_token / bw, prompt_pairs * f / rate))

    def mixed_overhead(self, decode_rows: int) -> float:
        """What a step with both decode rows and prompt chunks costs beyond its parts (a profile field)."""
        return self.hw.mixed_step_overhead_s + decode_rows * self.hw.mixed_seq_overhead_s

    def transfer_time(self, swap_blocks: int, block_size: int) -> float:
        """Swap moves blocks over the host link (each GPU its own shard, in parallel)."""
        return swap_blocks * block_size * self.kv_bytes_per_token / self.hw.host_link_bandwidth

    def plan_time(self, plan: SchedulerOutput) -> float:
        """The hot path of the simulator: one pass over the scheduled requests."""
        tokens = n = decode_kv = prompt_kv = 0
        decode_pairs = prompt_pairs = 0.0
        for s in plan.scheduled:
            q = len(s.token_ids)
            tokens += q
            n += 1
            if q == 1:
                decode_kv += s.start_pos + 2
                decode_pairs += s.start_pos + 1
            else:
                prompt_kv += s.start_pos + 2 * q
                prompt_pairs += q * (s.start_pos + (q + 1) / 2)
        t = 0.0
        if n:
            linear = max((self.weight_bytes_per_step + tokens * self.act_bytes_per_token) / self.mem_bw,
                         (tokens * self.flops_per_token + n * self.flops_per_logit_row) / self.linear_flops_rate)
            attention = self.attention_time(decode_kv, decode_pairs, prompt_kv, prompt_pairs)
            t = linear + attention + self.fixed_overhead + n * self.hw.seq_overhead_s
            if self.mixed and decode_kv and prompt_kv:
                t += self.mixed_overhead(sum(len(s.token_ids) == 1 for s in plan.scheduled))
            if self.allreduce_count:
                t += self.allreduce_count * (self.hw.allreduce_latency_s + tokens
                                             * self.allreduce_bytes_per_token / self.hw.interconnect_bandwidth)
        if plan.swap_out or plan.swap_in:
            t += self.transfer_time(len(plan.swap_out) + len(plan.swap_in), plan.block_size)
        return t

    # ------------------------------------------------------------ convenience

    def decode_step_time(self, batch_size: int, context_len: int) -> float:
        """One decode step of `batch_size` requests, each with `context_len` tokens of context."""
        return self.step_time([1] * batch_size, [context_len] * batch_size)

    def prefill_time(self, prompt_len: int, batch_size: int = 1) -> float:
        return self.step_time([prompt_len] * batch_size, [prompt_len] * batch_size)

    # ------------------------------------------------------------ memory

    def activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Peak activation memory of the largest step, as a GPU engine's profiling run would find:
        the widest per-token tensors (qkv + the MLP's intermediate) plus fp32 logits per sampled row."""
        m = self.model
        widest = (2 * m.hidden_size + (2 if m.gated_mlp else 1) * m.intermediate_size / self.tp) * m.dtype_bytes
        return int(max_num_batched_tokens * widest + max_num_seqs * m.vocab_size * 4)

    def num_kv_blocks(self, block_size: int = 16, gpu_memory_utilization: float = 0.9,
                      max_num_batched_tokens: int = 2048, max_num_seqs: int = 256) -> int:
        """(memory * utilization - weights - activations - runtime) / bytes per block, per GPU."""
        free = (self.hw.memory_bytes * gpu_memory_utilization - self.model.weight_bytes / self.tp
                - self.activation_bytes(max_num_batched_tokens, max_num_seqs) - self.hw.reserved_bytes)
        block_bytes = block_size * self.kv_bytes_per_token
        if free < block_bytes:
            raise ValueError(f"{self.model.name} (tp={self.tp}) does not fit on {self.hw.name}: "
                             f"weights {self.model.weight_bytes / self.tp / 1e9:.1f} GB per GPU of "
                             f"{self.hw.memory_bytes * gpu_memory_utilization / 1e9:.1f} GB usable")
        return num_blocks_for(free, block_bytes)
