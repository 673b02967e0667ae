"""The decoder of every supported family (docs/models.md) on a flat batch: one forward, switched by ModelArch.

Every op except attention runs once over all T scheduled tokens of the step. Plain tensors, no
nn.Module: there is nothing to train, and the per-module call overhead matters at 30 layers x
small batches. Q/K/V are one matmul and gate/up another (one weight read, one kernel launch each).

What differs between families is resolved here at construction, never per token: a norm a family
lacks is None and skipped; Gemma's (1 + weight) norms, Granite's residual and logit multipliers
are folded into the weights; each layer carries its attention window and its rope table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.model import cpu_kernels, cpu_packing
from iterserve.model.attention_backend import attention_backend
from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.cpu_decode import DecodeLayers
from iterserve.model.loader import ModelArch
from iterserve.model.lora import LayerLoRA, LoRABatch
from iterserve.model.quant import (Codes, Int8Codes, Int8Weight, PanelWeight, Weight, cat_codes, check_supported,
                                   linear, pack_float, quantize, weight_only_on_panels)


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor | None  # before attention (None: OLMo 2)
    qkv: Weight  # [(H + 2 Hkv) * D, hidden]; float (oneDNN-packed on CPU) or int8/int4 (quant.py)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D] per head or [H * D] whole (ModelArch.qk_norm); None: none
    k_norm: torch.Tensor | None
    o: Weight
    attn_out_norm: torch.Tensor | None  # on attention's output (Gemma 2/3, OLMo 2)
    mlp_norm: torch.Tensor | None  # before the MLP (None: OLMo 2)
    gate_up: Weight | None  # [2 * intermediate, hidden]; None in a routed-experts layer
    down: Weight | None
    mlp_out_norm: torch.Tensor | None  # on the MLP's output (Gemma 2/3, OLMo 2)
    window: int  # attention window; 0: the whole context
    rope: int  # index into LlamaModel.rope_tables
    router: torch.Tensor | None = None  # [experts, hidden] (Qwen3-MoE, Mixtral)
    experts: list[tuple[Weight, Weight]] | None = None  # each expert's (gate_up, down)


def rope_cos_sin(cfg: ModelArch, n: int, theta: float, scaling: dict | None,
                 rope_freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [n, D] (rotate-half layout), with linear / llama3 / longrope scaling as
    transformers computes them. longrope takes the short factors below the original context and the
    long ones from there, per position (transformers switches a whole sequence once it is longer)."""
    d = cfg.head_dim
    base = theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    sc = scaling or {}
    kind, mscale = sc.get("rope_type", sc.get("type")), 1.0
    pos = torch.arange(n, dtype=torch.float32)
    if kind == "longrope":
        short = (1.0 / (torch.tensor(sc["short_factor"], dtype=torch.float64) * base)).float()
        long = (1.0 / (torch.tensor(sc["long_factor"], dtype=torch.float64) * base)).float()
        freqs = torch.where(pos[:, None] < sc["original_max_position_embeddings"],
                            torch.outer(pos, short), torch.outer(pos, long))
        mscale = sc["attention_factor"]
    else:
        inv = 1.0 / base
        if kind == "linear":
            inv = inv / sc["factor"]
        elif kind == "llama3":
            inv = _llama3_scale(inv, sc)
        if rope_freqs is not None:  # GGUF stores llama3 scaling as per-frequency divisors
            inv = inv / rope_freqs.to(torch.float64)
        freqs = torch.outer(pos, inv.float())
    emb = torch.cat([freqs, freqs], dim=-1)  # dim i pairs with i + D/2
    return emb.cos() * mscale, emb.sin() * mscale


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
                 max_positions: int | None = None, quantization: str | None = None, tp=None,
                 dtype: torch.dtype | None = None, panel_cache=None):
        """tp: a rank's collectives under tensor parallelism (model/sharding.py TensorParallel): cfg and
        weights are then that rank's shard, and the o/down outputs and the logits cross ranks.
        dtype: the arithmetic's, where it differs from the weights' (--dtype bf16-storage: bfloat16
        weights read by the CPU panel kernel under float32 activations); default: the weights'.
        panel_cache: a panel_cache.PanelCache, whose panels stand in for the float weights they were
        packed from (those are then never read); None: every weight is packed here."""
        self.cfg, self.block_size, self.tp = cfg, block_size, tp
        w = weights
        norm = w["model.norm.weight"]  # every family has it, in the weights' dtype; the embedding may go unread
        self.dtype, self.device, self.weight_dtype = dtype or norm.dtype, norm.device, norm.dtype
        mixed = self.dtype != norm.dtype
        quantized_off_panels = quantization is not None and not weight_only_on_panels(quantization)
        if mixed and (quantized_off_panels or self.dtype != torch.float32 or norm.dtype != torch.bfloat16):
            raise ValueError(f"float32 arithmetic over bfloat16 weights only, without --quantization or with "
                             f"int8/int4 on the kernel's panels (AVX2); got {norm.dtype} weights, {self.dtype} "
                             f"arithmetic, quantization {quantization}")
        n = max_positions or cfg.max_position_embeddings
        # Gemma's embedding scale, rounded to the compute dtype as transformers does; None: 1
        self.embed_scale = None if cfg.embedding_multiplier == 1.0 else \
            torch.tensor(cfg.embedding_multiplier, dtype=self.dtype, device=self.device)
        self.norm = self._norm_weight(norm)
        # a window as long as the longest sequence masks nothing: those layers attend as global ones
        window = cfg.sliding_window if cfg.sliding_window < n else 0
        self.rope_tables = [rope_cos_sin(cfg, n, cfg.rope_theta, cfg.rope_scaling, w.get("rope_freqs"))]
        if cfg.rope_local_theta is not None:
            self.rope_tables.append(rope_cos_sin(cfg, n, cfg.rope_local_theta, None))
        self.rope_tables = [(c.to(self.device, self.dtype), s.to(self.device, self.dtype)) for c, s in self.rope_tables]
        if quantization is not None:
            check_supported(quantization, self.device)

        def pack(name: str, read, mode: str | None = quantization) -> Weight:
            """The weight `name` as the model runs it (quantized in `mode`), from read() (its float tensor) or
            from the cache, which holds the panels of the C++ kernel (panel_cache.PanelCache)."""
            build = (lambda: quantize(read(), mode, norm.dtype)) if mode else (  # noqa: E731
                lambda: pack_float(_floats(read(), norm.dtype), panels=mixed))
            return build() if panel_cache is None else panel_cache.weight(name, build)

        # each weight packed as soon as it is read: its float copy goes before the next one comes
        self.layers = [self._layer(w, i, window, pack) for i in range(cfg.num_layers)]
        # the LM head is the embedding where tied (or absent); unscaled, its rows are the embedding's
        head_name = "lm_head.weight" if "lm_head.weight" in w and not cfg.tie_word_embeddings else \
            "model.embed_tokens.weight"
        tied = head_name == "model.embed_tokens.weight" and cfg.logits_multiplier == 1.0
        # Granite divides the logits: the same as dividing the head
        head = lambda: self._scaled(w[head_name], cfg.logits_multiplier)  # noqa: E731
        # int8 in every mode, as the GGUF keeps it Q8_0 (w8a8's own kernel: PyTorch's weight-only int8
        # is slower than bf16 at a large batch, and a 49k-row head is a fifth of the weights)
        self.lm_head = pack("lm_head", head, "int8" if quantization in ("int8", "int4") else quantization)
        # lookups read a tied head's float panels or torch-layout int8 rows: the vocabulary's rows held once, not twice
        float_head = isinstance(self.lm_head, PanelWeight) and self.lm_head.panels.is_floating_point()
        int8_head = isinstance(self.lm_head, Int8Weight) and not self.lm_head.panels
        self.embed = None if tied and float_head else Int8Codes(self.lm_head.qweight, self.lm_head.scales) \
            if tied and int8_head else _table(w["model.embed_tokens.weight"])
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        self.attention = attention_backend(self.device, block_size, self.dtype, cfg.head_dim,
                                           cfg.num_heads)  # torch or triton
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # fused C++ RMSNorm / rotary / silu-and-mul on CPU where they build (cpu_ops.cpp); torch ops otherwise
        self.cpu_ops = self.device.type == "cpu" and self.dtype in cpu_kernels.DTYPES and \
            cpu_kernels.elementwise_ops() is not None
        self.silu = cfg.hidden_act == "silu"  # else gelu_tanh
        self.decode_layers = DecodeLayers.build(self)  # decode-only steps' layer loop in C, where it runs them

    def _norm_weight(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        """A norm's weight in the arithmetic's dtype (the fused kernels take one dtype), offset where the family does."""
        if weight is None:
            return None
        weight = weight.to(self.dtype)
        return weight + self.cfg.norm_weight_offset if self.cfg.norm_weight_offset else weight

    def _layer(self, w: dict[str, torch.Tensor], i: int, window: int, pack) -> LayerWeights:
        # weights stay [out, in]: a pre-transposed [in, out] copy used as x @ W was no faster on CPU
        # bf16 (measured at 1, 64 and 512 rows, 1 thread); what pays is a packed layout (pack_float)
        cfg, p = self.cfg, f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]).to(self.dtype)
        norms = {"pre": ("input_layernorm", None, "post_attention_layernorm", None),
                 "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                              "post_feedforward_layernorm"),
                 "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm")}[cfg.norm_placement]
        attn_norm, attn_out_norm, mlp_norm, mlp_out_norm = (self._norm_weight(w[p + k + ".weight"]) if k else None
                                                            for k in norms)
        qk = cfg.qk_norm != "none"
        gate_up = down = router = experts = None
        if cfg.num_experts and (not cfg.moe_layers or cfg.moe_layers[i]):
            router = w[m + "gate.weight"].to(self.dtype)
            experts = [self._mlp_weights(w, f"{m}experts.{j}.", pack) for j in range(cfg.num_experts)]
        else:
            gate_up, down = self._mlp_weights(w, m, pack)
        windowed = window and cfg.sliding_layers[i]
        return LayerWeights(
            attn_norm=attn_norm,
            qkv=pack(a + "qkv", lambda: _fused(w, a, FUSED_QKV)),
            qkv_bias=bias, q_norm=self._norm_weight(w[a + "q_norm.weight"]) if qk else None,
            k_norm=self._norm_weight(w[a + "k_norm.weight"]) if qk else None,
            # Granite scales each block's output: folded into its last linear
            o=pack(a + "o", lambda: self._scaled(w[a + "o_proj.weight"], cfg.residual_multiplier)),
            attn_out_norm=attn_out_norm, mlp_norm=mlp_norm,
            gate_up=gate_up, down=down, mlp_out_norm=mlp_out_norm, window=window if windowed else 0,
            rope=1 if cfg.rope_local_theta is not None and cfg.sliding_layers and cfg.sliding_layers[i] else 0,
            router=router, experts=experts)

    def _mlp_weights(self, w: dict[str, torch.Tensor], prefix: str, pack) -> tuple[Weight, Weight]:
        return (pack(prefix + "gate_up", lambda: _fused(w, prefix, FUSED_GATE_UP)),
                pack(prefix + "down", lambda: self._scaled(w[prefix + "down_proj.weight"],
                                                           self.cfg.residual_multiplier)))

    @staticmethod
    def _scaled(weight: torch.Tensor | Codes, multiplier: float) -> torch.Tensor | Codes:
        if not isinstance(weight, torch.Tensor):  # a GGUF's codes (quant.Int4Codes / Int8Codes)
            return weight.scaled(multiplier) if multiplier != 1.0 else weight
        return weight * multiplier if multiplier != 1.0 else weight.contiguous()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata, logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor | None = None, lora: LoRABatch | None = None):
        """input_ids/positions [T]; kv_cache [L, 2, blocks, block_size, Hkv, D] -> logits [S, vocab] in the
        model's dtype (the sampler widens them where it needs to: a greedy batch takes argmax as is).
        With hidden_indices: (logits, the final-norm hidden states of those rows), for pooling.
        lora: the step's LoRA adapters by rows (model/lora.py); None: the base weights alone."""
        x, delta = self._residual(input_ids, positions, kv_cache, attn_metadata, lora)
        logits = self._logits(self._rms_norm(delta.index_select(0, logits_indices), self.norm,
                                             x.index_select(0, logits_indices)))
        if hidden_indices is None:
            return logits
        return logits, self._rms_norm(delta.index_select(0, hidden_indices), self.norm, x.index_select(0, hidden_indices))

    def _residual(self, input_ids, positions, kv_cache, attn_metadata, lora=None):
        """Every layer over the step's tokens: the residual stream and the last MLP output not yet added to it."""
        plan = self.attention.prepare(attn_metadata)
        cos_sin = None if self.cpu_ops else [(c[positions], s[positions]) for c, s in self.rope_tables]
        x, delta = self._embed(input_ids), None
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.decode_layers is not None and self.decode_layers.runs(plan, kv_cache, lora):
            x, delta = self.decode_layers(x, positions, kv_cache, plan, lora)
        else:
            for i, layer in enumerate(self.layers):
                layer_lora = None if lora is None else lora.layer(i)
                x, delta = self._layer_forward(x, delta, layer, kv_cache[i], plan, positions, cos_sin, layer_lora)
        return x, delta

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = linear(h, self.lm_head)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits)
        if self.cfg.final_logit_softcap:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    __call__ = forward

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of input_ids, in the arithmetic's dtype: from the embedding, or gathered from the tied
        head's panels."""
        if isinstance(self.embed, Int8Codes):  # int8 rows: dequantized as looked up
            x = self.embed.rows(input_ids, self.dtype)
        elif self.embed is not None:
            x = F.embedding(input_ids, self.embed)
        else:
            x = cpu_packing.panel_rows(self.lm_head.panels, input_ids)
        return x.to(self.dtype)

    def _layer_forward(self, x, delta, layer: LayerWeights, layer_cache, plan, positions, cos_sin,
                       lora: LayerLoRA | None = None):
        """x: the residual stream; delta: the last layer's MLP output, not yet added to it (the add is
        fused into this layer's first norm). Returns the same pair for the next layer.
        lora: this layer's LoRA adapters under the step's grouping, or None."""
        t, cfg = x.shape[0], self.cfg
        h = self._add_norm(x, delta, layer.attn_norm)
        qkv = linear(h, layer.qkv, layer.qkv_bias)
        if lora is not None:
            lora.add(qkv, h, "qkv")
        if layer.q_norm is not None:
            self._qk_norm(qkv, layer)
        q, k = self._rotate(qkv, positions, cos_sin, layer.rope)
        v = qkv[:, self.q_size + self.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)
        attn = self.attention.attend(q, k, v, layer_cache, plan, self.scale, layer.window, cfg.attn_logit_softcap)
        attn = attn.reshape(t, self.q_size)
        out = linear(attn, layer.o)
        if lora is not None:
            lora.add(out, attn, "o")
        out = self._reduce(out)
        if layer.attn_out_norm is not None:
            out = self._rms_norm(out, layer.attn_out_norm)
        h = self._add_norm(x, out, layer.mlp_norm)
        out = self._mlp(h, layer.gate_up, layer.down, lora) if layer.experts is None else self._moe(h, layer)
        out = self._reduce(out)
        if layer.mlp_out_norm is not None:
            out = self._rms_norm(out, layer.mlp_out_norm)
        return x, out

    def _mlp(self, h: torch.Tensor, gate_up_w: Weight, down_w: Weight, lora: LayerLoRA | None = None) -> torch.Tensor:
        gate_up = linear(h, gate_up_w)
        if lora is not None:
            lora.add(gate_up, h, "gate_up")
        if self.cpu_ops and self.silu:
            act = cpu_kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = (F.silu(gate) if self.silu else F.gelu(gate, approximate="tanh")) * up
        out = linear(act, down_w)
        if lora is not None:
            lora.add(out, act, "down")
        return out

    def _moe(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """Routed experts as transformers computes them: softmax over the router's logits in float32, the
        top k (renormalized where the family does), each expert run once on the rows routed to it."""
        probs = torch.softmax(F.linear(h, layer.router).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.cfg.num_experts_per_tok, dim=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():  # a loop over the experts hit, not over tokens
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            gate_up, down = layer.experts[e]
            out.index_add_(0, rows, self._mlp(h[rows], gate_up, down) * weights[rows, slot, None])
        return out

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel output is one rank's partial sum under tensor parallelism."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None) -> torch.Tensor:
        """x += delta (when given), then weight * normalize(x), fused; without a weight (OLMo 2), x itself."""
        if weight is None:
            return x if delta is None else x.add_(delta)
        return self._rms_norm(x, weight) if delta is None else self._rms_norm(delta, weight, x)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """weight * normalize(x); with residual: residual += x in place first, and the sum is normalized.
        transformers' order: normalize in float32, cast back, then scale by the weight."""
        if self.cpu_ops:
            return cpu_kernels.rms_norm(x, weight, self.cfg.rms_norm_eps, residual)
        if residual is not None:
            x = residual.add_(x)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.cfg.rms_norm_eps).to(x.dtype)

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights) -> None:
        """RMSNorm of q and k in place in qkv, before rope: over each head (rows of D) or over all heads."""
        t, qs, ks = qkv.shape[0], self.q_size, self.kv_size
        width = self.cfg.head_dim if self.cfg.qk_norm == "head" else None
        for lo, hi, weight in ((0, qs, layer.q_norm), (qs, qs + ks, layer.k_norm)):
            part = qkv[:, lo:hi].reshape(-1, width or hi - lo).contiguous()  # a copy: rows of qkv are wider
            qkv[:, lo:hi] = self._rms_norm(part, weight).view(t, hi - lo)

    def _rotate(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin,
                table: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary embedding on the q and k heads of qkv [T, (H + 2 Hkv) * D] -> q [T, H, D], k [T, Hkv, D]."""
        t, cfg = qkv.shape[0], self.cfg
        if self.cpu_ops:  # in place, cos/sin looked up per row inside
            cos, sin = self.rope_tables[table]
            cpu_kernels.rope_(qkv, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, cos, sin, positions)
            qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, cfg.head_dim)
        else:
            qk = _rope(qkv[:, : self.q_size + self.kv_size].view(t, -1, cfg.head_dim), *cos_sin[table])
        return qk[:, : cfg.num_heads], qk[:, cfg.num_heads:]


# the linears the model runs as one matmul: (fused name, its parts in row order)
FUSED_QKV = ("qkv_proj.weight", ("q_proj.weight", "k_proj.weight", "v_proj.weight"))
FUSED_GATE_UP = ("gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight"))


def _fused(w, prefix: str, fused: tuple[str, tuple[str, ...]]) -> torch.Tensor:
    """The fused weight as given (the weight cache stores it so: model/weight_cache.py), or its parts concatenated."""
    name, parts = fused
    if prefix + name in w:
        return w[prefix + name].contiguous()
    joined = cat_codes([w[prefix + part] for part in parts])  # a GGUF's codes stay codes (quant.cat_codes)
    return joined.contiguous() if isinstance(joined, torch.Tensor) else joined


def _floats(w: torch.Tensor | Codes, dtype: torch.dtype) -> torch.Tensor:
    """A weight as floats: a GGUF's codes dequantized (served in floats, or in a mode that takes no codes)."""
    return w if isinstance(w, torch.Tensor) else w.dequantize(dtype)


def _table(w: torch.Tensor | Codes) -> torch.Tensor | Int8Codes:
    """The embedding lookups read: floats as given, a GGUF's codes as int8 rows (no vocab x hidden float copy)."""
    return w if isinstance(w, (torch.Tensor, Int8Codes)) else w.to_int8()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
