"""iterserve: a continuous-batching LLM inference engine."""
from iterserve.config import EngineConfig
from iterserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name: str):
    if name == "LLM":  # torch and the model stack load only when used
        from iterserve.llm import LLM
        return LLM
    raise AttributeError(name)
