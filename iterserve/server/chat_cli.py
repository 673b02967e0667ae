"""`iterserve chat`: talk to a model in the terminal, through a running server (--url) or in process.

Type a message and press Enter; /reset clears the history, /exit (or Ctrl-D) leaves.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Iterator

from iterserve.entrypoints.args import HelpFormatter, add_engine_args, config_from_args

Message = dict[str, str]


def http_backend(url: str, model: str | None, api_key: str | None, params: dict) -> Callable[[list[Message]], Iterator[str]]:
    import httpx

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if model is None:
        model = httpx.get(base + "/models", headers=headers, timeout=10).json()["data"][0]["id"]

    def reply(messages: list[Message]) -> Iterator[str]:
        body = {"model": model, "messages": messages, "stream": True, **params}
        with httpx.stream("POST", base + "/chat/completions", json=body, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(r.json().get("error", {}).get("message", r.text))
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                for choice in chunk.get("choices", []):
                    yield choice["delta"].get("content") or ""
    return reply


def local_backend(args: argparse.Namespace, params: dict) -> Callable[[list[Message]], Iterator[str]]:
    from iterserve.engine import Engine
    from iterserve.llm import apply_chat_template
    from iterserve.sampling_params import SamplingParams

    engine = Engine(config_from_args(args))

    def reply(messages: list[Message]) -> Iterator[str]:
        prompt = apply_chat_template(engine.tokenizer, messages)
        room = engine.max_model_len - len(prompt)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=max(1, min(params["max_tokens"], room)),
                                                        temperature=params["temperature"]))
        try:
            while engine.has_unfinished():
                for out in engine.step():
                    yield out.new_text
        finally:
            engine.abort_request(rid)  # Ctrl-C mid-answer frees its blocks
    return reply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="iterserve chat", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: in process)")
    parser.add_argument("--served-model-name", dest="model_name", default=None,
                        help="with --url: the model name to send (default: the server's first model)")
    parser.add_argument("--api-key", default=None, help="with --url: the server's bearer key")
    parser.add_argument("--system", default=None, help="a system prompt")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    reply = (http_backend(args.url, args.model_name, args.api_key, params) if args.url
             else local_backend(args, params))
    history: list[Message] = [{"role": "system", "content": args.system}] if args.system else []
    print("iterserve chat: /reset clears the history, /exit leaves", file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        print("assistant> ", end="", flush=True)
        answer = ""
        try:
            for piece in reply(history):
                answer += piece
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]", end="")
        except RuntimeError as e:
            print(f"[error: {e}]", end="")
            history.pop()
            print()
            continue
        print()
        history.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    sys.exit(main())
