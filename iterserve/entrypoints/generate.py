"""`iterserve generate`: complete one prompt offline and print it (or JSON with timings)."""
from __future__ import annotations

import argparse
import json
import sys

from iterserve.entrypoints.args import HelpFormatter, add_engine_args, config_from_args, fail
from iterserve.sampling_params import SamplingParams


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="iterserve generate", description="generate text for one prompt",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--system", default=None, help="system message with --chat")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: off)")
    parser.add_argument("--sample-seed", type=int, default=None, help="seed for this request's sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the result and its timings as JSON")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    from iterserve.engine import Engine
    from iterserve.llm import apply_chat_template

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sample_seed, stop=args.stop)
        engine = Engine(config_from_args(args))
        prompt = args.prompt
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            prompt = apply_chat_template(engine.tokenizer, messages + [{"role": "user", "content": args.prompt}])
        engine.add_request(prompt, params, request_id="cli")
    except ValueError as exc:
        fail(str(exc))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if not args.json:
                print(out.new_text, end="", flush=True)
            final = out
    if args.json:
        t = final.times
        print(json.dumps({"text": final.text, "token_ids": final.token_ids, "finish_reason": final.finish_reason,
                          "prompt_tokens": final.num_prompt_tokens, "completion_tokens": len(final.token_ids),
                          "ttft_s": t.ttft, "tpot_s": t.tpot, "e2e_s": t.e2e, "queue_s": t.queue_time}, indent=2))
    else:
        print()
    return 0
