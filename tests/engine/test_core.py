"""The engine-core contract (engine/core.py): every engine core meets it, the AsyncEngine checks it once and
names what is missing, and callers ask capabilities through the optional protocols, not the class."""
from __future__ import annotations

import asyncio
import queue

import pytest

from iterserve.config import EngineConfig
from iterserve.contract import members
from iterserve.engine import Engine
from iterserve.engine.core import EngineCore, LocalEngineCore, RemoteEngineCore, check_engine_core
from iterserve.engine.disagg import DecodeEngine, PrefillEngine
from iterserve.engine.stats import EngineStats
from iterserve.executor.base import DeviceExecutor
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.server.async_engine import AsyncEngine
from tests.fake_executor import FakeExecutor
from tests.server.conftest import wait_for


class BlockIOExecutor(FakeExecutor):
    """A fake executor whose blocks a P/D side could move (only the contract is exercised here)."""

    def read_blocks(self, block_ids):
        return None

    def write_blocks(self, block_ids, blocks) -> None:
        pass


class NoConnector:
    def send(self, request_id, blocks, hashes, meta) -> None: ...

    def receive(self, timeout: float = 0.0):
        return None

    def close(self) -> None:
        self.closed = True


def engine() -> Engine:
    return Engine(EngineConfig(num_kv_blocks=16), executor=BlockIOExecutor(vocab_size=50))


def test_the_contract_is_read_from_the_protocol():
    assert members(EngineCore) == ("config", "stats", "add_request", "abort_request", "has_unfinished", "step",
                                   "shutdown")


@pytest.mark.parametrize("make", [engine, lambda: PrefillEngine(engine(), NoConnector()),
                                  lambda: DecodeEngine(engine(), NoConnector())], ids=["engine", "prefill", "decode"])
def test_every_in_process_engine_core_meets_the_contract(make):
    core = make()
    check_engine_core(core)
    assert isinstance(core.stats, EngineStats) and core.config.cache_config.num_kv_blocks == 16
    assert isinstance(core, LocalEngineCore) == isinstance(core, Engine)  # the sides keep theirs inside
    assert not isinstance(core, RemoteEngineCore)


def test_a_side_shuts_its_connector_and_engine():
    connector = NoConnector()
    DecodeEngine(engine(), connector).shutdown()
    assert connector.closed


def test_a_decode_engine_computes_a_request_added_to_it_directly():
    side = DecodeEngine(engine(), NoConnector())
    rid = side.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), "r")
    outs = []
    while side.has_unfinished():
        outs += side.step()
    assert rid == "r" and outs[-1].finished and len(outs[-1].token_ids) == 2


class HalfEngine:
    """Steps, but takes no requests and reports nothing."""

    config = EngineConfig()

    def has_unfinished(self) -> bool:
        return False

    def step(self):
        return []

    def shutdown(self) -> None:
        pass


def test_the_async_engine_names_what_an_engine_core_lacks():
    with pytest.raises(TypeError, match=r"^HalfEngine does not implement the EngineCore contract: "
                                        r"missing stats, add_request, abort_request$"):
        AsyncEngine(HalfEngine())
    with pytest.raises(TypeError, match="missing stats, add_request, abort_request"):  # built on its thread
        AsyncEngine(HalfEngine, max_waiting_requests=4)


def test_the_device_an_executor_runs_on_is_asked_of_it():
    assert not isinstance(FakeExecutor(), DeviceExecutor)

    class OnCpu(FakeExecutor):
        device_type = "cpu"
    assert isinstance(OnCpu(), DeviceExecutor)


class RemoteCore:
    """A remote engine core in one process: its step blocks on a queue until an output, a wake or its
    timeout, as the P/D front's does on its workers' outbox."""

    def __init__(self) -> None:
        self.config = EngineConfig()
        self.stats = EngineStats(0, 0, 0, 0.0, 16, 16, 0, 0, 0, 0, 128, None)
        self.inbox: queue.Queue = queue.Queue()
        self.unfinished: set[str] = set()
        self.timeouts: list[float | None] = []
        self.tokenizer, self.vocab_size, self.eos_token_ids, self.max_model_len = None, None, frozenset(), 128

    def add_request(self, prompt, params=None, request_id=None, arrival_time=None, priority=0, cache_salt=None):
        self.unfinished.add(request_id)
        return request_id

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        self.unfinished.discard(request_id)
        return []

    def has_unfinished(self) -> bool:
        return bool(self.unfinished)

    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        self.timeouts.append(timeout)
        try:
            self.inbox.get(timeout=timeout)
        except queue.Empty:
            pass
        return []

    def wake(self) -> None:
        self.inbox.put("wake")

    def shutdown(self) -> None:
        pass


def test_a_remote_core_waits_with_no_limit_and_a_command_wakes_it():
    """With no deadline its step waits for ever: only wake() lets the abort through."""
    core = RemoteCore()
    async_engine = AsyncEngine(core)
    assert isinstance(core, RemoteEngineCore) and not isinstance(core, LocalEngineCore)
    try:
        asyncio.run(async_engine.add_request([1, 2], SamplingParams(max_tokens=4), request_id="a"))
        wait_for(lambda: core.timeouts, 30, "the engine thread never stepped")
        async_engine.abort("a")
        wait_for(lambda: not core.has_unfinished(), 30, "the abort waited behind the step")
        assert core.timeouts[0] is None
    finally:
        async_engine.shutdown()
    assert not async_engine.is_alive


def test_a_remote_core_waits_no_longer_than_the_next_request_deadline():
    core = RemoteCore()
    async_engine = AsyncEngine(core, request_timeout=3600.0)
    try:
        asyncio.run(async_engine.add_request([1, 2], SamplingParams(max_tokens=4), request_id="a"))
        wait_for(lambda: core.timeouts, 30, "the engine thread never stepped")
        assert core.timeouts[0] is not None and 0 < core.timeouts[0] <= 3600.0
    finally:
        async_engine.shutdown()
