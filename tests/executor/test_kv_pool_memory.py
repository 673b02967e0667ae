"""The CPU KV pool is zeros whose memory is committed as its blocks are first written, not at start-up."""
from __future__ import annotations

import pytest
import torch

from iterserve.executor.kv_pool import lazy_zeros, populate_pool

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


def test_a_populated_pool_is_resident_and_unchanged():
    """populate_kv_cache: the pages are faulted in at start-up, and not a byte of the pool changes."""
    kv = lazy_zeros((2, 2, 2048, 16, 4, 64), torch.float32)  # 128 MiB
    kv[1, 0, 7] = 3.0  # a block written before: populating must keep it
    before = rss()
    populate_pool(kv)
    assert rss() - before > 100 * MiB
    assert kv[1, 0, 7].min() == 3.0 and kv[1, 0, 7].max() == 3.0
    kv[1, 0, 7] = 0.0
    assert kv.abs().max() == 0
    populate_pool(lazy_zeros((2, 2, 0, 16, 4, 64), torch.bfloat16))  # an empty pool: nothing to do


def test_where_linux_cannot_populate_a_zero_per_page_does(monkeypatch):
    from iterserve.executor import kv_pool
    monkeypatch.setattr(kv_pool, "populate", lambda address, nbytes: False)
    kv = lazy_zeros((2, 2, 2048, 16, 4, 64), torch.float32)  # 128 MiB
    before = rss()
    populate_pool(kv)
    assert rss() - before > 100 * MiB and kv.abs().max() == 0


def test_the_offline_llm_populates_its_pool_unless_told_otherwise(monkeypatch):
    from iterserve import llm
    from iterserve.config import CacheConfig
    seen = []
    monkeypatch.setattr(llm, "Engine", lambda config: seen.append(config.cache_config) or _NoTokenizer())
    llm.LLM(num_kv_blocks=8)
    llm.LLM(num_kv_blocks=8, populate_kv_cache=False)
    llm.LLM(cache_config=CacheConfig(num_kv_blocks=8))  # a section given whole keeps its own setting
    assert [c.populate_kv_cache for c in seen] == [True, False, False]


class _NoTokenizer:
    tokenizer = None


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
