"""Graceful shutdown with a limit: on SIGTERM (or a first Ctrl-C) the server keeps listening but answers
503 to new requests and to /health, lets the accepted requests run for up to --shutdown-timeout seconds,
ends the rest with an error event, then exits. Orchestrators send SIGTERM and kill ~30 s later; a
stream cut by the kill tells its client nothing, an error event tells it to retry.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

from iterserve.server.async_engine import AsyncEngine

logger = logging.getLogger("iterserve.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler. The first SIGTERM / SIGINT drains; a second one exits at once."""
        if self.async_engine.draining or sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        self._captured_signals.append(sig)  # re-raised by uvicorn once it has shut down, as it does itself
        logger.info("%s: draining %d open requests (up to %gs), refusing new ones", signal.Signals(sig).name,
                    self.async_engine.num_open_requests, self.shutdown_timeout)
        self.async_engine.drain(self.shutdown_timeout)
        threading.Thread(target=self._exit_when_drained, name="iterserve-drain", daemon=True).start()

    def _exit_when_drained(self) -> None:
        # The engine thread ends every stream by the deadline; a moment more lets the error events go out.
        deadline = time.monotonic() + self.shutdown_timeout + 2.0
        while self.async_engine.num_open_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        logger.info("drained; shutting down")
        self.should_exit = True
