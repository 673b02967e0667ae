"""--kv-cache-dtype int8 in the simulator: the same sizing rule as the real engine (KVCacheSpec,
num_blocks_for), so the pool holds ~1.9x the blocks of a bfloat16 one, and a step reads fewer K/V bytes."""
import pytest

from iterserve.config import EngineConfig
from iterserve.sim.cli import make_executor
from iterserve.sim.cost_model import CostModel
from iterserve.sim.hardware import get_hardware
from iterserve.sim.model_spec import get_model_spec, with_kv_cache_dtype

LLAMA, A100 = get_model_spec("llama-2-7b"), get_hardware("a100-80gb")  # bfloat16, head_dim 128


def test_int8_bytes_per_token_carry_a_scale_per_kv_head():
    i8 = with_kv_cache_dtype(LLAMA, "int8")
    assert i8.kv_bytes_per_token == 2 * 32 * 32 * (128 + 4)
    assert with_kv_cache_dtype(LLAMA, "auto") is LLAMA and i8.weight_bytes == LLAMA.weight_bytes


@pytest.mark.parametrize("hardware", ["a100-80gb", "cpu-local"])  # profiled GPU memory; a CPU byte budget
def test_pool_holds_about_twice_the_blocks(hardware):
    hw = get_hardware(hardware)
    bf16, i8 = (make_executor(EngineConfig(kv_cache_dtype=d, kv_cache_memory="4GiB"), LLAMA, hw)
                for d in ("auto", "int8"))
    assert (bf16.kv_cache_spec.dtype, i8.kv_cache_spec.dtype) == ("bfloat16", "int8")
    assert i8.num_kv_blocks / bf16.num_kv_blocks == pytest.approx(2 * 128 / 132, rel=2e-3)
    blocks = i8.read_blocks([0, 1])
    assert blocks.shape[-1] == 132 and blocks.nbytes == 2 * i8.kv_cache_spec.bytes_per_block


def test_a_decode_step_reads_fewer_kv_bytes():
    bf16, i8 = CostModel(LLAMA, A100), CostModel(with_kv_cache_dtype(LLAMA, "int8"), A100)
    assert i8.decode_step_time(64, 2048) < bf16.decode_step_time(64, 2048)
