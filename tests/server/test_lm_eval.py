"""lm-evaluation-harness as a real client: a multiple-choice (loglikelihood) task through
local-completions scores like lm-eval's own hf backend on the same tiny float32 weights, and a
generate_until task runs through local-chat-completions with concurrent requests. No downloads:
the task and its data are written here; the weights are random, the tokenizer the default model's."""
from __future__ import annotations

import json

import pytest

from iterserve.config import EngineConfig
from iterserve.engine import Engine
from tests.server.conftest import MODEL, start_server

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]' accelerate)")
pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api]")
pytest.importorskip("accelerate", reason="lm-eval's hf backend needs accelerate")

QUESTIONS = [
    ("The sky on a clear day is", [" blue", " green", " loud", " square"], 0),
    ("Two plus two equals", [" four", " seven", " a cat", " Tuesday"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " north", " quickly"], 0),
    ("The opposite of hot is", [" cold", " up", " seven", " banana"], 0),
    ("Cats like to chase", [" mice", " planets", " taxes", " verbs"], 0),
    ("The sun rises in the", [" east", " west", " fridge", " song"], 0),
    ("A week has seven", [" days", " wheels", " oceans", " teeth"], 0),
    ("Paris is the capital of", [" France", " Mars", " music", " Tuesday"], 0),
]
GEN_QUESTIONS = ["Say hello.", "Name a colour.", "Count to three.", "What is 2+2?", "Name a fruit.", "Say yes."]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    (d / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                        for q, c, a in QUESTIONS))
    (d / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in GEN_QUESTIONS))
    data = lambda name: f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / name}\ntest_split: test\n"  # noqa: E731
    (d / "mc.yaml").write_text("task: iterserve_mc\n" + data("mc.jsonl") + "output_type: multiple_choice\n"
                               "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
                               "metric_list:\n  - metric: acc\n")
    (d / "gen.yaml").write_text("task: iterserve_gen\n" + data("gen.jsonl") + "output_type: generate_until\n"
                                "doc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
                                "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
                                "metric_list:\n  - metric: exact_match\n")
    return str(d)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = start_server(Engine(EngineConfig(model=tiny_model_dir, dtype="float32", num_kv_blocks=512, max_num_seqs=16)))
    yield s
    s.stop()


def evaluate(model: str, model_args: dict, task: str, tasks_dir: str, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True,
                                   task_manager=TaskManager(include_path=tasks_dir), **kwargs)


@pytest.mark.slow
def test_multiple_choice_through_local_completions_scores_like_the_hf_backend(server, tiny_model_dir, tasks):
    ours = evaluate("local-completions", {"base_url": server.base_url + "/completions", "model": MODEL,
                                          "tokenizer": tiny_model_dir, "tokenizer_backend": "huggingface",
                                          "batch_size": 4, "num_concurrent": 2, "max_retries": 1}, "iterserve_mc", tasks)
    hf = evaluate("hf", {"pretrained": tiny_model_dir, "dtype": "float32", "device": "cpu", "batch_size": 4},
                  "iterserve_mc", tasks)
    assert ours["results"]["iterserve_mc"]["acc,none"] == hf["results"]["iterserve_mc"]["acc,none"]
    ll = lambda r: {s["doc_id"]: [x[0] for x in s["filtered_resps"]] for s in r["samples"]["iterserve_mc"]}  # noqa: E731
    a, b = ll(ours), ll(hf)
    assert a.keys() == b.keys() == set(range(len(QUESTIONS)))
    for doc in a:
        assert max(abs(x - y) for x, y in zip(a[doc], b[doc])) < 0.05, (doc, a[doc], b[doc])


@pytest.mark.slow
def test_generate_until_through_local_chat_completions_with_concurrent_prompts(server, tiny_model_dir, tasks):
    r = evaluate("local-chat-completions", {"base_url": server.base_url + "/chat/completions", "model": MODEL,
                                             "num_concurrent": 6, "max_retries": 1}, "iterserve_gen", tasks,
                 apply_chat_template=True)
    samples = r["samples"]["iterserve_gen"]
    assert len(samples) == len(GEN_QUESTIONS)
    assert all(isinstance(s["resps"][0][0], str) and s["resps"][0][0] for s in samples)
