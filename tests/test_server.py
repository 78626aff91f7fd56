"""The tiny checkpoint through SGLang's real server, token for token against the golden model.

Every request is greedy with ignore_eos, so the server and the golden model must
produce the same MAX_NEW tokens. Prompts cover: shorter than index_topk (the
sparse layers attend to everything), longer (the indexer really drops
positions), a single token, and prompts long enough to span several chunked-
prefill chunks on the CPU defaults.
"""

from __future__ import annotations

import concurrent.futures
import random

import openai
import pytest
import requests

pytestmark = pytest.mark.slow

MAX_NEW = 64


def _prompts():
    rng = random.Random(0)
    return [
        [rng.randrange(3, 2000) for _ in range(n)] for n in (1, 9, 40, 300)
    ]


def _generate(url, input_ids, **extra):
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
    body.update(extra)
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def test_generate_matches_golden(cpu_server, golden):
    prompts = _prompts()
    out = _generate(cpu_server.url, prompts)  # one batched request
    for ids, res in zip(prompts, out):
        assert res["output_ids"] == golden.generate(ids, MAX_NEW), f"prompt of {len(ids)} tokens"


def test_multi_turn_prefix_cache_hit_matches_golden(cpu_server, golden):
    """A second turn extends the first turn's whole sequence: the radix cache restores
    latent KV, index-K and the KDA state/conv window where the first request ended."""
    ids = _prompts()[3][:200]
    first = _generate(cpu_server.url, ids)
    assert first["output_ids"] == golden.generate(ids, MAX_NEW)
    turn2 = ids + first["output_ids"] + [11, 12, 13]
    second = _generate(cpu_server.url, turn2)
    assert second["meta_info"]["cached_tokens"] >= len(ids)
    assert second["output_ids"] == golden.generate(turn2, MAX_NEW)


def test_openai_completions_chat_and_streaming(cpu_server, golden, tokenizer):
    client = openai.OpenAI(base_url=cpu_server.url + "/v1", api_key="unused")
    extra = {"return_token_ids": True, "ignore_eos": True}
    prompt = "def fibonacci(n):\n    "
    ids = tokenizer.encode(prompt)
    want = golden.generate(ids, MAX_NEW)

    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body=extra)
    assert done.choices[0].token_ids == want
    assert done.choices[0].text == tokenizer.decode(want)

    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                       stream=True, extra_body=extra)
    streamed = [t for chunk in stream for t in (chunk.choices[0].token_ids or [])]
    assert streamed == want

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={**extra, "return_prompt_token_ids": True})
    chat_prompt = chat.choices[0].prompt_token_ids
    assert chat_prompt == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.choices[0].token_ids == golden.generate(chat_prompt, MAX_NEW)

    # Chat streaming returns text only: it must add up to the (golden-checked) non-streamed answer.
    chat_stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
    streamed_text = "".join(chunk.choices[0].delta.content or "" for chunk in chat_stream if chunk.choices)
    assert streamed_text == chat.choices[0].message.content


def test_frontend_language_gen_select_fork(cpu_server, golden, tokenizer):
    import sglang as sgl
    import torch

    @sgl.function
    def program(s, question):
        s += question
        s += sgl.gen("answer", max_tokens=MAX_NEW, temperature=0, ignore_eos=True, return_logprob=True)
        s += "\nVerdict:"
        s += sgl.select("verdict", choices=[" correct", " wrong", " unsure"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nHint {i}: "
            f += sgl.gen("hint", max_tokens=16, temperature=0, ignore_eos=True, return_logprob=True)
        s["hints"] = [f for f in forks]

    backend = sgl.RuntimeEndpoint(cpu_server.url)
    question = "Question: what does len([1, 2, 3]) return?\nAnswer:"
    state = program.run(question=question, backend=backend)

    def served_ids(st, name):
        return [t[1] for t in st.get_meta_info(name)["output_token_logprobs"]]

    assert served_ids(state, "answer") == golden.generate(tokenizer.encode(question), MAX_NEW)

    # select: per-choice token logprobs agree with the golden model, and so does the decision.
    info = state.get_meta_info("verdict")
    text = question + state["answer"] + "\nVerdict:"
    scores = []
    for choice, served in zip([" correct", " wrong", " unsure"], info["input_token_logprobs"]):
        ids = tokenizer.encode(text + choice)
        logprobs = torch.log_softmax(golden.logits(ids), dim=-1)
        start = len(ids) - len(served)
        assert [t[1] for t in served] == ids[start:]
        gold = [float(logprobs[p - 1, ids[p]]) for p in range(start, len(ids))]
        for (lp, _, _), g in zip(served, gold):
            if lp is not None:
                assert abs(lp - g) < 1e-3
        scores.append(sum(gold[1:]) / len(gold[1:]))
    assert state["verdict"] == [" correct", " wrong", " unsure"][max(range(3), key=scores.__getitem__)]

    for i, fork in enumerate(state["hints"]):
        prefix = text + state["verdict"] + f"\nHint {i}: "
        assert served_ids(fork, "hint") == golden.generate(tokenizer.encode(prefix), 16)


def test_concurrent_requests_with_shared_prefix(cpu_server, golden):
    rng = random.Random(1)
    shared = [rng.randrange(3, 2000) for _ in range(48)]
    prompts = [shared + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda ids: _generate(cpu_server.url, ids), prompts))
    for ids, res in zip(prompts, results):
        assert res["output_ids"] == golden.generate(ids, MAX_NEW)


def test_request_longer_than_context_is_rejected_and_server_keeps_serving(cpu_server, golden):
    too_long = [7] * 1100  # the tiny preset's context is 1024
    r = requests.post(cpu_server.url + "/generate",
                      json={"input_ids": too_long, "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 400
    assert "longer than the model's context length" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=cpu_server.url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="tiny", prompt=too_long, max_tokens=4)
    ids = [5, 6, 7]
    assert _generate(cpu_server.url, ids)["output_ids"] == golden.generate(ids, MAX_NEW)


def test_memory_leak_check_stays_clean(cpu_server):
    """SGLang checks its pools for leaks whenever the scheduler goes idle (strict mode raises)."""
    import time

    time.sleep(5)
    assert requests.get(cpu_server.url + "/health", timeout=30).status_code == 200
    log = cpu_server.read_log()
    assert "memory leak detected" not in log
    assert "double free" not in log and "use-after-free" not in log
