"""A real uvicorn server on a free loopback port, in a thread, over a fake or the real engine."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import uvicorn

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.server.app import build_app
from iterserve.server.async_engine import AsyncEngine
from tests.fake_executor import FakeExecutor

MODEL = "test-model"
WORDS = " the cat sat on a mat and then it ran far away from home while birds sang".split(" ")[1:]


class TextFakeExecutor(FakeExecutor):
    """FakeExecutor with the real tokenizer and a small vocabulary of English words, so outputs
    decode to readable, deterministic text; `step_delay` makes steps last long enough to batch."""

    def __init__(self, tokenizer, step_delay: float = 0.0, **kwargs) -> None:
        super().__init__(vocab_size=len(tokenizer), **kwargs)
        self.tokenizer = tokenizer
        self.words = [tokenizer.encode(" " + w, add_special_tokens=False)[0] for w in WORDS]
        self.step_delay = step_delay
        self.fail_next = False  # tests set it to make the next step raise

    def execute(self, plan):
        if self.step_delay:
            time.sleep(self.step_delay)
        result = super().execute(plan)
        result.sampled = [self.words[t % len(self.words)] if t >= 0 else t for t in result.sampled]
        return result


@dataclass
class Server:
    url: str
    async_engine: AsyncEngine
    uvicorn_server: uvicorn.Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(10)


def start_server(engine: Engine, api_key: str | None = None, max_request_bytes: int = 1 << 20,
                 max_waiting_requests: int | None = None, model: str = MODEL,
                 request_timeout: float | None = None, allowed_origins: list[str] | None = None,
                 diagnostics=None, max_num_queued_tokens: int | None = None, **app_kwargs) -> Server:
    """app_kwargs: build_app's other options (pooling, reasoning_parser)."""
    async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests, request_timeout=request_timeout,
                               max_num_queued_tokens=max_num_queued_tokens)
    app = build_app(async_engine, model, api_key=api_key, max_request_bytes=max_request_bytes,
                    allowed_origins=allowed_origins, diagnostics=diagnostics, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # our own socket: a free port with no race
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "the server did not start")
    return Server(f"http://127.0.0.1:{sock.getsockname()[1]}", async_engine, server, thread)


def wait_for(cond, timeout: float, message: str = "condition not met", interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{message} within {timeout}s")


def fake_engine(tokenizer, step_delay: float = 0.0, max_num_seqs: int = 64, num_kv_blocks: int = 1024,
                wrap=None) -> Engine:
    """`wrap(executor)` may wrap the fake executor (fault injection)."""
    executor = TextFakeExecutor(tokenizer, step_delay, num_kv_blocks=num_kv_blocks, max_model_len=2048)
    return Engine(EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096),
                  wrap(executor) if wrap else executor)


def leaks(server: Server) -> dict[str, int]:
    """What an idle server must hold none of: KV blocks, scheduler requests, engine text states,
    open request streams. All zero when idle (read from the test thread: a snapshot)."""
    engine = server.async_engine.engine
    s = engine.scheduler
    return {"kv_blocks_used": s.kv.num_blocks - s.kv.num_free_blocks, "scheduler_requests": len(s.requests), "engine_states": len(engine.states),
            "open_streams": server.async_engine.num_open_requests}


def no_leaks(server: Server) -> bool:
    return not any(leaks(server).values())


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            return float(value)
    return 0.0


@pytest.fixture(scope="module")
def fake_server(tokenizer):
    server = start_server(fake_engine(tokenizer, step_delay=0.005), max_request_bytes=64 << 10)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A small random Llama with the default model's tokenizer: a real checkpoint that loads in a moment."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("tiny-smol")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
