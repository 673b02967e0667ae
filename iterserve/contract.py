"""A typing.Protocol checked once, at construction: every member an object lacks is named in one error,
instead of an AttributeError on the first call that needs it (or a default that hides it).

Users: the Executor (executor/base.py), the EngineCore (engine/core.py) and the EngineClient
(server/engine_client.py). Torch-free, imports nothing of iterserve.
"""
from __future__ import annotations


def members(protocol: type) -> tuple[str, ...]:
    """A Protocol's public attributes and methods, in the order it declares them."""
    names = list(vars(protocol).get("__annotations__", {}))
    names += [n for n, v in vars(protocol).items() if (callable(v) or isinstance(v, property)) and n not in names]
    return tuple(n for n in names if not n.startswith("_"))


def methods(protocol: type) -> tuple[str, ...]:
    """A Protocol's public methods."""
    return tuple(n for n in members(protocol) if callable(vars(protocol).get(n)))


def missing_members(obj: object, names: tuple[str, ...]) -> list[str]:
    """The names `obj` lacks. A member it forwards to an inner object that lacks it is named with that object:
    'tokenizer (its BareEngine has no tokenizer)'."""
    missing = []
    for name in names:
        try:
            getattr(obj, name)
        except AttributeError as e:
            inner = getattr(e, "obj", None)
            forwarded = inner is not None and inner is not obj
            missing.append(f"{name} (its {type(inner).__name__} has no {e.name})" if forwarded else name)
    return missing


def check_members(obj: object, protocol: type) -> None:
    """Raise TypeError naming every member of `protocol` that `obj` lacks, or any it has but cannot call."""
    what = f"{protocol.__name__} contract"
    missing = missing_members(obj, members(protocol))
    if missing:
        raise TypeError(f"{type(obj).__name__} does not implement the {what}: missing {', '.join(missing)}")
    wrong = [f"{n} is not callable" for n in methods(protocol) if not callable(getattr(obj, n))]
    if wrong:
        raise TypeError(f"{type(obj).__name__} does not implement the {what}: {'; '.join(wrong)}")
