"""Prefill/decode disaggregation in one process: a PrefillEngine hands each request's KV blocks to a
DecodeEngine through a connector; the tokens equal a colocated engine's, and no block leaks."""
from __future__ import annotations

import time

import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.engine.disagg import DecodeEngine, PrefillEngine
from iterserve.executor.model_runner import ModelRunner
from iterserve.kv_transfer.connector import RoutedConnector
from iterserve.kv_transfer.shm_connector import ShmConnector
from iterserve.request import Request, RequestTimes
from iterserve.sampling_params import SamplingParams
from tests.engine.test_greedy_reference import assert_close_all, generate
from tests.engine.test_greedy_reference import prompts as reference_prompts  # noqa: F401

CONFIG = dict(dtype="float32", num_kv_blocks=256, num_threads=1)
NEW_TOKENS = 10  # a few of the reference prompts, briefly: the machine is shared


@pytest.fixture(scope="module")
def prompts(reference_prompts):
    return [reference_prompts[i] for i in (1, 3, 5)]  # 7, 33 and 100 tokens: partial, exact and many blocks


@pytest.fixture(scope="module")
def runners():
    return ModelRunner(EngineConfig(**CONFIG)), ModelRunner(EngineConfig(**CONFIG))


class LossyConnector(ShmConnector):
    """Every other transfer arrives without its blocks, as a broken link would deliver it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def receive(self, timeout: float = 0.0):
        t = super().receive(timeout)
        if t is not None:
            self.n += 1
            if self.n % 2:
                t.blocks, t.error = None, "dropped by the test"
        return t


def generate_pd(runners, prompts, connector, one_at_a_time=False, **config):
    """1P1D in one process: returns each prompt's (tokens, top-5 sets) and both engines."""
    prefill = PrefillEngine(Engine(EngineConfig(**CONFIG, **config), executor=runners[0]), connector)
    decode = DecodeEngine(Engine(EngineConfig(**CONFIG, **config), executor=runners[1]), connector)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    first: dict[str, list[set[int]]] = {}
    results = {}
    groups = [[i] for i in range(len(prompts))] if one_at_a_time else [list(range(len(prompts)))]
    for group in groups:
        for i in group:
            prefill.add_request(prompts[i], params, request_id=str(i))
        deadline = time.monotonic() + 120
        while any(str(i) not in results for i in group):
            assert time.monotonic() < deadline, "1P1D did not finish"
            for o in prefill.step():
                assert not o.finished and o.token_ids and o.error is None
                assert prefill.engine.stats.num_running == 0, "a prefill engine never holds a decode"
                first[o.request_id] = [{t for t, _ in lp.top} for lp in o.logprobs]
            decode.poll(timeout=0.01 if not decode.engine.has_unfinished() else 0.0)
            for o in decode.engine.step():
                if o.finished:
                    tops = first[o.request_id] + [{t for t, _ in lp.top} for lp in o.logprobs]
                    results[o.request_id] = (o.token_ids, tops)
    for engine in (prefill.engine, decode.engine):
        assert engine.stats.num_free_kv_blocks == engine.stats.num_kv_blocks
    return [results[str(i)] for i in range(len(prompts))], prefill, decode


@pytest.mark.slow
def test_one_at_a_time_token_identical_to_colocated(runners, prompts):
    colocated, _ = generate(runners[0], prompts, one_at_a_time=True, num_tokens=NEW_TOKENS)
    pd, prefill, decode = generate_pd(runners, prompts, ShmConnector(), one_at_a_time=True)
    assert [t for t, _ in pd] == [t for t, _ in colocated]
    assert prefill.num_sent == len(prompts)
    assert decode.engine.stats.num_kv_transfers_recomputed == 0
    assert all(len(t) == NEW_TOKENS for t, _ in pd)


@pytest.mark.slow
def test_batched_close_and_decode_side_never_prefills(runners, prompts):
    colocated, _ = generate(runners[0], prompts, num_tokens=NEW_TOKENS)
    pd, _, decode = generate_pd(runners, prompts, ShmConnector())
    assert_close_all(pd, colocated, n=NEW_TOKENS)
    steps = decode.engine.step_records
    assert steps and all(s.num_prefill_tokens == 0 for s in steps), "the decode engine ran a prompt chunk"


def test_decode_side_prefix_cache_learns_the_sent_hashes(runners, prompts):
    _, _, decode = generate_pd(runners, prompts[-2:], ShmConnector())
    kv, bs = decode.engine.scheduler.kv, decode.engine.scheduler.block_size
    for p in prompts[-2:]:  # each prompt's full blocks are found by their hashes, computed here afresh
        probe = Request("probe", p + [0], SamplingParams(), RequestTimes(0.0))
        hits, num_cached = kv.get_computed_blocks(probe)
        assert num_cached == len(p) // bs * bs > 0


@pytest.mark.slow
def test_failed_transfer_is_recomputed_with_the_same_tokens(runners, prompts):
    colocated, _ = generate(runners[0], prompts, one_at_a_time=True, num_tokens=NEW_TOKENS)
    pd, _, decode = generate_pd(runners, prompts, LossyConnector(), one_at_a_time=True)
    assert [t for t, _ in pd] == [t for t, _ in colocated]
    assert decode.engine.stats.num_kv_transfers_recomputed == (len(prompts) + 1) // 2


def test_abort_while_the_blocks_are_on_their_way(runners, prompts):
    connector = ShmConnector()
    prefill = PrefillEngine(Engine(EngineConfig(**CONFIG), executor=runners[0]), connector)
    decode = DecodeEngine(Engine(EngineConfig(**CONFIG), executor=runners[1]), connector)
    prefill.add_request(prompts[0], SamplingParams(max_tokens=8, temperature=0), request_id="a")
    while prefill.has_unfinished():
        prefill.step()
    assert decode.abort_request("a") == []  # not here yet
    deadline = time.monotonic() + 30
    while not decode.poll(timeout=0.05):
        assert time.monotonic() < deadline, "the transfer never landed"
    assert not decode.has_unfinished() and not decode.dropped
    for engine in (prefill.engine, decode.engine):
        assert engine.stats.num_free_kv_blocks == engine.stats.num_kv_blocks


def test_routed_connector_sends_each_request_to_its_decode_target(runners, prompts):
    """xPyD's prefill side: each hand-off goes on its request's decode target's channel; one to a
    channel marked dead fails at once with the blocks freed."""
    channels = {"decode-0": ShmConnector(), "decode-1": ShmConnector()}
    prefill = PrefillEngine(Engine(EngineConfig(**CONFIG), executor=runners[0]), RoutedConnector(channels))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prefill.add_request(prompts[0], params, "a", decode_target="decode-1")
    prefill.add_request(prompts[1], params, "b", decode_target="decode-0")
    while prefill.has_unfinished():
        assert all(not o.finished for o in prefill.step())
    for target, rid in (("decode-1", "a"), ("decode-0", "b")):
        transfer = channels[target].receive(timeout=10)
        assert transfer.request_id == rid and transfer.meta.decode_target == target
    prefill.connector.mark_dead("decode-0")
    prefill.add_request(prompts[2], params, "c", decode_target="decode-0")
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    assert [o.finish_reason for o in outs] == ["error"] and "decode-0 is dead" in outs[0].error
    assert channels["decode-0"].receive(timeout=0.2) is None and not prefill.decode_targets
    assert prefill.engine.stats.num_free_kv_blocks == prefill.engine.stats.num_kv_blocks
