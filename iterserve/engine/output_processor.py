"""What each request's outputs say: its text, stop strings, logprobs and what was handed out so far.

The scheduler owns a request's tokens and finishes it on EOS, stop token ids and length; this module
owns everything said about them (vLLM V1's OutputProcessor): it feeds each step's new tokens to the
request's Detokenizer, finds stop strings, and builds the RequestOutputs. It never edits a request:
a stop string is told to the scheduler once (`Scheduler.stop_request`), which drops the tokens after
it (a speculative step may have accepted several) and finishes the request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.engine.detokenizer import Detokenizer
from iterserve.outputs import RequestOutput
from iterserve.request import Request
from iterserve.sampling_params import SamplingParams
from iterserve.scheduler.output import SchedulerOutput, StepResult, TokenLogprobs
from iterserve.scheduler.scheduler import Scheduler


@dataclass(slots=True)
class OutputState:
    detokenizer: Detokenizer | None
    index: int = 0  # which of its parent's n sequences
    parent_id: str | None = None
    n: int = 1  # its parent's number of sequences
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # [None (the first token has none), ...]
    num_tokens_sent: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer  # None: outputs carry token ids only, no text and no stop strings
        self.scheduler = scheduler
        self.states: dict[str, OutputState] = {}  # unfinished requests' (a finished one's goes with its last output)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def add_request(self, request: Request, params: SamplingParams, index: int = 0,
                    parent_id: str | None = None) -> None:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = Detokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                      params.skip_special_tokens, params.include_stop_str_in_output)
        self.states[request.request_id] = OutputState(detokenizer, index, parent_id, params.n)

    def mark_sent(self, request: Request) -> None:
        """Its output tokens so far were handed out elsewhere (P/D: the prefill engine streamed the first)."""
        state = self.states[request.request_id]
        state.num_tokens_sent = request.num_output_tokens
        if state.detokenizer is not None:
            for token in request.output_token_ids:
                state.detokenizer.add(token)
            state.detokenizer.take_new_text(False)

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, requests: list[Request], plan: SchedulerOutput, result: StepResult,
                unfinished: bool = True) -> list[RequestOutput]:
        """The outputs of a step's requests that got tokens (`Scheduler.update`'s); unfinished=False: only
        the finished ones (the next output starts where a skipped one would have)."""
        self._add_prompt_logprobs(plan, result)
        logprobs = _logprobs_by_request(plan, result)
        outputs = []
        for request in requests:
            out = self._output(request, logprobs.get(request.request_id), unfinished)
            if out is not None:
                outputs.append(out)
        return outputs

    def final_output(self, request: Request, error: str | None = None) -> RequestOutput | None:
        """The last output of a request the engine finished itself (aborted, failed); None if it had none."""
        state = self.states.get(request.request_id)
        return None if state is None else self._emit(request, state, error)

    def _output(self, request: Request, logprobs: TokenLogprobs | None, unfinished: bool) -> RequestOutput | None:
        state = self.states[request.request_id]
        if logprobs is not None:
            state.logprobs.append(logprobs)
        if state.detokenizer is not None:
            self._detokenize(request, state.detokenizer, state.num_tokens_sent)
        if not unfinished and not request.finished:
            _take_new(request, state, False)
            return None
        return self._emit(request, state)

    def _detokenize(self, request: Request, detokenizer: Detokenizer, first: int) -> None:
        """Feed the step's new tokens (several after accepted drafts); at a stop string, tell the scheduler
        where the request ends, exactly where one-token decoding would have stopped it."""
        outputs, min_tokens = request.output_token_ids, request.sampling_params.min_tokens
        for j in range(first, len(outputs)):
            stop = detokenizer.add(outputs[j], j + 1 >= min_tokens)
            if stop is None:
                continue
            if j + 1 < len(outputs) or not request.finished:  # else it stopped at this very token (EOS,
                self.scheduler.stop_request(request, stop, j + 1)  # max_tokens): that reason stands
            return

    def _emit(self, request: Request, state: OutputState, error: str | None = None) -> RequestOutput:
        finished = request.finished
        outputs = request.output_token_ids  # a live list: RequestOutput.token_ids grows with it
        new_tokens, new_text, text = _take_new(request, state, finished)
        if finished:
            self.states.pop(request.request_id, None)
        return RequestOutput(
            request.request_id, request.prompt_token_ids, outputs, text, new_tokens, new_text,
            finished, request.status.value if finished else None, request.times,
            state.logprobs, request.stop_reason, error, state.index, state.parent_id, state.n,
            prompt_logprobs=state.prompt_logprobs, embedding=request.pooled)

    def _add_prompt_logprobs(self, plan: SchedulerOutput, result: StepResult) -> None:
        """They come chunk by chunk, in order; a prompt recomputed after a preemption repeats them."""
        for s, lps in zip(plan.scheduled, result.prompt_logprobs or ()):
            state = self.states.get(s.request_id)
            if lps is None or state is None:
                continue
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None]
            have = len(state.prompt_logprobs) - (s.start_pos + 1)  # of this chunk's, already kept
            assert have >= 0, (s.request_id, s.start_pos, len(state.prompt_logprobs))
            state.prompt_logprobs.extend(lps[have:])


def _take_new(request: Request, state: OutputState, finished: bool) -> tuple[list[int], str, str]:
    """(new tokens, new text, all text) since the previous output; the next output starts after them."""
    outputs = request.output_token_ids
    new_tokens = outputs[state.num_tokens_sent:]
    state.num_tokens_sent = len(outputs)
    if state.detokenizer is None:
        return new_tokens, "", ""
    return new_tokens, state.detokenizer.take_new_text(finished), state.detokenizer.text


def _logprobs_by_request(plan: SchedulerOutput, result: StepResult) -> dict[str, TokenLogprobs]:
    if not result.logprobs:
        return {}
    return {s.request_id: lp for s, lp in zip(plan.scheduled, result.logprobs) if lp is not None}
