"""What a warm `iterserve serve` start imports and does before /health: no transformers (the serving
tokenizer reads the weight cache's entry), and a real start that serves chat, logprobs and structured
output (xgrammar gets transformers' tokenizer on first use)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from iterserve.model import loader, weight_cache

WARM_PATH = """
import sys
from iterserve.model import weight_cache
from iterserve.model.loader import default_model_path
from iterserve.engine.detokenizer import Detokenizer
import iterserve.server.app, iterserve.server.cli, iterserve.server.dashboard
from iterserve.server.token_text import TokenText
from iterserve.llm import apply_chat_template
tok = weight_cache.load_tokenizer(default_model_path())
ids = apply_chat_template(tok, [{"role": "user", "content": "Hi"}])
d = Detokenizer(tok, ids, stop=["\\n\\n"])
for i in tok.encode(" Hello there", add_special_tokens=False):
    d.add(i)
print(json.dumps({"type": type(tok).__name__, "text": d.text, "piece": TokenText(tok).str(ids[-1]),
                  "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers")}))
"""


@pytest.mark.slow
def test_a_warm_start_imports_no_transformers(default_model_path, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSERVE_WEIGHT_CACHE", str(tmp_path))
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: tokenizer)  # the entry, written as a cold start does
    weight_cache.load_tokenizer(default_model_path)
    out = subprocess.run([sys.executable, "-c", "import json\n" + WARM_PATH], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "ITERSERVE_WEIGHT_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the prompt ends "<|im_start|>assistant\n": its last token's text is the byte-level "Ċ" decoded
    assert got == {"type": "ServingTokenizer", "text": " Hello there", "piece": "\n", "transformers": []}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_serve_starts_and_serves_through_the_serving_tokenizer(default_model_path, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ITERSERVE_WEIGHT_CACHE": str(tmp_path)}  # cold: the entry is written, then served light
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "iterserve.cli", "serve", "--port", str(port),
                             "--kv-cache-memory", "64MiB"], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 500
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in time"
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        chat = _post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}],
                                                     "max_tokens": 8, "temperature": 0, "logprobs": True})
        assert chat["choices"][0]["message"]["content"] and chat["choices"][0]["logprobs"]["content"]
        shaped = _post(base + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "A colour as JSON."}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
                "type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
                "required": ["colour"], "additionalProperties": False}}}})
        assert set(json.loads(shaped["choices"][0]["message"]["content"])) == {"colour"}
        assert len(list(tmp_path.glob("*/tokenizer/serving.json"))) == 1
    finally:
        proc.send_signal(signal.SIGTERM)  # drains and exits; SIGKILL only if that hangs for a minute
        stop_by = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < stop_by:
            time.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_the_diagnostics_what_if_is_built_at_its_first_use(monkeypatch):
    from iterserve.sim import server_whatif
    built = []
    monkeypatch.setattr(server_whatif, "simulated_system", lambda engine: built.append(engine))  # no model: None
    whatif = server_whatif._LazyWhatIf("the engine")
    assert built == []  # nothing imported or resolved before /health
    assert whatif("window", "capacity", "slo") is None and whatif("window", "capacity", "slo") is None
    assert built == ["the engine"]  # resolved once
