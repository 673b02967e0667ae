"""Offline batch API: `LLM(model).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from typing import Sequence

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        if "cache_config" not in engine_args:  # a batch fills the pool: fault it in before, not during
            engine_args.setdefault("populate_kv_cache", True)
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run prompts to completion together; outputs come back in prompt order, and a prompt whose
        params ask for n > 1 sequences contributes n outputs in a row (by `index`; `parent_id` names it)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            for rid in ids:  # all or nothing: the engine stays clean for the next call
                self.engine.abort_request(rid)
            raise
        counts = [p.n for p in params]
        return self._run(ids, counts, len(ids) > 1 if use_tqdm is None else use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in conversations], params, use_tqdm)

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def _run(self, ids: list[str], counts: list[int], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[tuple[str, int], RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=sum(counts), desc="generate", unit="seq")
        while len(final) < sum(counts):
            for out in self.engine.step():
                if out.finished:
                    final[out.parent_id or out.request_id, out.index] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [final[rid, k] for rid, n in zip(ids, counts) for k in range(n)]


def apply_chat_template(tokenizer, messages: list[Message]) -> list[int]:
    """Render with the model's own template (sandboxed Jinja inside transformers), then tokenize."""
    check_messages(messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_messages(messages: list[Message]) -> None:
    if not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"each message needs a role (system, user, assistant, tool) and string content; got {m!r}")
