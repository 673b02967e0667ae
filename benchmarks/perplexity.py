"""Perplexity of the model in each dtype / quantization mode over the same text, side by side.

    python benchmarks/perplexity.py [--modes float32,auto,int8,w8a8,int4] [--chunks 16] [--chunk-len 512]
                                    [--text FILE ...] [--model PATH]

What quantization costs in quality, as llama.cpp's `llama-perplexity` reports it: the text is cut into
--chunks windows of --chunk-len tokens, each is a prompt of its own (teacher forcing through
`prompt_logprobs`), and the perplexity is exp of the mean negative log-likelihood of every token after
each window's first. Modes: a --dtype (float32, bfloat16, auto, ...; a quantized GGUF dequantized to
floats), a --quantization (int8, int4, w8a8) in the default dtype, or `native`: a quantized GGUF served
from its own codes (`--quantization auto`; docs/models.md). The shipped Q4_1 model is served from its codes
by `int4`; a Q4_K_M file (gemma3-270m) by `native`, against `auto` for its dequantized bf16 run.
The default text is the installed torch's `nn/modules` sources (English comments and Python, the same
bytes wherever torch==2.13.0 is installed); compare the modes of one run, not figures across texts or models.
"""
from __future__ import annotations

import argparse
import glob
import math
import os

import torch

from iterserve import LLM, SamplingParams

QUANTIZATIONS = ("int8", "int4", "w8a8")


def default_text() -> list[str]:
    return sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "*.py")))[:6]


def perplexity(llm: LLM, chunks: list[list[int]]) -> tuple[float, int]:
    outs = llm.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    nll = [-lp.logprob for o in outs for lp in o.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll)), len(nll)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="float32,auto,int8,w8a8,int4")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--text", nargs="*", default=None, help="text files, read in order (default: see above)")
    ap.add_argument("--model", default=None, help="default: the shipped SmolLM2-135M-Instruct GGUF")
    args = ap.parse_args()
    text = "\n\n".join(open(path, encoding="utf-8").read() for path in (args.text or default_text()))
    chunks, base = None, None
    print(f"{'mode':<10} {'perplexity':>11} {'vs first':>9} {'tokens':>7}")
    for mode in args.modes.split(","):
        quantization = "auto" if mode == "native" else mode if mode in QUANTIZATIONS else None
        try:
            llm = LLM(args.model, dtype="auto" if quantization else mode, quantization=quantization,
                      max_num_seqs=8, num_kv_blocks=8 * -(-args.chunk_len // 16) + 8)
        except ValueError as e:
            print(f"{mode:<10} skipped: {e}", flush=True)
            continue
        if chunks is None:
            ids = llm.tokenizer.encode(text)
            if len(ids) < args.chunks * args.chunk_len:
                raise SystemExit(f"perplexity.py: the text has {len(ids)} tokens, fewer than --chunks x --chunk-len")
            chunks = [ids[i * args.chunk_len:(i + 1) * args.chunk_len] for i in range(args.chunks)]
        ppl, n = perplexity(llm, chunks)
        base = base or ppl
        print(f"{mode:<10} {ppl:>11.4f} {ppl / base - 1:>+9.1%} {n:>7}", flush=True)
        del llm


if __name__ == "__main__":
    main()
