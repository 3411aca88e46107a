"""Loopback test of ``dynts serve``: a tiny model served on 127.0.0.1, queried concurrently with the
``openai`` client; answers equal ``dynts.generate`` on each prompt alone; bad requests get HTTP 400."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import dynts  # noqa: E402
from conftest import tiny_model  # noqa: E402
from rescue_tiny import word_tokenizer  # noqa: E402
from serve_helpers import running_server  # noqa: E402

BUDGET, WINDOW, NEW = 20, 4, 40
SERVE_ARGS = ["--kv-method", "window", "--kv-budget", str(BUDGET), "--kv-local-window", str(WINDOW),
              "--page-size", "8", "--num-blocks", "64", "--max-batch-tokens", "64"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model dir, base url) of a running ``dynts serve``; the process is always stopped."""
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    with running_server(model_dir, SERVE_ARGS, model_dir / "server.log") as url:
        yield model_dir, url


def reference_texts(model_dir: Path, prompts: list) -> list[str]:
    model, tokenizer = dynts.load(str(model_dir))
    return [
        dynts.generate(model, tokenizer, [p], method="window", budget=BUDGET, local_window=WINDOW,
                       max_new_tokens=NEW, do_sample=False).texts[0]
        for p in prompts
    ]


def test_concurrent_chat_and_completions_equal_generate(served):
    model_dir, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
    name = str(model_dir)
    chats = [[{"role": "user", "content": " ".join(f"w{(7 * i + j) % 120 + 4}" for j in range(n))}]
             for i, n in enumerate([3, 6, 2, 5])]

    def ask(i: int) -> str:
        if i % 2:  # streaming
            stream = client.chat.completions.create(model=name, messages=chats[i], max_tokens=NEW, stream=True)
            return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        reply = client.chat.completions.create(model=name, messages=chats[i], max_tokens=NEW)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(chats)) as pool:
        answers = list(pool.map(ask, range(len(chats))))
    expected = reference_texts(model_dir, chats)
    assert [a.strip() for a in answers] == [e.strip() for e in expected]
    assert any(len(e.split()) > BUDGET for e in expected)  # long enough to have evicted

    prompt = "w5 w9 w33 w70"
    completion = client.completions.create(model=name, prompt=prompt, max_tokens=NEW)
    assert completion.choices[0].text.strip() == reference_texts(model_dir, [prompt])[0].strip()


def test_bad_requests_get_400_and_server_keeps_serving(served):
    model_dir, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
    name = str(model_dir)
    chat = [{"role": "user", "content": "w5 w6"}]
    with pytest.raises(openai.BadRequestError, match="kv_method='nope' is unknown"):
        client.chat.completions.create(model=name, messages=chat, max_tokens=4, extra_body={"kv_method": "nope"})
    with pytest.raises(openai.BadRequestError, match="budget=20 is smaller than question"):
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "w5 " * 30}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_tokens=-3 must be a positive int"):
        client.completions.create(model=name, prompt="w5 w6", max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="this server runs 'window'"):
        client.completions.create(model=name, prompt="w5 w6", max_tokens=4, extra_body={"kv_method": "dynts"})
    reply = client.chat.completions.create(model=name, messages=chat, max_tokens=8)
    assert reply.choices[0].message.content is not None
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
