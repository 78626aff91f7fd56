"""A checkpoint (--preset, tiny by default) through SGLang's real server, against the golden model.

Every request is greedy with ignore_eos, so the server and the golden model must
produce the same MAX_NEW tokens (on CPU identical, on a GPU up to near ties: see
conftest.Tolerance). Prompts cover: shorter than index_topk (the
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
import torch

from conftest import Server

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


def test_generate_matches_golden(server, check):
    prompts = _prompts()
    out = _generate(server.url, prompts)  # one batched request
    for ids, res in zip(prompts, out):
        check.greedy(ids, res["output_ids"])


def test_multi_turn_prefix_cache_hit_matches_golden(server, check):
    """A second turn extends the first turn's whole sequence: the radix cache restores
    latent KV, index-K and the KDA state/conv window where the first request ended."""
    ids = _prompts()[3][:200]
    first = _generate(server.url, ids)
    check.greedy(ids, first["output_ids"])
    turn2 = ids + first["output_ids"] + [11, 12, 13]
    second = _generate(server.url, turn2)
    assert second["meta_info"]["cached_tokens"] >= len(ids)
    check.greedy(turn2, second["output_ids"])


def test_openai_completions_chat_and_streaming(server, check, tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    extra = {"return_token_ids": True, "ignore_eos": True}
    prompt = "def fibonacci(n):\n    "
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body=extra)
    want = done.choices[0].token_ids
    check.greedy(tokenizer.encode(prompt), want)
    # The OpenAI endpoints skip special tokens in text by default (SGLang's skip_special_tokens).
    assert done.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)

    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                       stream=True, extra_body=extra)
    streamed = [t for chunk in stream for t in (chunk.choices[0].token_ids or [])]
    assert streamed == want

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={**extra, "return_prompt_token_ids": True})
    chat_prompt = chat.choices[0].prompt_token_ids
    assert chat_prompt == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    check.greedy(chat_prompt, chat.choices[0].token_ids)

    # Chat streaming returns text only: it must add up to the (golden-checked) non-streamed answer.
    chat_stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
    streamed_text = "".join(chunk.choices[0].delta.content or "" for chunk in chat_stream if chunk.choices)
    assert streamed_text == chat.choices[0].message.content


def test_frontend_language_gen_select_fork(server, check, golden, tokenizer, tolerance):
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

    backend = sgl.RuntimeEndpoint(server.url)
    question = "Question: what does len([1, 2, 3]) return?\nAnswer:"
    state = program.run(question=question, backend=backend)

    def served_ids(st, name):
        return [t[1] for t in st.get_meta_info(name)["output_token_logprobs"]]

    check.greedy(tokenizer.encode(question), served_ids(state, "answer"))

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
                assert abs(lp - g) <= tolerance.logprob
        scores.append(sum(gold[1:]) / len(gold[1:]))
    chosen = [" correct", " wrong", " unsure"].index(state["verdict"])
    assert max(scores) - scores[chosen] <= tolerance.margin

    for i, fork in enumerate(state["hints"]):
        prefix = text + state["verdict"] + f"\nHint {i}: "
        check.greedy(tokenizer.encode(prefix), served_ids(fork, "hint"))


def _prefill_graph_replays(log: str) -> int:
    return sum("Prefill batch" in line and "cuda graph: True" in line for line in log.splitlines())


@pytest.mark.gpu
def test_prefill_replays_sglangs_breakable_cuda_graph(server, check):
    """On a GPU, prefill runs in SGLang's breakable CUDA graph: the forward is captured per token
    bucket and each KDA and sparse layer's backend call is an eager break on the live batch
    (layers.prefill_graph). A ragged batch padded up to its bucket, and a second turn over the
    first one's cached prefix, replay it and match the golden model."""
    assert "Capture target prefill CUDA graph end" in server.read_log()
    before = _prefill_graph_replays(server.read_log())
    prompts = _prompts()[1:]  # one batch, in chunks of GPU_SERVER_ARGS' 128 tokens: each padded to its bucket
    for ids, res in zip(prompts, _generate(server.url, prompts)):
        check.greedy(ids, res["output_ids"])
    ids = prompts[-1][:120]
    first = _generate(server.url, ids)
    turn2 = ids + first["output_ids"] + [11, 12, 13]
    second = _generate(server.url, turn2)
    assert second["meta_info"]["cached_tokens"] > 0
    check.greedy(ids, first["output_ids"])
    check.greedy(turn2, second["output_ids"])
    assert _prefill_graph_replays(server.read_log()) >= before + 3


def test_concurrent_requests_with_shared_prefix(server, check):
    rng = random.Random(1)
    shared = [rng.randrange(3, 2000) for _ in range(48)]
    prompts = [shared + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda ids: _generate(server.url, ids), prompts))
    for ids, res in zip(prompts, results):
        check.greedy(ids, res["output_ids"])


def test_request_longer_than_context_is_rejected_and_server_keeps_serving(server, check, context_len):
    too_long = [7] * (context_len + 76)
    r = requests.post(server.url + "/generate",
                      json={"input_ids": too_long, "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 400
    assert "longer than the model's context length" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="tiny", prompt=too_long, max_tokens=4)
    ids = [5, 6, 7]
    check.greedy(ids, _generate(server.url, ids)["output_ids"])


def test_token_ids_outside_the_vocabulary_are_rejected_and_server_keeps_serving(server, check, checkpoint):
    """SGLang 0.5.17 let such an id reach the embedding, and the scheduler died (plugin hook)."""
    from sglang_hybrid.configs import HybridLinearSparseConfig

    vocab = HybridLinearSparseConfig.from_pretrained(checkpoint).vocab_size
    for bad in (vocab, -1):
        r = requests.post(server.url + "/generate",
                          json={"input_ids": [5, bad, 7], "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        assert r.status_code == 400, r.text
        assert f"token id {bad}, outside the model's vocabulary [0, {vocab})" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary"):
        client.completions.create(model="tiny", prompt=[3, vocab + 5], max_tokens=4)
    ids = [5, 6, 7]
    check.greedy(ids, _generate(server.url, ids)["output_ids"])


def test_memory_leak_check_stays_clean(server):
    """SGLang checks its pools for leaks whenever the scheduler goes idle (strict mode raises)."""
    import time

    time.sleep(5)
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    log = server.read_log()
    assert "memory leak detected" not in log
    assert "double free" not in log and "use-after-free" not in log


def test_logprobs_match_golden(server, golden, tolerance):
    """Prefill (input) and decode (output) log-probabilities against the golden model's,
    teacher-forced on the served tokens. The measured max error is printed and, with
    $SGLANG_HYBRID_TEST_LOGS set, written to logprob_error.json there."""
    import json
    import os

    errors = logprob_errors(server, golden)
    print(f"max |served - golden| logprob: {errors} (tolerance {tolerance.logprob})")
    if os.environ.get("SGLANG_HYBRID_TEST_LOGS"):
        with open(os.path.join(os.environ["SGLANG_HYBRID_TEST_LOGS"], "logprob_error.json"), "w") as f:
            json.dump({**errors, "tolerance": tolerance.logprob}, f)
    assert max(errors.values()) <= tolerance.logprob


def logprob_errors(server, golden) -> dict[str, float]:
    """Max |served - golden| log-probability of the served tokens, over prefill and decode."""
    import torch

    errors = {"prefill": 0.0, "decode": 0.0}
    for ids in _prompts()[1:]:
        res = _generate(server.url, ids, return_logprob=True, logprob_start_len=0)
        served = res["output_ids"]
        seq = ids + served
        gold = torch.log_softmax(golden.logits(seq[:-1]).float(), dim=-1).cpu()
        want = gold[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        inputs = res["meta_info"]["input_token_logprobs"][1:]  # the first token has no logprob
        outputs = res["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in inputs] == ids[1:] and [t[1] for t in outputs] == served
        for kind, got, ref in (("prefill", inputs, want[: len(ids) - 1]), ("decode", outputs, want[len(ids) - 1 :])):
            err = (torch.tensor([t[0] for t in got]) - ref).abs().max().item()
            errors[kind] = max(errors[kind], err)
    return errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a host without a GPU")
@pytest.mark.parametrize("args, reason", [
    (["--attention-backend", "triton"],
     "runs only on --attention-backend hybrid_linear_sparse or hybrid_linear_sparse_flashmla"),
    (["--attention-backend", "hybrid_linear_sparse_flashmla"], "FlashMLA sparse attention needs a Hopper or newer GPU"),
    (["--cuda-graph-backend-prefill", "breakable"], "cannot run prefill in a 'breakable' CUDA graph here: it needs a GPU"),
    (["--tp-size", "2", "--attn-cp-size", "2", "--enable-prefill-cp", "--cp-strategy", "interleave"],
     "context-parallel prefill with --cp-strategy zigzag only"),
    (["--tp-size", "2", "--attn-cp-size", "2", "--enable-prefill-cp", "--cp-strategy", "zigzag", "--moe-dp-size", "2"],
     "serve it with --moe-dp-size 1"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "{checkpoint}",
      "--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"],
     "a hybrid draft needs KDA state slots of its own"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "{dense_draft}",
      "--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"],
     "STANDALONE drafts chains only on CPU"),
])
def test_unservable_arguments_stop_the_server_with_their_reason(checkpoint, tmp_path, args, reason):
    from sglang_hybrid.checkpoints.maker import make_dense_draft

    dense_draft = make_dense_draft(checkpoint, str(tmp_path / "draft")) if "{dense_draft}" in args else None
    args = [a.format(checkpoint=checkpoint, dense_draft=dense_draft) for a in args]
    srv = Server(checkpoint, str(tmp_path / "server.log"), args)
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            srv.wait_ready(timeout=300)
        assert reason in srv.read_log()
    finally:
        srv.stop()
