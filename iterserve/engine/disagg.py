"""Prefill/decode disaggregation at the engine level (docs/disaggregation.md).

A PrefillEngine computes each prompt and its first token, then hands the request's KV blocks and
prefix hashes to a decode engine through a KV connector and frees them: it never holds a decode.
A DecodeEngine admits what arrives as already computed up to the prompt (Engine.add_computed_request,
a prefix-cache hit whose blocks come from outside) and decodes the rest: it never runs a prompt
chunk, except to recompute a request whose blocks did not arrive (or one added to it directly). Both
wrap a plain Engine and are engine cores (engine/core.py); the scheduler sees one extra entry point and
nothing else.
"""
from __future__ import annotations

import logging
import re
from collections import deque

from iterserve.config import EngineConfig
from iterserve.engine.engine import Engine
from iterserve.engine.stats import EngineStats
from iterserve.executor.base import KVBlockIO
from iterserve.kv_transfer.connector import KVConnector
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

logger = logging.getLogger("iterserve.disagg")


def _require(engine: Engine, method: str, role: str) -> None:
    if not isinstance(engine.executor, KVBlockIO):
        raise TypeError(f"a {role} engine needs an executor with {method}(); "
                        f"{type(engine.executor).__name__} has none (tensor parallel does not move KV blocks yet)")


def parse_pd(text: str) -> tuple[int, int]:
    """'2P1D' -> (2, 1): x prefill and y decode engines."""
    m = re.fullmatch(r"\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--pd takes xPyD with x, y >= 1 (e.g. 1P1D, 2P1D), not {text!r}")
    return int(m.group(1)), int(m.group(2))


def check_pd_params(params: SamplingParams) -> None:
    """What a disaggregated request cannot do, refused by name instead of done wrong."""
    if params.n != 1:
        raise ValueError("n > 1 is not supported with prefill/decode disaggregation")
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs is not supported with prefill/decode disaggregation")


class _Side:
    """What both sides show of their Engine (the EngineCore contract) and what they own."""

    engine: Engine
    connector: KVConnector

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def shutdown(self) -> None:
        self.connector.close()
        self.engine.shutdown()


class PrefillEngine(_Side):
    def __init__(self, engine: Engine, connector: KVConnector) -> None:
        _require(engine, "read_blocks", "prefill")
        self.engine, self.connector = engine, connector
        self.num_sent = 0
        self.num_send_failures = 0
        self.decode_targets: dict[str, str] = {}  # xPyD: the decode engine each request goes to

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    decode_target: str | None = None, **kwargs) -> str:
        params = params or SamplingParams()
        check_pd_params(params)
        request_id = self.engine.add_request(prompt, params, request_id, **kwargs)
        if decode_target is not None:
            self.decode_targets[request_id] = decode_target
        return request_id

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        self.decode_targets.pop(request_id, None)
        return self.engine.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step; each request that just got its first token (and goes on) is handed off.
        Its output is the first token, unfinished; `error` is set when the hand-off failed."""
        outputs = self.engine.step()
        for i, out in enumerate(outputs):
            if out.finished:  # after one token, or failed: it never leaves
                self.decode_targets.pop(out.request_id, None)
            else:
                error = self._hand_off(out.request_id)
                if error:
                    outputs[i] = self.engine.abort_request(out.request_id)[0]
                    outputs[i].error = error
                    outputs[i].finish_reason = "error"
        return outputs

    def _hand_off(self, request_id: str) -> str | None:
        """Send the request's prompt blocks; free them whatever happened. Returns an error, or None."""
        engine = self.engine
        blocks, hashes, meta = engine.blocks_to_hand_off(request_id, self.decode_targets.pop(request_id, None))
        try:
            self.connector.send(request_id, blocks, hashes, meta)
        except Exception as exc:  # the decode side is gone or the link broke: this request fails, we go on
            logger.warning("request %s: sending its KV blocks failed: %s", request_id, exc)
            self.num_send_failures += 1
            return f"handing the request to the decode engine failed: {exc}"
        engine.release(request_id)
        self.num_sent += 1
        return None


class DecodeEngine(_Side):
    def __init__(self, engine: Engine, connector: KVConnector) -> None:
        _require(engine, "write_blocks", "decode")
        self.engine, self.connector = engine, connector
        self.pending: deque = deque()  # arrived, waiting for room in the pool or a seat
        self.dropped: set[str] = set()  # aborted before they landed: dropped when they do

    def add_request(self, *args, **kwargs) -> str:
        """A request that came through no prefill engine: its prompt is computed here."""
        return self.engine.add_request(*args, **kwargs)

    def has_unfinished(self) -> bool:
        return bool(self.pending) or self.engine.has_unfinished()

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request held here, waiting here, or still on its way (dropped when it lands)."""
        waiting = len(self.pending)
        self.pending = deque(t for t in self.pending if t.request_id != request_id)
        outputs = self.engine.abort_request(request_id)
        if not outputs and len(self.pending) == waiting:
            self.dropped.add(request_id)
        return outputs

    def poll(self, timeout: float = 0.0) -> int:
        """Take in what has arrived (waiting up to `timeout` for the first); returns how many."""
        n = 0
        while (transfer := self.connector.receive(timeout if n == 0 else 0.0)) is not None:
            n += 1
            if transfer.request_id in self.dropped:
                self.dropped.discard(transfer.request_id)
            else:
                self.pending.append(transfer)
        while self.pending and self.engine.add_computed_request(self.pending[0]):
            self.pending.popleft()
        return n

    def step(self) -> list[RequestOutput]:
        self.poll()
        return self.engine.step()
