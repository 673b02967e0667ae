"""lm-evaluation-harness through iterserve's OpenAI API against lm-eval's own hf backend, same weights.

    pip install 'lm-eval[api]' accelerate
    python benchmarks/lm_eval_parity.py --model-dir PATH --tasks arc_easy --limit 100   # any HF Llama-family dir

Starts an in-process iterserve server on PATH (float32), runs the tasks through `local-completions`
(loglikelihood: echo + logprobs, batched prompts) and through `hf`, and prints each task's metrics
side by side with the largest per-choice log-likelihood gap. Tasks that need a download fetch
their data set through lm-eval (tests/server/test_lm_eval.py is the offline version of this).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lm_eval

from iterserve.config import EngineConfig
from iterserve.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' in-process server helper
from tests.server.conftest import MODEL, start_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tasks", default="arc_easy")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--include-path", default=None, help="a folder of your own task YAMLs")
    args = ap.parse_args()
    tasks = args.tasks.split(",")
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_path=args.include_path)
    server = start_server(Engine(EngineConfig(model=args.model_dir, dtype="float32", max_num_seqs=32)))
    try:
        ours = lm_eval.simple_evaluate(
            model="local-completions", tasks=tasks, limit=args.limit, log_samples=True, task_manager=manager,
            model_args={"base_url": server.base_url + "/completions", "model": MODEL, "tokenizer": args.model_dir,
                        "tokenizer_backend": "huggingface", "batch_size": args.batch_size, "num_concurrent": 4})
    finally:
        server.stop()
    hf = lm_eval.simple_evaluate(model="hf", tasks=tasks, limit=args.limit, log_samples=True, task_manager=manager,
                                 model_args={"pretrained": args.model_dir, "dtype": "float32", "device": "cpu",
                                             "batch_size": args.batch_size})
    print(f"command: {' '.join(sys.argv)}")
    print(f"{'task':<24} {'metric':<14} {'iterserve':>10} {'hf':>10} {'max |d loglik|':>15}")
    for task in tasks:
        a = {s["doc_id"]: s["filtered_resps"] for s in ours["samples"][task]}
        b = {s["doc_id"]: s["filtered_resps"] for s in hf["samples"][task]}
        gap = max((abs(x[0] - y[0]) for d in a for x, y in zip(a[d], b[d])
                   if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple))), default=float("nan"))
        for metric, value in ours["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                print(f"{task:<24} {metric:<14} {value:>10.4f} {hf['results'][task][metric]:>10.4f} {gap:>15.4f}")


if __name__ == "__main__":
    main()
