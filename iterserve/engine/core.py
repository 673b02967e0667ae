"""The engine-core contract: what a step loop's driver (the AsyncEngine, a P/D worker process) needs
from the engine it drives (docs/architecture.md).

Implementations: Engine (engine.py), PrefillEngine and DecodeEngine (disagg.py, each over an Engine),
and PDEngines, the front of x prefill and y decode processes (pd_front.py). The AsyncEngine checks the
contract once, when it has its engine. The model's facts (tokenizer, vocabulary, EOS ids, context) are
the EngineClient's contract (server/engine_client.py), which the app checks. Torch-free.

A driver asks for more only through the optional protocols below, checked with isinstance, never by
the concrete class.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from iterserve.contract import check_members

if TYPE_CHECKING:
    from iterserve.config import EngineConfig
    from iterserve.engine.stats import EngineStats
    from iterserve.executor.base import Executor
    from iterserve.outputs import RequestOutput
    from iterserve.sampling_params import SamplingParams


class EngineCore(Protocol):
    config: EngineConfig
    stats: EngineStats  # a snapshot, after the last step

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> str:
        """Queue a request; returns its id. ValueError for bad input, before any state changes."""

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """The aborted request's final outputs (none yet where they come back from another process)."""

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """One iteration; the outputs of the requests that got tokens (or ended)."""

    def shutdown(self) -> None: ...


def check_engine_core(engine: object) -> None:
    """Raise TypeError naming every part of the contract the engine lacks."""
    check_members(engine, EngineCore)


@runtime_checkable
class LocalEngineCore(Protocol):
    """An engine core whose executor runs in this process, on the engine's clock: the dashboard and the
    diagnostics read its KV pool's spec and its clock, the server asks its executor for pooling."""

    executor: Executor
    clock: Callable[[], float]


@runtime_checkable
class RemoteEngineCore(Protocol):
    """An engine core whose steps run in other processes (the P/D front): step waits up to `timeout`
    seconds (None: no limit) for their outputs, and wake(), from any thread, ends that wait at once, so a
    driver with new work (a request, an abort, a deadline) is never kept waiting by it."""

    def step(self, timeout: float | None = None) -> list[RequestOutput]: ...

    def wake(self) -> None: ...
