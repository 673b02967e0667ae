"""What the engine thread logs: each finished request, and a status line while there is work."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from iterserve.engine.stats import EngineStats
from iterserve.outputs import RequestOutput

logger = logging.getLogger("iterserve.server")


def log_finished(out: RequestOutput) -> None:
    t = out.times
    ms = lambda x: "-" if x is None else f"{1000 * x:.0f}ms"  # noqa: E731
    logger.info("request %s %s: prompt %d tokens, output %d tokens, TTFT %s, e2e %s",
                out.request_id, out.finish_reason, out.num_prompt_tokens, len(out.token_ids), ms(t.ttft), ms(t.e2e))


@dataclass(slots=True)
class _StatusLine:
    """One engine status line every `interval` seconds, only while there is work."""

    interval: float
    last: float = 0.0
    tokens: int = 0

    def idle(self) -> None:
        self.last, self.tokens = 0.0, 0

    def maybe_log(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        self.tokens += sum(len(o.new_token_ids) for o in outputs)
        if self.last == 0.0:
            self.last = now
        elif now - self.last >= self.interval:
            rate, spec = stats.spec_acceptance_rate, ""
            if rate is not None:
                spec = f", drafts accepted {100 * rate:.1f}% ({stats.spec_mean_accepted_len:.2f} tokens a drafted step)"
            logger.info("engine: running %d, waiting %d, KV usage %.1f%%, %.1f tokens/s%s", stats.num_running,
                        stats.num_queued, 100 * stats.kv_usage, self.tokens / (now - self.last), spec)
            self.last, self.tokens = now, 0
