"""benchmarks/step_time.py --parts on the default model: one line per batch naming every part the
C layer loop timed, each seen, then the LM head and the rest."""
import pytest

from iterserve.config import EngineConfig
from iterserve.executor.model_runner import ModelRunner
from iterserve.model.cpu_decode import PARTS
from tests.bench import load_benchmark

pytestmark = pytest.mark.slow

step_time = load_benchmark("step_time")


def test_parts_line_times_every_part_of_the_step():
    runner = ModelRunner(EngineConfig(dtype="float32", num_kv_blocks=8, num_threads=1))
    if runner.model.decode_layers is None:
        pytest.skip("the layers run in the Python loop here (no C kernels)")
    line = step_time.step_parts(runner, batch=2, context=20, blocks_per_seq=2, repeats=2)
    head, _, rest = line.partition(" ms = ")
    step = float(head.split(":")[1])
    parts = {name: float(ms) for name, ms in (item.split(" ") for item in rest.split(", "))}
    assert list(parts) == [*PARTS, "lm_head", "rest"], line
    assert step > 0 and all(parts[name] > 0 for name in [*PARTS, "lm_head"]), line
    assert runner.model.decode_layers.part_seconds is None  # timing stops with the line
