"""benchmarks/peers.py's pure helpers: the one KV budget every engine gets, and its report table; and a run
that outlives the peers that fail."""
import json
import stat
import sys

import pytest

from tests.bench import load_benchmark

peers = load_benchmark("peers")


def test_default_budget_holds_one_whole_request_per_slot():
    b = peers.kv_budget(32, 512 + 256, block_size=16, ov_block_size=32)
    assert (b.slots, b.tokens) == (32, 24576)
    assert b.llama_server_args() == ["-np", "32", "-c", "24576"]
    assert b.iterserve_args(16) == ["--max-num-seqs", "32", "--num-kv-blocks", "1536"]
    assert b.openvino(32) == {"max_num_seqs": 32, "num_kv_blocks": 768}


def test_budget_rounds_up_to_whole_blocks_of_every_engine_and_slot():
    b = peers.kv_budget(3, 100, block_size=16, ov_block_size=32)
    assert b.tokens % 16 == 0 and b.tokens % 32 == 0 and b.tokens % 3 == 0
    assert b.tokens // 3 >= 100


def test_budget_from_kv_cache_memory_uses_whole_iterserve_blocks():
    # 1 GiB of float32 K/V for SmolLM2-135M (46,080 bytes a token): 1,456 blocks of 16 = 23,296 positions,
    # rounded down to a multiple of 4 slots x 32 (OpenVINO's block).
    b = peers.kv_budget(4, 768, block_size=16, kv_cache_memory=1 << 30, kv_bytes_per_token=46080, ov_block_size=32)
    assert b.tokens == 23296 // 128 * 128
    assert b.tokens <= 1456 * 16


def test_budget_too_small_for_a_request_per_slot_is_a_clear_error():
    with pytest.raises(ValueError, match="llama-server splits -c evenly"):
        peers.kv_budget(32, 768, kv_cache_memory=1 << 30, kv_bytes_per_token=46080)
    with pytest.raises(ValueError, match="bytes per token"):
        peers.kv_budget(32, 768, kv_cache_memory=1 << 30)


def test_report_ratios_are_iterserve_over_each_peer():
    row = {"ttft_mean_s": 1.0, "tpot_mean_s": 0.1, "stream_ttft_s": 0.1, "stream_tpot_s": 0.02, "ready_s": 5.0,
           "rss": 1 << 30}
    report = {"kv_budget": {"mapping": "KV budget"},
              "http": [{"name": "iterserve serve", "output_tokens_per_s": 300.0, **row},
                       {"name": "llama-server x.gguf", "output_tokens_per_s": 100.0, **row}],
              "offline": [{"name": "iterserve LLM", "output_tokens_per_s": 320.0, "load_s": 3.0, "rss": 1 << 30,
                           "first_output": [1, 2, 3, 4]},
                          {"name": "OpenVINO GenAI int8", "output_tokens_per_s": 160.0, "load_s": 2.0, "rss": 1 << 29,
                           "first_output": [1, 2, 9, 4]},
                          {"name": "OpenVINO GenAI int4", "output_tokens_per_s": 200.0, "load_s": 2.0, "rss": 1 << 29,
                           "first_output": [1, 2, 3, 4]}]}
    text = peers.format_report(report)
    llama = next(line for line in text.splitlines() if "llama-server" in line)
    assert "3.00" in llama
    assert "best OpenVINO GenAI (int4, u8 KV): 1.60x" in text
    assert "int8: greedy tokens of the first request equal to iterserve's: the first 2 of 4" in text
    assert "int4: greedy tokens of the first request equal to iterserve's: the first 4 of 4" in text


@pytest.mark.parametrize("kv", ["", " int8 KV"])  # --quantized-kv-cache-dtype names the rows it changes
def test_report_sets_w8a8_beside_the_peers_8_bit_rows(kv):
    row = {"ttft_mean_s": 1.0, "tpot_mean_s": 0.1, "stream_ttft_s": 0.1, "stream_tpot_s": 0.02, "ready_s": 5.0,
           "rss": 1 << 30}
    off = {"load_s": 3.0, "rss": 1 << 30, "first_output": [1, 2]}
    report = {"kv_budget": {"mapping": "KV budget"},
              "http": [{"name": "iterserve serve", "output_tokens_per_s": 300.0, **row},
                       {"name": "iterserve serve w8a8" + kv, "output_tokens_per_s": 420.0, **row},
                       {"name": "llama-server m.Q8_0.gguf", "output_tokens_per_s": 140.0, **row}],
              "offline": [{"name": "iterserve LLM", "output_tokens_per_s": 320.0, **off},
                          {"name": "iterserve LLM w8a8" + kv, "output_tokens_per_s": 440.0, **off},
                          {"name": "OpenVINO GenAI int8", "output_tokens_per_s": 220.0, **off},
                          {"name": "OpenVINO GenAI int4", "output_tokens_per_s": 200.0, **off}]}
    text = peers.format_report(report)
    q8 = next(line for line in text.splitlines() if "Q8_0.gguf" in line)
    assert "2.14" in q8  # the table's ratio: iterserve's default row over each peer
    assert f"iterserve serve w8a8{kv} / llama-server Q8_0: 3.00x" in text
    assert f"iterserve LLM w8a8{kv} / OpenVINO GenAI int8: 2.00x" in text
    assert "best OpenVINO GenAI (int8, u8 KV): 1.45x" in text  # the default row against the best
    assert sum(line.startswith(f"iterserve LLM w8a8{kv} /") for line in text.splitlines()) == 1  # int8: the like and the best


FAKE_LLAMA_SERVER = """#!{python}
# A stand-in llama-server: answers /health on --port; given a Q8_0 model, dies of SIGSEGV as it loads.
import http.server, os, signal, sys
argv = sys.argv[1:]
model, port = argv[argv.index("-m") + 1], int(argv[argv.index("--port") + 1])
print("loading", model, flush=True)
if "Q8_0" in model:
    print("ggml: about to crash", flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.timeout(60)
def test_a_peer_that_crashes_costs_its_own_row_only(tmp_path, monkeypatch, capsys):
    """Three llama-server rows: one measured, one (Q8_0) killed by SIGSEGV before /health answers, one
    (BF16) killed under load. The table has all three, the failures' log tails follow it, the JSON keeps
    the figures and the failures, and the exit status says a peer failed."""
    from iterserve.model import loader

    def fake_load(server, trace, stream, progress):  # the load run, without a real server to load
        if "BF16" in server.name:
            server.proc.kill()
            raise ConnectionResetError("[Errno 104] Connection reset by peer")
        return {"name": server.name, "output_tokens_per_s": 123.4, "ttft_mean_s": 0.5, "tpot_mean_s": 0.01,
                "stream_ttft_s": 0.05, "stream_tpot_s": 0.005, "ready_s": server.ready_s, "rss": 1 << 20}

    monkeypatch.setattr(peers, "http_target", fake_load)
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: None)  # byte prompts: no tokenizer to load
    server = executable(tmp_path / "llama-server", FAKE_LLAMA_SERVER.format(python=sys.executable))
    quantize = executable(tmp_path / "llama-quantize", '#!/bin/sh\n: > "$3"\n')  # an empty Q8_0 copy
    out = tmp_path / "peers.json"
    rc = peers.main(["--skip", "iterserve-http,iterserve-offline,openvino", "--llama-server", server,
                     "--llama-quantize", quantize, "--bf16-gguf", str(tmp_path / "m.BF16.gguf"),
                     "--peers-dir", str(tmp_path), "--quantized", "", "--num-requests", "2", "--concurrency", "2",
                     "--prompt-len", "8", "--output-len", "4", "--stream-requests", "1", "--timeout", "30",
                     "--json", str(out)])
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    q4, q8 = "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q8_0.gguf"
    row = lambda name: next(line for line in lines if line.startswith(f"  llama-server {name}"))  # noqa: E731
    assert rc == 1
    assert "123.4" in row(q4)
    assert row(q8).endswith("FAILED: crashed (signal 11: Segmentation fault) before /health answered")
    assert row("m.BF16.gguf").endswith("FAILED: crashed (signal 9: Killed) mid-run")
    at = next(i for i, line in enumerate(lines) if line.startswith(f"llama-server {q8} FAILED"))  # under the table
    assert lines[at + 1:at + 3] == [f"    | loading {tmp_path / 'models' / q8}", "    | ggml: about to crash"]
    assert printed.err.strip().endswith(f"error: 2 peer(s) failed: llama-server m.BF16.gguf, llama-server {q8}")
    report = json.loads(out.read_text())
    assert [r.get("output_tokens_per_s") for r in report["http"]] == [123.4, None, None]
    assert [r.get("failed", "").split(" (")[0] for r in report["http"]] == ["", "crashed", "crashed"]


def test_an_offline_child_that_fails_is_a_failed_row():
    cmd = [sys.executable, "-c", "import sys; print('no CPU plugin', file=sys.stderr); sys.exit(1)"]
    assert peers.guarded("OpenVINO GenAI int8", lambda: peers.run_child("OpenVINO GenAI int8", cmd, 30)) == {
        "name": "OpenVINO GenAI int8", "failed": "exited with code 1", "log_tail": "no CPU plugin"}


def test_llama_cpp_builds_natively_except_without_its_amx_backend_on_an_amx_cpu(tmp_path):
    build, flags = peers.llama_cpp_build(tmp_path, {"avx2", "fma", "f16c"})
    assert (build, flags) == (tmp_path / "build", ["-DGGML_NATIVE=ON"])
    build, flags = peers.llama_cpp_build(tmp_path, {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_int8"})
    assert build == tmp_path / "build-no-amx"
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512_BF16=ON" in flags and "-DGGML_AVX512_VNNI=OFF" in flags
    assert not any("AMX" in f for f in flags)  # ggml's AMX options default to OFF without GGML_NATIVE


def test_a_model_shape_names_its_files_and_refuses_when_they_are_missing(tmp_path):
    args = peers.parse_args(["--model-shape", "8b", "--shape-format", "q4_k_m", "--models-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="model_shapes.py --shapes 8b --formats q4_k_m"):
        peers.shape_files(args)
    (tmp_path / "8b").mkdir()
    (tmp_path / "8b" / "8b.Q4_K_M.gguf").write_bytes(b"")
    assert peers.shape_files(args).of("q4_k_m") == tmp_path / "8b" / "8b.Q4_K_M.gguf"
