"""``dynts serve`` as real OpenAI clients use it, driven with ``openai`` and raw ``httpx`` on a tiny model:
admission for the full cache, per-request sampling and stop strings, cancellation on disconnect,
4xx for malformed bodies, the interop surface (n, list prompts, [DONE], served name, ignore_eos,
logprobs refused) and the Prometheus metrics."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import dynts  # noqa: E402
from conftest import tiny_model  # noqa: E402
from rescue_tiny import word_tokenizer  # noqa: E402
from serve_helpers import running_server  # noqa: E402

PAGE, FULL_BLOCKS = 8, 32  # the full-cache server holds 256 tokens per request
FULL_ARGS = ["--kv-method", "full", "--page-size", str(PAGE), "--num-blocks", str(FULL_BLOCKS),
             "--max-batch-tokens", "64"]
WINDOW_ARGS = ["--kv-method", "window", "--kv-budget", "20", "--kv-local-window", "4", "--page-size", str(PAGE),
               "--num-blocks", "64", "--max-batch-tokens", "64"]
PROMPT = "w5 w9 w33 w70"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def full_server(model_dir):
    log = model_dir / "full.log"
    with running_server(model_dir, FULL_ARGS, log) as url:
        yield url, log


@pytest.fixture(scope="module")
def window_server(model_dir):
    log = model_dir / "window.log"
    with running_server(model_dir, WINDOW_ARGS, log) as url:
        yield url, log


def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)


def complete(url: str, **body) -> dict:
    reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` samples by name (the format itself is checked with prometheus_client below)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


# ---------------------------------------------------------------------------------------------- admission
def test_full_prompt_over_the_pool_is_400_at_once_and_the_next_request_is_200(full_server):
    url, _ = full_server
    start = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "w7 " * 300, "max_tokens": 4}, timeout=30)
    elapsed = time.perf_counter() - start
    assert reply.status_code == 400
    assert "holds at most 256 tokens per request" in reply.json()["error"]["message"]
    assert elapsed < 2.0, f"refusing an oversized prompt took {elapsed:.2f} s"
    assert complete(url, prompt=PROMPT, max_tokens=5)["choices"][0]["finish_reason"] == "length"
    over = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 300}, timeout=30)
    assert over.status_code == 400 and "lower max_tokens to" in over.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_max_tokens_over_the_server_cap_is_400(window_server):
    url, _ = window_server
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 10**30}, timeout=30)
    assert reply.status_code == 400 and "cap of 32768" in reply.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------- sampling
def test_greedy_and_seeded_requests_each_keep_their_own_sampling(full_server):
    url, _ = full_server
    greedy_alone = complete(url, prompt=PROMPT, max_tokens=24, temperature=0)["choices"][0]["text"]
    default_alone = complete(url, prompt=PROMPT, max_tokens=24)["choices"][0]["text"]  # the model's config: greedy
    assert default_alone == greedy_alone
    asks = [dict(temperature=0), dict(temperature=1.0, seed=7), dict(temperature=1.0, seed=7),
            dict(temperature=1.0, seed=8)]
    with ThreadPoolExecutor(len(asks)) as pool:
        texts = list(pool.map(lambda a: complete(url, prompt=PROMPT, max_tokens=24, **a)["choices"][0]["text"], asks))
    greedy, seeded, seeded_again, other_seed = texts
    assert greedy == greedy_alone
    assert seeded == seeded_again
    assert seeded != greedy and other_seed != seeded
    # a sampled request arriving first does not make later greedy requests sample
    assert complete(url, prompt=PROMPT, max_tokens=24, temperature=0)["choices"][0]["text"] == greedy_alone


def test_out_of_range_sampling_is_400(full_server):
    url, _ = full_server
    for field, value in (("temperature", -1), ("top_p", 5), ("frequency_penalty", -5), ("top_k", -3),
                         ("temperature", "hot"), ("seed", 1.5)):
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, field: value}, timeout=30)
        assert reply.status_code == 400, (field, value, reply.text)
        assert field in reply.json()["error"]["message"]


def test_stop_ends_the_text_before_the_stop_string(full_server):
    url, _ = full_server
    text = complete(url, prompt=PROMPT, max_tokens=20, temperature=0)["choices"][0]["text"]
    words = text.split()
    stop = words[6]
    expected = text[: text.find(stop)]
    choice = complete(url, prompt=PROMPT, max_tokens=20, temperature=0, stop=stop)["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected, "stop")
    two = complete(url, prompt=PROMPT, max_tokens=20, temperature=0, stop=["nothing-like-it", stop])["choices"][0]
    assert two["text"] == expected
    # a stop string spanning tokens: the first two words after the start
    span = f"{words[1]} {words[2]}"
    assert complete(url, prompt=PROMPT, max_tokens=20, temperature=0, stop=span)["choices"][0]["text"] == \
        text[: text.find(span)]
    # chat, streaming and not
    chat = [{"role": "user", "content": PROMPT}]
    c = client(url)
    full_text = c.chat.completions.create(model="tiny", messages=chat, max_tokens=20, temperature=0).choices[0].message.content
    cut = full_text.split()[5]
    reply = c.chat.completions.create(model="tiny", messages=chat, max_tokens=20, temperature=0, stop=[cut])
    assert reply.choices[0].message.content == full_text[: full_text.find(cut)]
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model="tiny", messages=chat, max_tokens=20, temperature=0, stop=[cut],
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full_text[: full_text.find(cut)]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


# ---------------------------------------------------------------------------------------------- cancellation
def wait_for_idle(url: str, seconds: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(url)
        if m["dynts_kv_blocks_in_use"] == 0 and m["dynts_requests_running"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still in use {seconds} s after the client left: {m}")
        time.sleep(0.2)


def test_a_client_that_disconnects_is_cancelled_and_its_blocks_return(window_server):
    url, _ = window_server
    before = metrics(url)["dynts_requests_cancelled_total"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 30000, "ignore_eos": True},
                   timeout=1.5)
    m = wait_for_idle(url)
    assert m["dynts_requests_cancelled_total"] == before + 1
    # streaming: read two chunks, then leave
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={"prompt": PROMPT, "max_tokens": 30000, "ignore_eos": True, "stream": True}) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i > 2:
                break
    m = wait_for_idle(url)
    assert m["dynts_requests_cancelled_total"] == before + 2


# ---------------------------------------------------------------------------------------------- malformed
MALFORMED = [
    ("/v1/completions", {"prompt": "w5", "kv_method": ["window"]}),
    ("/v1/completions", {"prompt": "w5", "kv_method": {"x": 1}}),
    ("/v1/completions", b"[" * 100_000),
    ("/v1/completions", b'{"prompt": "w5", "max_tokens": 4'),
    ("/v1/completions", b"\xff\xfe not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", {"prompt": None}),
    ("/v1/completions", {"prompt": [1, "a"]}),
    ("/v1/completions", {"prompt": [[]]}),
    ("/v1/completions", {"prompt": [10_000]}),
    ("/v1/completions", {"prompt": "w5", "max_tokens": "many"}),
    ("/v1/completions", {"prompt": "w5", "max_tokens": True}),
    ("/v1/completions", {"prompt": "w5", "n": 0}),
    ("/v1/completions", {"prompt": "w5", "stop": 5}),
    ("/v1/completions", {"prompt": "w5", "stream": "yes"}),
    ("/v1/completions", {"prompt": "w5", "logprobs": 2}),
    ("/v1/completions", {"prompt": "w5", "echo": True}),
    ("/v1/completions", {"prompt": "w5", "best_of": 3}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/chat/completions", {"messages": [1, 2]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"x": 1}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": False}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream_options": 3}),
]


def test_every_malformed_body_is_4xx_and_the_log_has_no_traceback(full_server):
    url, log = full_server
    for path, body in MALFORMED:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        reply = httpx.post(f"{url}{path}", timeout=30, headers={"content-type": "application/json"}, **kwargs)
        assert 400 <= reply.status_code < 500, (path, body if isinstance(body, dict) else body[:20], reply.text)
        assert reply.json()["error"]["message"], reply.text
    huge = httpx.post(f"{url}/v1/completions", content=b" " * (17 * 1024 * 1024), timeout=60)
    assert huge.status_code == 413
    assert complete(url, prompt=PROMPT, max_tokens=3)["choices"][0]["text"]
    assert "Traceback" not in log.read_text()


def test_a_big_prompt_is_tokenized_off_the_event_loop(full_server):
    url, _ = full_server
    body = json.dumps({"prompt": "w5 " * 700_000, "max_tokens": 4}).encode()  # 2.1 MB
    done: dict[str, float] = {}

    def send():
        done["status"] = httpx.post(f"{url}/v1/completions", content=body, timeout=120).status_code
        done["big"] = time.monotonic()

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.3)  # the body is uploaded and being tokenized
    health = httpx.get(f"{url}/health", timeout=30)
    done["health"] = time.monotonic()
    sender.join()
    assert health.status_code == 200 and done["status"] == 400
    assert done["health"] < done["big"], "/health waited for the big prompt's tokenization"


# ---------------------------------------------------------------------------------------------- interop
def test_n_list_prompts_done_served_name_ignore_eos_and_logprobs(full_server, model_dir):
    url, _ = full_server
    c = client(url)
    reply = c.completions.create(model="my-name", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=1)
    assert reply.model == "my-name" and [ch.index for ch in reply.choices] == [0, 1, 2]
    assert len({ch.text for ch in reply.choices}) > 1
    alone = [complete(url, prompt=p, max_tokens=6, temperature=0)["choices"][0]["text"] for p in ("w5 w6", "w9")]
    batch = c.completions.create(model="tiny", prompt=["w5 w6", "w9"], max_tokens=6, temperature=0)
    assert [ch.text for ch in batch.choices] == alone
    ids = word_tokenizer()(["w5 w6", "w9"])["input_ids"]
    assert [ch["text"] for ch in complete(url, prompt=ids, max_tokens=6, temperature=0)["choices"]] == alone
    assert complete(url, prompt=ids[0], max_tokens=6, temperature=0)["choices"][0]["text"] == alone[0]
    eos = complete(url, prompt=PROMPT, max_tokens=7, ignore_eos=True)
    assert eos["usage"]["completion_tokens"] == 7 and eos["choices"][0]["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, logprobs=1)
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
        with httpx.stream("POST", f"{url}{path}", timeout=60,
                          json={**body, "model": "sent-name", "max_tokens": 5, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert {ch["model"] for ch in chunks} == {"sent-name"}
        assert chunks[-1]["usage"]["completion_tokens"] == 5 and "dynts" in chunks[-1]["usage"]
    assert [m.id for m in c.models.list().data] == [str(model_dir)]


# ---------------------------------------------------------------------------------------------- metrics
def test_metrics_parse_and_usage_reports_evictions(window_server):
    parser = pytest.importorskip("prometheus_client.parser")
    url, _ = window_server
    reply = complete(url, prompt=PROMPT, max_tokens=60, ignore_eos=True)
    usage = reply["usage"]["dynts"]
    assert set(usage) == {"peak_slots", "evictions", "evicted_tokens", "freed_blocks"}
    assert usage["evictions"] > 0 and usage["peak_slots"] <= 20
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = {s.name: s.value for family in parser.text_string_to_metric_families(text) for s in family.samples}
    assert set(m) == set(metrics(url))
    for name in ("dynts_requests_running", "dynts_requests_waiting", "dynts_kv_blocks_in_use", "dynts_kv_blocks_free",
                 "dynts_evictions_total", "dynts_evicted_tokens_total", "dynts_freed_blocks_total",
                 "dynts_preemptions_total", "dynts_generation_tokens_per_second"):
        assert name in m, name
    assert m["dynts_evictions_total"] >= usage["evictions"]
    assert m["dynts_kv_blocks"] == 64
    assert wait_for_idle(url)["dynts_kv_blocks_free"] == 64  # every block back in the pool


# ---------------------------------------------------------------------------------------------- default pool
def test_default_pool_next_to_a_generate_batch_process(model_dir, tmp_path):
    model, tokenizer = dynts.load(str(model_dir))
    results = dynts.generate_batch(model, tokenizer, ["w5 w6", "w7"], method="window", budget=20, local_window=4,
                                   max_new_tokens=8, do_sample=False)
    assert all(len(r.sequence) == 8 for r in results)
    args = ["--kv-method", "window", "--kv-budget", "20", "--kv-local-window", "4", "--page-size", str(PAGE)]
    log = tmp_path / "default-pool.log"
    with running_server(model_dir, args, log) as url:
        assert complete(url, prompt=PROMPT, max_tokens=4)["choices"][0]["text"]
    start = next(line for line in log.read_text().splitlines() if line.startswith("dynts serve:"))
    assert re.search(r"KV pool \d+ blocks x 8 tokens \([\d.]+ GiB\): ", start) and "MemAvailable" in start


def test_serve_the_testbed_in_bf16_on_cpu(tmp_path):
    args = ["--dtype", "bf16", "--device", "cpu", "--kv-method", "full", "--page-size", "16", "--num-blocks", "64"]
    log = tmp_path / "testbed.log"
    with running_server("testbed", args, log) as url:
        reply = complete(url, prompt="a 6 b 6 find r1", max_tokens=6)
    assert reply["usage"]["completion_tokens"] >= 1
    assert "on cpu" in log.read_text()
