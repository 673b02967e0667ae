from iterserve.engine.engine import Engine

__all__ = ["Engine"]
