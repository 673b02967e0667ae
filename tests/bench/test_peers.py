"""benchmarks/peers.py's pure helpers: the one KV budget every engine gets, and its report table."""
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
