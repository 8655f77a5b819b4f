"""``POST /v1/embeddings`` through the `openai` SDK, and ``/tokenize`` / ``/detokenize``,
against `radixrt launch` (the tiny llama in float32): the vectors are transformers' final
hidden state pooled, the same bits however they are asked for (float or base64, alone or in a
list, cold or cached, over HTTP or ZeroMQ), and every bad field is a 400 naming it."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from server_harness import Server, assert_idle_kv

from radixrt.client import Client, ServerError
from radixrt.protocol import GenerateRequest
from radixrt.testing import tiny_model_path

KEY = "k-embed"
MAX_PROMPT = 200
TEXT = "The quick brown fox jumps over the lazy dog, twice."
OTHER = ["Something else entirely.", "And a third, longer input than the other two."]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def server():
    srv = Server(
        "--api-key", KEY, "--served-model-name", "tiny", "--max-prompt-tokens", str(MAX_PROMPT)
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.http}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path("llama"))


@pytest.fixture(scope="module")
def hf_hidden():
    """prompt ids -> transformers' final hidden states [T, hidden] (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("llama"), dtype=torch.float32)

    def hidden(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model.eval()(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]

    return hidden


def post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.http}{path}", json=body, headers=headers, timeout=60)


def floats(oai, inputs, **kw) -> list[list[float]]:
    resp = oai.embeddings.create(model="tiny", input=inputs, encoding_format="float", **kw)
    return [d.embedding for d in resp.data]


def test_embedding_is_the_last_tokens_final_hidden_state(oai, tokenizer, hf_hidden, server):
    resp = oai.embeddings.create(model="tiny", input=TEXT, encoding_format="float")
    ids = tokenizer.encode(TEXT)
    assert resp.object == "list" and resp.model == "tiny" and len(resp.data) == 1
    item = resp.data[0]
    assert item.object == "embedding" and item.index == 0 and len(item.embedding) == 256
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == len(ids)
    want = hf_hidden(ids)[-1]
    torch.testing.assert_close(torch.tensor(item.embedding), want, rtol=0, atol=1e-4)
    with Client(server.address, api_key=KEY) as c:
        assert c.encode(TEXT)["embedding"] == item.embedding  # ZeroMQ: the same bits
        listed = c.encode([OTHER[0], TEXT])
        assert listed[1]["embedding"] == item.embedding
        assert listed[1]["meta_info"]["prompt_tokens"] == len(ids)
        with pytest.raises(ServerError, match="not streamed"):
            c._call(GenerateRequest(req_id="streamed", prompt=TEXT, embed=True, stream=True))
        assert_idle_kv(c)


def test_float_and_base64_are_the_same_float32_values(oai):
    plain = floats(oai, [TEXT, *OTHER])
    raw = oai.embeddings.create(model="tiny", input=[TEXT, *OTHER], encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() for d in raw.data]
    assert decoded == plain
    sdk = oai.embeddings.create(model="tiny", input=[TEXT, *OTHER])  # the SDK asks for base64
    assert [d.embedding for d in sdk.data] == plain
    assert [d.index for d in sdk.data] == [0, 1, 2]


def test_an_input_gets_the_same_vector_alone_in_a_list_and_cached(oai, server, tokenizer):
    with Client(server.address, api_key=KEY) as c:
        c.flush_cache()
    alone = floats(oai, TEXT)[0]
    listed = floats(oai, [OTHER[0], TEXT, OTHER[1]])[1]
    body = {"model": "tiny", "input": [TEXT, TEXT]}
    again = post(server, "/v1/embeddings", body).json()
    ids = tokenizer.encode(TEXT)
    assert again["usage"]["prompt_tokens"] == 2 * len(ids)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * (len(ids) - 1)
    as_ids = floats(oai, [ids])[0]
    assert alone == listed == again["data"][0]["embedding"] == again["data"][1]["embedding"]
    assert as_ids == alone


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": TEXT, "dimensions": 64}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": {"text": TEXT}}, "input"),
        ({"input": [[5, 2048]]}, "input"),  # outside the vocabulary
        ({"input": [[-1, 5]]}, "input"),
        ({"input": [[5] * (MAX_PROMPT + 1)]}, "input"),
        ({"input": TEXT, "encoding_format": "hex"}, "encoding_format"),
        ({"input": TEXT, "normalize": True}, "normalize"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_field(server, body, param):
    r = post(server, "/v1/embeddings", {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_sdk_sees_the_refusals(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="tiny", input=TEXT, dimensions=32)
    assert e.value.param == "dimensions" and "256" in e.value.message
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="other", input=TEXT)


def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    r = post(server, "/tokenize", {"model": "tiny", "prompt": TEXT}).json()
    assert r["tokens"] == tokenizer.encode(TEXT) and r["count"] == len(r["tokens"])
    info = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert info["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False)
    models = httpx.get(f"{server.http}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r["max_model_len"] == models.json()["data"][0]["max_model_len"]
    back = post(server, "/detokenize", {"model": "tiny", "tokens": r["tokens"]}).json()
    assert back == {"prompt": TEXT}


def test_tokenize_applies_the_chat_template(server, tokenizer):
    for gen in (True, False):
        r = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": gen}).json()
        text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert r["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        assert r["count"] == len(r["tokens"])
        assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    assert text.endswith("<|im_end|>\n")  # the last one: no assistant turn opened


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": TEXT, "messages": CHAT}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": TEXT, "return_token_strs": True}, "return_token_strs"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, None),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [5, 2048]}, "tokens"),
        ("/detokenize", {"tokens": [-3]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_tokenize_requests_are_400s(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    want = param or "chat_template_kwargs"
    assert r.json()["error"]["param"] == want, r.text


def test_the_new_endpoints_need_the_key(server):
    for path, body in (
        ("/v1/embeddings", {"input": TEXT}),
        ("/tokenize", {"prompt": TEXT}),
        ("/detokenize", {"tokens": [5]}),
    ):
        assert post(server, path, body, key=None).status_code == 401


def test_mean_pooling_server(hf_hidden, tokenizer):
    srv = Server("--embedding-pooling", "mean", "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=f"{srv.http}/v1", api_key="none", max_retries=0)
        first = client.embeddings.create(model="tiny", input=[TEXT, TEXT], encoding_format="float")
        want = hf_hidden(tokenizer.encode(TEXT)).mean(0)
        for d in first.data:
            torch.testing.assert_close(torch.tensor(d.embedding), want, rtol=0, atol=1e-4)
        again = post(srv, "/v1/embeddings", {"input": TEXT}, key=None).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["data"][0]["embedding"] == first.data[0].embedding == first.data[1].embedding
        with Client(srv.address) as c:
            assert c.server_info()["embedding_pooling"] == "mean"
            assert_idle_kv(c)
    finally:
        srv.stop()
