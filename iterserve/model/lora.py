"""Multi-LoRA serving: PEFT adapters read from disk, held in resident slots, applied to each row by its slot.

For each adapted linear y = x W^T + scale * (x A^T) B^T (PEFT's LoRA). The model runs q/k/v and
gate/up as one fused matmul each, so their adapters are stacked the same way: per layer and fused
linear, A [slots, R, in] and B [slots, R, out] with R = parts * max_rank, part j's rank rows at
j * max_rank and its output columns where the fused weight has them (B is block diagonal). The scale
is folded into B. A step's delta is one op pair per linear whatever the adapters present (punica's
BGMV as two dense matmuls): x @ A_all^T over every slot at once [T, slots * R], each row's columns
of other slots zeroed by a mask built once per step, then @ B_all [slots * R, out] added into y. The
ranks are small, so the other slots' flops cost less than a loop over groups of rows would in calls.
The C decode loop (cpu_decode.py, cpu_lora.h) reads the same stacks, per row by its slot index.
An untargeted module's part stays zero: it adds nothing.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from iterserve.executor.base import LoRANotFoundError
from iterserve.model.arch import ModelArch
from iterserve.model.lora_gguf import SUPPORTED as GGUF_SUPPORTED, Pairs, read_gguf_lora

# PEFT's module name -> (the model's fused linear, its part)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
SUPPORTED = "a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors or .bin) targeting " + \
            "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or " + GGUF_SUPPORTED
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter as read: per (layer, PEFT module) its A [r, in] and its B [out, r] times the scale."""
    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str, max_rank: int, arch: ModelArch | None = None) -> LoRAAdapter:
    """Read a PEFT LoRA directory, or a GGUF LoRA file (whose Q/K rows need the model's `arch`);
    ValueError naming what is wrong (a missing file, an unsupported option or module, a rank above max_rank)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        if arch is None:
            raise ValueError(f"LoRA adapter {name!r}: a GGUF LoRA file is read against its model's architecture")
        pairs, scale = read_gguf_lora(name, path, arch)
    else:
        pairs, scale = _read_peft(name, path)
    weights, rank = {}, 0
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_A or lora_B, not both")
        a, b = ab["A"].float(), ab["B"].float()
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module}: lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)} disagree on the rank")
        r = a.shape[0]
        if r > max_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {r}, above --max-lora-rank {max_rank}")
        weights[(layer, module)] = (a, b * scale(r))
        rank = max(rank, r)
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: {path!r} holds no LoRA weights")
    return LoRAAdapter(name, path, rank, weights)


def _read_peft(name: str, path: str) -> tuple[Pairs, Callable[[int], float]]:
    """A PEFT directory's A/B pairs by (layer, module) and its scale for a rank."""
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}; give {SUPPORTED}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {config_path!r}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {config_path!r} is not a JSON object")
    _check_config(name, config)
    pairs: Pairs = {}
    for key, tensor in _read_tensors(name, path).items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a supported "
                             f"module; give {SUPPORTED}")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    alpha = float(config.get("lora_alpha", 8))
    return pairs, (lambda r: alpha / math.sqrt(r)) if config.get("use_rslora") else (lambda r: alpha / r)


def _check_config(name: str, config: dict) -> None:
    """Refuse what PEFT can save but this forward pass does not compute (never ignore it silently)."""
    def refuse(what: str) -> ValueError:
        return ValueError(f"LoRA adapter {name!r}: {what} is not supported; give {SUPPORTED}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config['peft_type']}")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora)")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config['bias']!r}")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']}")
    if config.get("alpha_pattern"):
        raise refuse("alpha_pattern")
    targets = config.get("target_modules") or []
    if isinstance(targets, list) and not set(targets) <= set(TARGETS):
        raise refuse(f"target_modules {sorted(set(targets) - set(TARGETS))}")


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    safetensors_path, bin_path = (os.path.join(path, f) for f in ("adapter_model.safetensors", "adapter_model.bin"))
    try:
        if os.path.isfile(safetensors_path):
            from safetensors.torch import load_file
            return load_file(safetensors_path)
        if os.path.isfile(bin_path):
            return torch.load(bin_path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt file is the caller's bad input, whatever the reader raises
        raise ValueError(f"LoRA adapter {name!r}: cannot read its weights in {path!r}: {e}") from None
    raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors (or .bin) in {path!r}")


@dataclass(slots=True)
class _Fused:
    """One fused linear's shape: its input width and its parts' output widths, in row order."""
    in_features: int
    parts: tuple[int, ...]


class LoRASlots:
    """Up to max_loras resident adapters, stacked per layer and fused linear (allocated on first load).
    Load and unload run on the engine thread, between steps (engine.Engine.load_lora)."""

    def __init__(self, model, max_loras: int, max_rank: int):
        cfg = model.cfg
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = model.dtype, model.device
        self.shapes = {"qkv": _Fused(cfg.hidden_size, (model.q_size, model.kv_size, model.kv_size)),
                       "o": _Fused(model.q_size, (cfg.hidden_size,)),
                       "gate_up": _Fused(cfg.hidden_size, (cfg.intermediate_size, cfg.intermediate_size)),
                       "down": _Fused(cfg.intermediate_size, (cfg.hidden_size,))}
        # Granite folds a multiplier into o and down: their deltas take it too
        self.out_scale = {"o": cfg.residual_multiplier, "down": cfg.residual_multiplier}
        self.dense = [layer.experts is None for layer in model.layers]  # routed-experts MLPs take no LoRA
        self.num_layers, self.arch = cfg.num_layers, cfg
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slot_of: dict[str, int] = {}
        # name -> path, replaced whole on each change, never edited: other threads read it (the HTTP routes)
        self.paths: dict[str, str] = {}
        self.a: list[dict[str, torch.Tensor]] | None = None  # per layer: fused name -> [slots, R, in]
        self.b: list[dict[str, torch.Tensor]] | None = None  # per layer: fused name -> [slots, R, out]
        # slot (None: all of them) -> per layer: fused name -> (A, B) as LayerLoRA multiplies them, made once
        self._views: dict[int | None, list[dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}

    @classmethod
    def build(cls, model, model_config, tp) -> LoRASlots | None:
        """The slots with config.ModelConfig's lora_modules loaded; None under tensor parallelism, whose
        ranks hold shards of the weights an adapter would have to be split like."""
        if tp is not None:
            if model_config.lora_modules:
                raise ValueError("--lora-modules: LoRA adapters are not served under tensor parallelism")
            return None
        slots = cls(model, model_config.max_loras, model_config.max_lora_rank)
        for spec in model_config.lora_modules:
            slots.load(*spec.split("=", 1))
        return slots

    @torch.inference_mode()
    def load(self, name: str, path: str) -> None:
        if self.max_loras == 0:
            raise ValueError("LoRA is off here (--max-loras 0)")
        if name in self.slot_of:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
        if not free:
            raise ValueError(f"all --max-loras {self.max_loras} LoRA slots hold adapters "
                             f"({', '.join(self.slot_of)}): unload one first")
        adapter = read_adapter(name, path, self.max_rank, self.arch)
        self._check_fits(adapter)
        if self.a is None:
            self._allocate()
        self._install(free[0], adapter)
        self.adapters[name], self.slot_of[name] = adapter, free[0]
        self.paths = {**self.paths, name: path}

    @torch.inference_mode()
    def unload(self, name: str) -> None:
        if name not in self.slot_of:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded")
        slot = self.slot_of.pop(name)
        del self.adapters[name]
        self.paths = {k: v for k, v in self.paths.items() if k != name}
        self._clear(slot)

    def views(self, slot: int | None) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer, each fused linear's (A [K, in], B [K, out]): one slot's, or every slot's stacked."""
        if slot not in self._views:
            pick = (lambda t: t.flatten(0, 1)) if slot is None else (lambda t: t[slot])  # noqa: E731
            self._views[slot] = [{f: (pick(a[f]), pick(b[f])) for f in a} for a, b in zip(self.a, self.b)]
        return self._views[slot]

    def _clear(self, slot: int) -> None:
        for layer_a, layer_b in zip(self.a, self.b):
            for fused in layer_a:
                layer_a[fused][slot].zero_()
                layer_b[fused][slot].zero_()

    def _check_fits(self, adapter: LoRAAdapter) -> None:
        for (layer, module), (a, b) in adapter.weights.items():
            fused, part = TARGETS[module]
            shape = self.shapes[fused]
            if layer >= self.num_layers:
                raise ValueError(f"LoRA adapter {adapter.name!r} adapts layer {layer}; the model has {self.num_layers}")
            if fused in ("gate_up", "down") and not self.dense[layer]:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} is a routed-experts MLP, which "
                                 "takes no LoRA here")
            if a.shape[1] != shape.in_features or b.shape[0] != shape.parts[part]:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {layer} {module} is "
                                 f"{b.shape[0]}x{a.shape[1]}, the model's is {shape.parts[part]}x{shape.in_features}: "
                                 "an adapter of another model?")

    def _allocate(self) -> None:
        def zeros(*shape):
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        n, r = self.max_loras, self.max_rank
        self.a = [{f: zeros(n, len(s.parts) * r, s.in_features) for f, s in self.shapes.items()}
                  for _ in range(self.num_layers)]
        self.b = [{f: zeros(n, len(s.parts) * r, sum(s.parts)) for f, s in self.shapes.items()}
                  for _ in range(self.num_layers)]

    def _install(self, slot: int, adapter: LoRAAdapter) -> None:
        self._clear(slot)  # an untargeted part must add nothing, whatever a failed load left there
        for (layer, module), (a, b) in adapter.weights.items():
            fused, part = TARGETS[module]
            r, lo = a.shape[0], part * self.max_rank
            out = sum(self.shapes[fused].parts[:part])
            b = b * self.out_scale.get(fused, 1.0)
            self.a[layer][fused][slot, lo:lo + r] = a.to(self.device, self.dtype)
            self.b[layer][fused][slot, lo:lo + r, out:out + b.shape[0]] = b.T.to(self.device, self.dtype)

    def batch(self, names: list[str | None], q_lens: list[int]) -> LoRABatch | None:
        """The step's rows by slot: request i's q_lens[i] rows run under adapter names[i] (None: the base).
        None when no request of the step has an adapter (the fast paths stay open)."""
        if all(n is None for n in names):
            return None
        slots = np.fromiter((-1 if n is None else self.slot_of[n] for n in names), np.int32, len(names))
        token_slots = np.repeat(slots, q_lens)  # the per-row slot index, -1 for the base
        if (slots == slots[0]).all():  # one adapter for every row: its own slices, no mask
            return LoRABatch(self, token_slots, int(slots[0]), None)
        mask = token_slots[:, None] == np.arange(self.max_loras, dtype=np.int32)[None, :]
        mask = torch.from_numpy(mask[:, :, None]).to(self.device, self.dtype)  # [T, slots, 1]
        return LoRABatch(self, token_slots, None, mask)


@dataclass(slots=True)
class LoRABatch:
    """One step's adapters: each row's slot (-1: the base), and either the one slot every row runs under
    or the mask [T, slots, 1] that keeps each row's own slot's columns."""
    slots: LoRASlots
    row_slots: np.ndarray  # int32 [T]
    slot: int | None
    mask: torch.Tensor | None

    def layer(self, i: int) -> LayerLoRA:
        return LayerLoRA(self.slots.views(self.slot)[i], self.mask)


@dataclass(slots=True)
class LayerLoRA:
    """One layer's adapters as this step applies them: fused name -> (A [K, in], B [K, out]), K the columns of
    one slot or of all, and the mask of each row's slot (None: one slot)."""
    ab: dict[str, tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor | None

    def add(self, y: torch.Tensor, x: torch.Tensor, fused: str) -> None:
        """y += scale * (x A^T) B^T in place, each row under its own adapter (none for base rows)."""
        a, b = self.ab[fused]
        u = x @ a.T
        if self.mask is not None:
            u.view(u.shape[0], self.mask.shape[1], -1).mul_(self.mask)
        y.addmm_(u, b)
