"""A checkpoint directory brings its own tokenizer (transformers AutoTokenizer, local files only); presets
keep the byte tokenizer."""

import openai
import pytest

from engine_helpers import save_word_tokenizer_checkpoint
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.server import CompletionServer
from tierkv.engine.tokenizer import ByteTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint with a word-level tokenizer whose vocabulary fills the model's 320 ids."""
    directory = tmp_path_factory.mktemp("ckpt")
    save_word_tokenizer_checkpoint(directory)
    return directory


def test_presets_use_bytes_and_checkpoints_their_own_tokenizer(checkpoint):
    assert isinstance(load_tokenizer("tiny-llama"), ByteTokenizer)
    tok = load_tokenizer(str(checkpoint))
    assert tok.encode("hello world cache") == [2, 3, 4] and tok.eos_token_id == 1
    assert tok.decode([2, 3]) == "hello world"


def test_server_tokenizes_with_the_checkpoint_tokenizer(checkpoint):
    tok = load_tokenizer(str(checkpoint))
    engine = Engine(str(checkpoint), EngineConfig(mode="l1", l1_tokens=512))
    server = CompletionServer(engine, model_name="ckpt", tokenizer=tok).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model="ckpt", prompt="hello world cache", max_tokens=4)
        assert reply.usage.prompt_tokens == 3
        ids = reply.choices[0].model_extra["token_ids"]
        assert reply.choices[0].text == tok.decode(ids)
        assert reply.choices[0].finish_reason == ("stop" if 1 in ids else "length")
    finally:
        server.close()


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


@pytest.fixture(scope="module")
def chat_checkpoint(checkpoint, tmp_path_factory):
    """The same checkpoint, its tokenizer saved with a chat template (role names are in its vocabulary)."""
    directory = tmp_path_factory.mktemp("chat-ckpt")
    for path in checkpoint.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(str(checkpoint), local_files_only=True)
    vocab = fast.get_vocab()
    for role, filler in (("user", "w312"), ("system", "w313"), ("assistant", "w314")):
        vocab[role] = vocab.pop(filler)  # a filler word's id: the vocabulary still fills the model's ids
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    chat = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>")
    chat.chat_template = CHAT_TEMPLATE
    chat.save_pretrained(str(directory))
    return directory


def test_chat_with_a_checkpoint_chat_template(chat_checkpoint):
    """Regression: with transformers 5.x apply_chat_template(tokenize=True) returns a BatchEncoding, which
    was turned into the list of its keys: every chat request was a 500."""
    tok = load_tokenizer(str(chat_checkpoint))
    messages = [{"role": "system", "content": "cache"}, {"role": "user", "content": "hello world"}]
    want = tok._tok.convert_tokens_to_ids(["system", "cache", "</s>", "user", "hello", "world", "</s>",
                                           "assistant"])
    assert tok.chat_prompt(messages) == want
    engine = Engine(str(chat_checkpoint), EngineConfig(mode="l1", l1_tokens=512))
    server = CompletionServer(engine, model_name="ckpt", tokenizer=tok).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="ckpt", messages=messages, max_tokens=3)
        assert reply.usage.prompt_tokens == len(want)
        again = client.chat.completions.create(model="ckpt", messages=messages, max_tokens=3)
        assert again.choices[0].message.content == reply.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens == len(want) - 1
    finally:
        server.close()
