"""Llama-family decoder (Llama 2/3, SmolLM, Mistral; Qwen2 via the q/k/v bias switch) on a flat batch.

Every op except attention runs once over all T scheduled tokens of the step. Plain tensors, no
nn.Module: there is nothing to train, and the per-module call overhead matters at 30 layers x
small batches. Q/K/V are one matmul and gate/up another (one weight read, one kernel launch each).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.model import cpu_kernels
from iterserve.model.attention_backend import attention_backend
from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.loader import ModelArch
from iterserve.model.quant import Weight, check_supported, linear, pack_float, quantize


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # [(H + 2 Hkv) * D, hidden]; float (oneDNN-packed on CPU) or int8/int4 (quant.py)
    qkv_bias: torch.Tensor | None
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight


def rope_inv_freq(cfg: ModelArch, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies, with llama3 / linear scaling as transformers computes them."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "llama3":
        inv = _llama3_scale(inv, sc)
    if rope_freqs is not None:  # GGUF stores llama3 scaling as per-frequency divisors
        inv = inv / rope_freqs.to(torch.float64)
    return inv.float()


def _llama3_scale(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_len = sc.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(is_mid, mid, scaled)


class LlamaModel:
    def __init__(self, cfg: ModelArch, weights: dict[str, torch.Tensor], block_size: int,
                 max_positions: int | None = None, quantization: str | None = None):
        self.cfg, self.block_size = cfg, block_size
        w = weights
        self.dtype, self.device = w["model.embed_tokens.weight"].dtype, w["model.embed_tokens.weight"].device
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed) if not cfg.tie_word_embeddings else self.embed
        self.norm = w["model.norm.weight"]
        self.layers = [self._layer(w, i) for i in range(cfg.num_layers)]
        # the embedding stays a plain tensor for lookups; the LM head (tied or not) is packed apart
        if quantization is not None:
            check_supported(quantization, self.device)
            self.lm_head = quantize(self.lm_head, "int8")  # int8 in both modes, as the GGUF keeps it Q8_0
        else:
            self.lm_head = pack_float(self.lm_head)
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                weight = getattr(layer, name)
                setattr(layer, name, quantize(weight, quantization) if quantization else pack_float(weight))
        self.scale = cfg.head_dim ** -0.5
        self.attention = attention_backend(self.device, block_size, self.dtype)  # torch or triton
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        n = max_positions or cfg.max_position_embeddings
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), rope_inv_freq(cfg, w.get("rope_freqs")))
        emb = torch.cat([freqs, freqs], dim=-1)  # rotate-half layout: dim i pairs with i + D/2
        self.cos = emb.cos().to(self.device, self.dtype)
        self.sin = emb.sin().to(self.device, self.dtype)
        # fused C++ RMSNorm / rotary / silu-and-mul on CPU where they build (cpu_ops.cpp); torch ops otherwise
        self.cpu_ops = self.device.type == "cpu" and self.dtype in cpu_kernels.DTYPES and \
            cpu_kernels.elementwise_ops() is not None

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        # weights stay [out, in]: a pre-transposed [in, out] copy used as x @ W was no faster on CPU
        # bf16 (measured at 1, 64 and 512 rows, 1 thread); what pays is oneDNN's own layout (pack_float)
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = None
        if self.cfg.attention_bias:
            bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
        return LayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]).contiguous(),
            qkv_bias=bias, o=w[a + "o_proj.weight"].contiguous(),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]).contiguous(),
            down=w[m + "down_proj.weight"].contiguous())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T]; kv_cache [L, 2, blocks, block_size, Hkv, D] -> logits [S, vocab] in the
        model's dtype (the sampler widens them where it needs to: a greedy batch takes argmax as is)."""
        plan = self.attention.prepare(attn_metadata)
        cos_sin = None if self.cpu_ops else (self.cos[positions], self.sin[positions])
        x, delta = F.embedding(input_ids, self.embed), None
        for i, layer in enumerate(self.layers):
            x, delta = self._layer_forward(x, delta, layer, kv_cache[i], plan, positions, cos_sin)
        h = self._rms_norm(delta.index_select(0, logits_indices), self.norm, x.index_select(0, logits_indices))
        return linear(h, self.lm_head)

    __call__ = forward

    def _layer_forward(self, x, delta, layer: LayerWeights, layer_cache, plan, positions, cos_sin):
        """x: the residual stream; delta: the last layer's MLP output, not yet added to it (the add is
        fused into this layer's first norm). Returns the same pair for the next layer."""
        t, cfg = x.shape[0], self.cfg
        h = self._rms_norm(x, layer.input_norm) if delta is None else self._rms_norm(delta, layer.input_norm, x)
        qkv = linear(h, layer.qkv, layer.qkv_bias)
        q, k = self._rotate(qkv, positions, cos_sin)
        v = qkv[:, self.q_size + self.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)
        attn = self.attention.attend(q, k, v, layer_cache, plan, self.scale)
        h = self._rms_norm(linear(attn.reshape(t, self.q_size), layer.o), layer.post_norm, x)
        gate_up = linear(h, layer.gate_up)
        if self.cpu_ops:
            return x, linear(cpu_kernels.silu_mul(gate_up), layer.down)
        gate, up = gate_up.chunk(2, dim=-1)
        return x, linear(F.silu(gate) * up, layer.down)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """weight * normalize(x); with residual: residual += x in place first, and the sum is normalized.
        transformers' order: normalize in float32, cast back, then scale by the weight."""
        if self.cpu_ops:
            return cpu_kernels.rms_norm(x, weight, self.cfg.rms_norm_eps, residual)
        if residual is not None:
            x = residual.add_(x)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.cfg.rms_norm_eps).to(x.dtype)

    def _rotate(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding on the q and k heads of qkv [T, (H + 2 Hkv) * D] -> q [T, H, D], k [T, Hkv, D]."""
        t, cfg = qkv.shape[0], self.cfg
        if self.cpu_ops:  # in place, cos/sin looked up per row inside
            cpu_kernels.rope_(qkv, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, self.cos, self.sin, positions)
            qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, cfg.head_dim)
        else:
            qk = _rope(qkv[:, : self.q_size + self.kv_size].view(t, -1, cfg.head_dim), *cos_sin)
        return qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
