"""A fake executor for speculative decoding: sequences fall into loops that n-gram drafts predict, and
drafts are verified the way ModelRunner verifies them (greedy: keep them up to the first one the
model disagrees with, then the model's own token)."""
from __future__ import annotations

from iterserve.scheduler.output import SchedulerOutput, StepResult
from tests.fake_executor import FakeExecutor


class LoopExecutor(FakeExecutor):
    """Next token = (last * 5 + 1 + [position % wobble == 0]) % vocab: mostly a function of the last
    token (loops), with a position-dependent nudge so that some drafts are wrong."""

    def __init__(self, vocab_size: int = 37, wobble: int = 7, **kwargs) -> None:
        super().__init__(vocab_size=vocab_size, **kwargs)
        self.wobble = wobble

    def next_token(self, last: int, pos: int) -> int:
        """The token at position `pos`, after `last` at pos - 1."""
        return (last * 5 + 1 + (pos % self.wobble == 0)) % self.vocab_size

    def reference(self, prompt: list[int], n: int) -> list[int]:
        """What one-token greedy decoding produces: n tokens after the prompt."""
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(self.next_token(tokens[-1], len(tokens)))
        return tokens[len(prompt):]

    def execute(self, plan: SchedulerOutput) -> StepResult:
        result = super().execute(plan)  # writes the cache and checks the slots
        accepted: list[list[int]] = []
        for i, s in enumerate(plan.scheduled):
            d = s.num_draft_tokens
            if result.sampled[i] < 0:
                accepted.append([])
                continue
            first = len(s.token_ids) - d - 1  # the request's own last token; drafts follow it
            targets = [self.next_token(s.token_ids[first + j], s.start_pos + first + j + 1) for j in range(d + 1)]
            a = 0
            while a < d and s.token_ids[first + 1 + a] == targets[a]:
                a += 1
            accepted.append(targets[:a])
            result.sampled[i] = targets[a]
        if any(s.num_draft_tokens for s in plan.scheduled):
            result.accepted_drafts = accepted
        return result
