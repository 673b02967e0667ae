"""Bad input to the Python API raises a clear ValueError and leaves the engine usable."""
import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.sampling_params import SamplingParams
from tests.fake_executor import FakeExecutor


@pytest.fixture
def engine():
    return Engine(EngineConfig(block_size=4), executor=FakeExecutor(num_kv_blocks=16, block_size=4, max_model_len=32))


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "the prompt is empty"),
    ("", SamplingParams(), "the prompt is empty"),
    (list(range(1, 40)), SamplingParams(), "context holds at most 32"),
    ([5, 10_000], SamplingParams(), "not in the vocabulary"),
])
def test_bad_prompt(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished() and not engine.states
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))  # still usable
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.kv.num_free_blocks == 16


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"), ({"n": 0}, "n "),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path():
    from iterserve.llm import LLM
    with pytest.raises(ValueError, match="cannot load a model"):
        LLM("/nonexistent/model.gguf")
