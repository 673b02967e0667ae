"""The engine-client contract (server/engine_client.py): build_app checks it once, at construction, and a
client that lacks a part or gets one wrong fails there with every such part named."""
from __future__ import annotations

import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.server.app import build_app
from iterserve.server.async_engine import AsyncEngine
from iterserve.server.engine_client import check_engine_client
from tests.fake_executor import FakeExecutor


def test_an_async_engine_is_an_engine_client():
    async_engine = AsyncEngine(Engine(EngineConfig(num_kv_blocks=16), executor=FakeExecutor(vocab_size=50)))
    check_engine_client(async_engine)
    assert async_engine.max_model_len == async_engine.engine.max_model_len and async_engine.vocab_size == 50
    assert async_engine.encode([1, 2]) == [1, 2]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        async_engine.encode([50])


class Mistyped:
    """A stand-in that looks about right: the model facts, but add_request is not async, abort and
    shutdown are missing, and the EOS ids are a list."""

    tokenizer, max_model_len, vocab_size, eos_token_ids = None, 128, 100, [2]
    dead, draining, on_step = None, False, None

    def encode(self, prompt):
        return list(prompt)

    def add_request(self, prompt, params, request_id, priority=0, cache_salt=None):
        return None

    def start(self) -> None:
        pass


def test_a_mistyped_client_fails_at_construction_naming_what_is_missing():
    with pytest.raises(TypeError, match=r"^Mistyped does not implement the EngineClient contract: "
                                        r"missing abort, shutdown$"):
        build_app(Mistyped(), "m")


def test_a_client_with_every_part_but_wrong_ones_names_each():
    class Wrong(Mistyped):
        abort = shutdown = None  # present, not callable

    with pytest.raises(TypeError) as error:
        build_app(Wrong(), "m")
    message = str(error.value)
    assert message.startswith("Wrong does not implement the EngineClient contract: ")
    for part in ("abort is not callable", "shutdown is not callable", "add_request is not a coroutine function",
                 "eos_token_ids is a list, not a frozenset"):
        assert part in message, message


class BareEngine:
    """An engine core that steps but tells nothing about its model (what the P/D front is before
    serving_engines fills in its tokenizer, vocabulary, EOS ids and context)."""

    config = EngineConfig()
    stats = None

    def add_request(self, prompt, params=None, request_id=None, arrival_time=None, priority=0, cache_salt=None):
        return request_id

    def abort_request(self, request_id):
        return []

    def has_unfinished(self) -> bool:
        return False

    def step(self):
        return []

    def shutdown(self) -> None:
        pass


def test_an_async_engine_over_an_engine_without_the_model_facts_names_the_engine():
    async_engine = AsyncEngine(BareEngine, max_waiting_requests=4)
    try:
        with pytest.raises(TypeError, match=r"AsyncEngine does not implement the EngineClient contract: missing "
                                            r"tokenizer \(its BareEngine has no tokenizer\), max_model_len"):
            build_app(async_engine, "m")
    finally:
        async_engine.shutdown()
