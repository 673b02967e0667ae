"""The CPU KV pool is zeros whose memory is committed as its blocks are first written, not at start-up."""
from __future__ import annotations

import pytest
import torch

from iterserve.executor.kv_pool import lazy_zeros

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_the_pool_is_zeros_that_cost_nothing_until_written():
    before = rss()
    kv = lazy_zeros((2, 2, 2048, 16, 4, 64), torch.float32)  # 128 MiB
    assert kv.shape == (2, 2, 2048, 16, 4, 64) and kv.dtype == torch.float32 and kv.is_contiguous()
    assert rss() - before < 16 * MiB
    kv[0, 0, :64] = 1.0  # 64 blocks of one layer's K: 1 MiB
    assert rss() - before < 24 * MiB
    assert kv[0, 0, :64].min() == 1.0 and kv[1, 1, -1].abs().max() == 0 and kv[0, 1, 100].abs().max() == 0


def test_an_empty_pool_is_allowed():  # no swap pool with recompute preemption
    kv = lazy_zeros((2, 2, 0, 16, 4, 64), torch.bfloat16)
    assert kv.shape == (2, 2, 0, 16, 4, 64) and kv.dtype == torch.bfloat16


def huge_page_eligible(t: torch.Tensor) -> bool:
    """Whether the kernel may back the tensor with huge pages: THPeligible of the mappings under it
    (/proc/self/smaps; madvise splits a mapping at the 2 MiB boundaries it advises). Whether it then
    does depends on free contiguous memory, which a test cannot count on."""
    lo_t, hi_t, eligible, inside = t.data_ptr(), t.data_ptr() + t.nbytes, False, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < hi_t and hi > lo_t
            elif inside and head == "THPeligible:":
                eligible |= line.split()[1] == "1"
    return eligible


def transparent_huge_pages() -> bool:
    """Huge pages on request only (`madvise` mode; `always` would grant them unasked), and smaps says
    where they may go."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f, open("/proc/self/smaps") as smaps:
            return "[madvise]" in f.read() and "THPeligible:" in smaps.read()
    except OSError:
        return False


@pytest.mark.skipif(not transparent_huge_pages(), reason="transparent huge pages are not in madvise mode here")
def test_the_pool_may_fault_in_huge_pages():
    """Decode reads blocks scattered over the whole pool: over 4 KiB pages nearly each one is a TLB
    miss. A shared anonymous mapping would be shmem, which gets huge pages only where
    shmem_enabled says so (by default it does not)."""
    assert not huge_page_eligible(lazy_zeros((2, 2, 2048, 16, 4, 64), torch.float32))  # 128 MiB
    assert huge_page_eligible(lazy_zeros((2, 2, 2048, 16, 4, 64), torch.float32, huge_pages=True))


@pytest.mark.skipif(not transparent_huge_pages(), reason="transparent huge pages are not in madvise mode here")
@pytest.mark.slow
def test_the_engines_pool_is_advised_after_its_start_up_measurement():
    """Advised after the start-up measurement, whose blocks stay on small pages (2 x layers huge ones
    would be first touched at every start); the host swap pool never is. (The measurement ran a step
    before the runner had a `graphs` attribute, so auto preemption failed at start-up.)"""
    from iterserve.config import EngineConfig
    from iterserve.executor.model_runner import ModelRunner
    runner = ModelRunner(EngineConfig(kv_cache_memory="512MiB", preemption_mode="auto"))
    assert runner.kv_cache_spec.swap_bytes_per_s > 0 and runner.kv_cache_spec.recompute_tokens_per_s > 0
    assert huge_page_eligible(runner.kv_cache) and not huge_page_eligible(runner.host_kv_cache)
