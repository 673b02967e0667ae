"""The weight layouts cpu_linear.cpp reads: float and bf16 panels (in either layout), int8 panels (w8a8),
weight-only int8 and int4 panels; and reading a packed weight back."""
from __future__ import annotations

import torch

from iterserve.model.cpu_arena import _arena

PANEL = 32  # outputs per weight panel: cpu_linear.cpp's kPanel
INT4_GROUP = 32  # cpu_linear.cpp's kInt4Group: inputs a scale and a minimum cover (the GGUF block)
INT8_GROUP = 64  # cpu_linear.cpp's kGroup: inputs an activation scale covers, and a column sum


def pack_panels(w: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """W [N, K] -> panels [ceil(N / PANEL), K, PANEL]: panels[p, k, j] = W[p * PANEL + j, k], zero rows past N;
    on huge pages where the OS has them. pairs (bfloat16, K even): [ceil(N / PANEL), K / 2, PANEL, 2],
    panels[p, i, j, e] = W[p * PANEL + j, 2 i + e], what the AVX-512 BF16 dot product takes."""
    n, k = w.shape
    if pairs and (w.dtype != torch.bfloat16 or k % 2):
        raise ValueError(f"the pairs layout takes bfloat16 weights with an even number of inputs, not {w.dtype} x {k}")
    padded = -(-n // PANEL) * PANEL
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    shape = (padded // PANEL, k // 2, PANEL, 2) if pairs else (padded // PANEL, k, PANEL)
    panels = _arena.empty(shape, w.dtype) if _arena is not None else torch.empty(shape, dtype=w.dtype)
    if pairs:
        return panels.copy_(w.view(padded // PANEL, PANEL, k // 2, 2).transpose(1, 2))
    return panels.copy_(w.view(padded // PANEL, PANEL, k).transpose(1, 2))


def int8_depth(k: int) -> int:
    """K rounded up to INT8_GROUP: the depth of an int8 panel's codes."""
    return -(-k // INT8_GROUP) * INT8_GROUP


def int8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (codes [N, K] int8, scales [N] float32): symmetric, one scale an output row, [-127, 127]."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / 127).clamp(min=1e-10)
    return torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def pack_int8_panels(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] float -> int8 panels (--quantization w8a8): [ceil(N / PANEL), bytes] int8, each panel its codes
    quads[Kp / 4][PANEL][4] (Kp = int8_depth(K); int8_codes, zeros padding K and N), then its PANEL float32
    scales, then each group of INT8_GROUP inputs' PANEL column sums of the codes (float32): what
    cpu_linear.cpp's int8 tiles read."""
    n, k = w.shape
    kp, panels_n, groups = int8_depth(k), -(-n // PANEL), int8_depth(k) // INT8_GROUP
    q, scales = int8_codes(w)
    q = torch.nn.functional.pad(q, (0, kp - k, 0, panels_n * PANEL - n))
    scales = torch.nn.functional.pad(scales, (0, panels_n * PANEL - n), value=1.0)
    shape = (panels_n, kp * PANEL + 4 * PANEL * (1 + groups))
    panels = _arena.empty(shape, torch.int8) if _arena is not None else torch.empty(shape, dtype=torch.int8)
    panels[:, :kp * PANEL].view(panels_n, kp // 4, PANEL, 4).copy_(q.view(panels_n, PANEL, kp // 4, 4).transpose(1, 2))
    tail = panels[:, kp * PANEL:].view(torch.float32)  # [panels, PANEL (1 + groups)] words
    tail[:, :PANEL].copy_(scales.view(panels_n, PANEL))
    sums = q.view(panels_n, PANEL, groups, INT8_GROUP).sum(dim=-1, dtype=torch.int32)
    tail[:, PANEL:].view(panels_n, groups, PANEL).copy_(sums.transpose(1, 2))
    return panels


def pack_int8_weight_panels(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weight-only int8 codes q [N, K] and their row scales [N] -> one flat int8 tensor, what
    linear_int8_weights reads: per panel of PANEL outputs (zeros past N) its codes in pairs of inputs,
    [Kp / 2][PANEL][2] (Kp: K rounded up to even, a zero past K), then ceil(N / PANEL) * PANEL float32
    scales (1 past N)."""
    n, k = q.shape
    kp, panels_n = k + k % 2, -(-n // PANEL)
    padded = panels_n * PANEL
    q = torch.nn.functional.pad(q, (0, kp - k, 0, padded - n))
    out = _arena.empty((padded * (kp + 4),), torch.int8) if _arena is not None else \
        torch.empty(padded * (kp + 4), dtype=torch.int8)
    out[:padded * kp].view(panels_n, kp // 2, PANEL, 2).copy_(q.view(panels_n, PANEL, kp // 2, 2).transpose(1, 2))
    out[padded * kp:].view(torch.float32).copy_(torch.nn.functional.pad(scales.float(), (0, padded - n), value=1.0))
    return out



def pack_int4_weight_panels(q: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """Weight-only int4 codes q [N, K] in [0, 15] (w = q * scale + minimum, each group of INT4_GROUP inputs
    its own scale and minimum: scales and minimums [N, K / INT4_GROUP]) -> one flat uint8 tensor, what
    linear_int4_weights reads: per panel of PANEL outputs (zeros past N), per group, its codes in pairs of
    inputs (PANEL bytes a pair: byte j holds output j's code at the even input in its low nibble, at the odd
    one in its high nibble), then the PANEL bf16 scales and the PANEL bf16 minimums."""
    n, k = q.shape
    assert k % INT4_GROUP == 0 and scales.shape == minimums.shape == (n, k // INT4_GROUP)
    panels_n, groups, half = -(-n // PANEL), k // INT4_GROUP, INT4_GROUP // 2
    pad = (0, 0, 0, panels_n * PANEL - n)
    q = torch.nn.functional.pad(q.to(torch.uint8), pad).view(panels_n, PANEL, groups, half, 2)
    codes = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1)  # [panels, groups, pairs, PANEL]

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [panels, groups, PANEL] bf16's bytes
        t = torch.nn.functional.pad(t.to(torch.bfloat16), pad).view(panels_n, PANEL, groups).transpose(1, 2)
        return t.contiguous().view(torch.uint8)

    group_bytes = half * PANEL + 4 * PANEL
    shape = (panels_n * groups * group_bytes,)
    out = _arena.empty(shape, torch.uint8) if _arena is not None else torch.empty(shape, dtype=torch.uint8)
    out.view(panels_n, groups, group_bytes).copy_(torch.cat(
        [codes.reshape(panels_n, groups, half * PANEL), per_group(scales), per_group(minimums)], dim=-1))
    return out



def panel_in_features(panels: torch.Tensor) -> int:
    """K of the weight pack_panels packed into `panels`, in either layout; for int8 panels, int8_depth(K)."""
    if panels.dtype == torch.int8:  # bytes = Kp PANEL + 4 PANEL (1 + Kp / INT8_GROUP)
        return (panels.shape[1] - 4 * PANEL) * INT8_GROUP // (PANEL * (INT8_GROUP + 4))
    return panels.shape[1] * (2 if panels.dim() == 4 else 1)


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """W[ids] read back from pack_panels' panels (either layout): [len(ids), K]."""
    rows = panels[ids // PANEL, :, ids % PANEL]
    return rows.reshape(len(ids), panel_in_features(panels))

