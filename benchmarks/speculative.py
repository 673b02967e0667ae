"""Prompt-lookup speculative decoding through `iterserve serve`: one stream, greedy, a copy-editing task.

The prompt holds a passage of about --passage-tokens tokens (public-domain prose from the bench's data)
and asks for it back, lightly edited, so the answer mostly copies the prompt: the case n-gram drafts
are for. Two servers with the same engine flags run one after the other, speculation off and on
(--speculative-method ngram plus the flags given here); each gets one streamed chat completion at a
time of exactly --max-tokens tokens (ignore_eos), --repeats times after a warm-up. Reported per
setting: median ms per output token (first request byte to last token, over the tokens), TPOT
(first token to last), TTFT, and, with speculation, the acceptance rate and mean accepted length
from the server's /metrics. Greedy outputs are checked equal.

    python benchmarks/speculative.py                                   # SmolLM2-135M, 256 tokens, k=4
    python benchmarks/speculative.py --max-tokens 8 --repeats 1 --passage-tokens 60   # a smoke check
    (engine flags after it go to both servers, e.g. --device cuda --model PATH)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_vs_offline import start_server  # noqa: E402  (the same subprocess server, same health polling)

DATA = Path(__file__).resolve().parent.parent / "iterserve" / "bench" / "data" / "public_domain.txt"
CHARS_PER_TOKEN = 4.2  # English prose with SmolLM2's tokenizer, near enough to size the passage


def messages(passage_tokens: int) -> list[dict]:
    text = DATA.read_text()
    passage = text[:int(passage_tokens * CHARS_PER_TOKEN)].rsplit(" ", 1)[0]
    return [{"role": "user", "content": "Here is a passage. Repeat it exactly, word for word, but write "
             "'Mister' instead of 'Mr.'. Output only the passage.\n\n" + passage}]


def stream_once(url: str, body: dict) -> dict:
    """One streamed chat completion: timings, output text and token counts."""
    import httpx
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(delta)
    n = usage["completion_tokens"]
    return {"ms_per_token": 1000 * (last - t0) / n, "tpot_ms": 1000 * (last - first) / max(n - 1, 1),
            "ttft_ms": 1000 * (first - t0), "tokens": n, "prompt_tokens": usage["prompt_tokens"],
            "text": "".join(text)}


def spec_counts(url: str) -> tuple[float, float, float]:
    """(drafts, draft tokens, accepted tokens) from /metrics, since the server started."""
    import httpx
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if line.startswith(f"iterserve:spec_decode_{name}_total{{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("num_drafts", 0.0), values.get("num_draft_tokens", 0.0), values.get("num_accepted_tokens", 0.0)


def measure(engine_argv: list[str], body: dict, repeats: int, verbose: bool) -> dict:
    server, url = start_server(engine_argv, verbose)
    try:
        stream_once(url, {**body, "max_tokens": min(16, body["max_tokens"])})  # warm-up
        before = spec_counts(url)
        runs = [stream_once(url, body) for _ in range(repeats)]
        after = spec_counts(url)
    finally:
        server.terminate()
        server.wait(30)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    med = {k: statistics.median(r[k] for r in runs) for k in ("ms_per_token", "tpot_ms", "ttft_ms")}
    return {**med, "tokens": runs[0]["tokens"], "prompt_tokens": runs[0]["prompt_tokens"], "text": runs[0]["text"],
            "acceptance": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_len": 1 + accepted / drafts if drafts else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--passage-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3, help="timed requests per setting (medians reported)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="show the servers' logs")
    args, engine_argv = parser.parse_known_args()
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]), flush=True)
    body = {"model": "bench", "messages": messages(args.passage_tokens), "max_tokens": args.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    spec_argv = ["--speculative-method", "ngram", "--num-speculative-tokens", str(args.num_speculative_tokens),
                 "--prompt-lookup-max", str(args.prompt_lookup_max), "--prompt-lookup-min", str(args.prompt_lookup_min)]
    off = measure(engine_argv, body, args.repeats, args.verbose)
    on = measure(engine_argv + spec_argv, body, args.repeats, args.verbose)
    print(f"one stream, greedy, {off['prompt_tokens']} prompt tokens, {off['tokens']} output tokens, "
          f"median of {args.repeats}")
    print(f"{'speculation':<28} {'ms/token':>9} {'TPOT ms':>8} {'TTFT ms':>8} {'accepted':>9} {'mean len':>9}")
    for name, r in ((" off", off), (f" ngram k={args.num_speculative_tokens} n={args.prompt_lookup_min}.."
                                    f"{args.prompt_lookup_max}", on)):
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
        mean = "-" if r["mean_accepted_len"] is None else f"{r['mean_accepted_len']:.2f}"
        print(f"{name:<28} {r['ms_per_token']:>9.2f} {r['tpot_ms']:>8.2f} {r['ttft_ms']:>8.1f} {acc:>9} {mean:>9}")
    print(f"speed-up (ms/token off / on): {off['ms_per_token'] / on['ms_per_token']:.2f}x; "
          f"greedy outputs {'equal' if off['text'] == on['text'] else 'DIFFER'}")
    return 0 if off["text"] == on["text"] else 1


if __name__ == "__main__":
    sys.exit(main())
