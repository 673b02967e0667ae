"""`python -m tests.server.fake_serve PORT_FILE SHUTDOWN_TIMEOUT`: a real server process (uvicorn, signal
handling, graceful shutdown) over the fake engine, for tests that send it signals. It binds a free
loopback port and writes the number to PORT_FILE (poll /health for when it listens)."""
from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import uvicorn

from iterserve.model.loader import default_model_path, load_tokenizer
from iterserve.server.app import build_app
from iterserve.server.async_engine import AsyncEngine
from iterserve.server.shutdown import GracefulServer
from tests.server.conftest import MODEL, fake_engine


def main() -> None:
    port_file, shutdown_timeout = Path(sys.argv[1]), float(sys.argv[2])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    async_engine = AsyncEngine(fake_engine(load_tokenizer(default_model_path()), step_delay=0.01))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(build_app(async_engine, MODEL), log_level="info", timeout_graceful_shutdown=5)
    server = GracefulServer(config, async_engine, shutdown_timeout)
    port_file.with_suffix(".tmp").write_text(str(sock.getsockname()[1]))
    port_file.with_suffix(".tmp").rename(port_file)  # the test polls for it: never half-written
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
