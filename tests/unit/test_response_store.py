"""The Responses API's store (a bounded LRU scoped per API key and salt) and the prompt of a
turn after a stored response: the stored ids extended token for token, or the conversation
tokenized afresh when the template renders the earlier turns otherwise."""

from __future__ import annotations

import json
from array import array

import pytest

from radixrt.config import ServerConfig
from radixrt.server.http.response_store import ResponseStore, StoredResponse
from radixrt.server.http.responses_input import conversation_prompt, plain_ids

A, B = ("key-a", None), ("key-b", None)
BOS, STOP = 1, 2  # the fake tokenizer's: BOS before every text; a stop token with no text


def stored(response_id: str, **fields) -> StoredResponse:
    values = dict(
        body={"id": response_id},
        messages=(),
        ids=array("i"),
        prompt_text="",
        output_text="",
        ends_with_stop=False,
    )
    values.update(fields)
    return StoredResponse(id=response_id, **values)


def test_the_least_recently_used_goes_first():
    store = ResponseStore(3)
    for name in "abc":
        assert store.put(A, stored(name)) == []
    assert store.get(A, "a").id == "a"  # a read makes it the most recent
    assert store.put(A, stored("d")) == ["b"]
    assert store.get(A, "b") is None
    assert [store.get(A, n) is not None for n in "acd"] == [True, True, True]
    assert store.put(B, stored("e")) == ["a"]  # one bound over every scope
    assert len(store) == 3


def test_a_response_is_seen_in_its_own_scope_only():
    store = ResponseStore(4)
    store.put(A, stored("r"))
    assert store.get(B, "r") is None
    assert store.get(("key-a", "salt"), "r") is None
    assert not store.delete(B, "r")
    assert store.get(A, "r") is not None
    assert store.delete(A, "r") and not store.delete(A, "r")
    assert store.get(A, "r") is None and len(store) == 0


def test_storing_an_id_again_replaces_it():
    store = ResponseStore(2)
    store.put(A, stored("r", output_text="one"))
    store.put(A, stored("r", output_text="two"))
    assert len(store) == 1 and store.get(A, "r").output_text == "two"


def test_the_size_must_be_positive():
    with pytest.raises(ValueError):
        ResponseStore(0)
    with pytest.raises(ValueError, match="responses_store_size"):
        ServerConfig(responses_store_size=0)
    with pytest.raises(ValueError, match="responses_store_size"):
        ServerConfig(responses_store_size=-3)
    assert ServerConfig(responses_store_size=5).responses_store_size == 5


# ------------------------------------------------------------ the prompt


class FakeFront:
    """ChatML, tools rendered into a system turn; one token per character after a BOS."""

    def chat_prompt(self, messages, add_generation_prompt=True, tools=None):
        text = f"<tools>{json.dumps(tools)}</tools>\n" if tools else ""
        for m in messages:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        return [BOS, *(ord(c) for c in text)]


def turn(front, prev, instructions, text, tools=(), output="Sure.", stop=True):
    """A turn's prompt and the response it stores (its output: ``output``'s characters, and
    the stop token when ``stop``)."""
    user = [{"role": "user", "content": text}]
    prompt = conversation_prompt(front, prev, instructions, user, list(tools))
    out_ids = [ord(c) for c in output] + ([STOP] if stop else [])
    reply = {"role": "assistant", "content": output}
    saved = stored(
        "r",
        messages=(*prompt.messages, reply),
        ids=array("i", prompt.ids + out_ids),
        prompt_text=prompt.text,
        output_text=output,
        ends_with_stop=stop,
    )
    return prompt, saved


def test_a_first_turn_is_its_rendering_tokenized():
    front = FakeFront()
    prompt, _ = turn(front, None, "Be brief.", "Hi")
    assert prompt.text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert prompt.ids == front.encode(prompt.text)
    assert prompt.messages == [{"role": "user", "content": "Hi"}]  # instructions not kept


@pytest.mark.parametrize("stop", [True, False])
def test_a_next_turn_extends_the_stored_ids(stop):
    front = FakeFront()
    _, first = turn(front, None, "Be brief.", "Hi", stop=stop)
    prompt, second = turn(front, first, "Be brief.", "More?", stop=stop)
    kept = list(first.ids[:-1] if stop else first.ids)  # a stop token leaves for the template's
    assert prompt.ids[: len(kept)] == kept
    assert prompt.ids == front.encode(prompt.text)  # with this tokenizer: the very same ids
    assert prompt.text.endswith("<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n")
    third, _ = turn(front, second, "Be brief.", "Again")
    assert third.ids[: len(second.ids) - 1] == list(second.ids[:-1])
    assert [m["content"] for m in third.messages] == ["Hi", "Sure.", "More?", "Sure.", "Again"]


def test_other_instructions_or_tools_render_the_conversation_afresh():
    front = FakeFront()
    _, first = turn(front, None, "Be brief.", "Hi")
    for instructions, tools in [(None, ()), ("Be long.", ()), ("Be brief.", [{"type": "x"}])]:
        prompt, _ = turn(front, first, instructions, "More?", tools)
        assert prompt.ids == front.encode(prompt.text)
        assert prompt.ids[: len(first.ids) - 1] != list(first.ids[:-1])
        assert ("Be brief." in prompt.text) == (instructions == "Be brief.")


def test_plain_ids_leave_out_the_bos():
    front = FakeFront()
    assert plain_ids(front, "ab") == [ord("a"), ord("b")]

    class NoBos(FakeFront):
        def encode(self, text):
            return [ord(c) for c in text]

    assert plain_ids(NoBos(), "ab") == [ord("a"), ord("b")]
