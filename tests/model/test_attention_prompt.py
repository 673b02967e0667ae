"""The C++ causal prompt-attention kernel against float32 SDPA with a bottom-right causal mask: in bf16
where the build has AVX-512 BF16, in float32 where it has AVX2 and no AVX-512."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.model import cpu_kernels

DTYPE = next((d for d in (torch.bfloat16, torch.float32) if cpu_kernels.prompt_attention_supported(d, 64)), None)
pytestmark = pytest.mark.skipif(DTYPE is None, reason="needs a C++ compiler and AVX-512 BF16, or AVX2 without AVX-512")
TOL = {"atol": 1e-2, "rtol": 1e-2} if DTYPE == torch.bfloat16 else {"atol": 2e-5, "rtol": 1e-4}


def reference(q, k, v, scale, window=0):
    t, s = q.shape[0], k.shape[0]
    mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)  # query i sits at position s - t + i
    if window:  # and sees only the last `window` positions
        mask &= ~torch.ones(t, s, dtype=torch.bool).tril(s - t - window)
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None].float() for x in (q, k, v)), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("t,s", [(1, 1), (5, 5), (16, 16), (37, 37), (130, 130), (1, 40), (20, 100), (33, 48)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (8, 1, 64)])
def test_causal_over_strided_qkv_rows(t, s, heads, kv_heads, head_dim):
    """q/k/v are views into one fused qkv row, as the model hands them over; t < s is a chunk whose
    earlier context is already in the cache."""
    torch.manual_seed(t * 1000 + s)
    qkv = torch.randn(s, (heads + 2 * kv_heads) * head_dim, dtype=DTYPE)
    q = qkv[s - t:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(s, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(s, kv_heads, head_dim)
    got = cpu_kernels.prompt_attention(q, k, v, head_dim ** -0.5, 2)
    torch.testing.assert_close(got.float(), reference(q, k, v, head_dim ** -0.5), **TOL)
    k2 = k.contiguous()  # rows of k and v a different distance apart (torch's rope returns a fresh q/k)
    assert torch.equal(cpu_kernels.prompt_attention(q, k2, v, head_dim ** -0.5, 2), got)


@pytest.mark.parametrize("t,s", [(37, 37), (130, 130), (20, 100), (1, 40)])
@pytest.mark.parametrize("window", [1, 5, 16, 33, 200])
def test_sliding_window(t, s, window):
    """Keys `window` or more behind a query are masked; key blocks behind a whole tile's window skipped."""
    torch.manual_seed(t + s + window)
    q, k, v = (torch.randn(n, h, 64, dtype=DTYPE) for n, h in ((t, 8), (s, 2), (s, 2)))
    got = cpu_kernels.prompt_attention(q, k, v, 0.125, 2, window)
    torch.testing.assert_close(got.float(), reference(q, k, v, 0.125, window), **TOL)


def test_large_scores_keep_the_softmax_finite():
    """Running max and rescaling: scores of +-60 would overflow a plain exp."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(70, h, 64, dtype=DTYPE) for h in (6, 2, 2))
    q = q * 8
    got = cpu_kernels.prompt_attention(q, k, v, 1.0, 2)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), reference(q, k, v, 1.0), atol=2e-2, rtol=2e-2)


def test_what_it_does_not_run_is_said_so():
    other = torch.float32 if DTYPE == torch.bfloat16 else torch.bfloat16
    assert not cpu_kernels.prompt_attention_supported(other, 64)  # one dtype a build: the other stays on SDPA
    assert not cpu_kernels.prompt_attention_supported(DTYPE, 8)
    q = torch.zeros(3, 2, 64, dtype=DTYPE)
    with pytest.raises(ValueError, match="unsupported"):
        cpu_kernels.prompt_attention(q, q[:2], q[:2], 1.0, 1)  # more queries than keys
