"""Tokenizers for the server: a checkpoint's own (Hugging Face ``AutoTokenizer``, local files only) or bytes.

The byte tokenizer (token id = UTF-8 byte) drives the built-in random-weight models: their output is noise,
but every id below 256 decodes, so a client sees text and the cache sees real prefixes.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Protocol

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class TextStream(Protocol):
    def push(self, token_id: int) -> str: ...

    def finish(self) -> str: ...


class Tokenizer(Protocol):
    name: str
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def stream(self) -> TextStream: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]: ...


def plain_chat_text(messages: list[dict[str, str]]) -> str:
    """A plain chat template, for tokenizers without one (the random models learned none anyway)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class _ByteStream:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(bytes([token_id]) if 0 <= token_id < 256 else b"")

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """Token id = byte value (UTF-8); ids >= 256 decode to nothing. Enough to drive a random model."""

    name = "bytes"
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream(self) -> _ByteStream:
        return _ByteStream()

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(plain_chat_text(messages))


class _DiffStream:
    """Decodes the whole output each step and releases what is new; holds back a trailing partial character."""

    def __init__(self, tokenizer: "HFTokenizer") -> None:
        self._tokenizer, self._ids, self._sent = tokenizer, [], 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._sent = text[self._sent:], len(text)
        return new

    def finish(self) -> str:
        text = self._tokenizer.decode(self._ids)
        new, self._sent = text[self._sent:], len(text)
        return new


class HFTokenizer:
    """A checkpoint directory's tokenizer through transformers' ``AutoTokenizer`` (never downloads)."""

    def __init__(self, directory: str | Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ModuleNotFoundError:
            raise ValueError(f"{directory} has its own tokenizer; reading it needs transformers "
                             "(pip install transformers)") from None
        self._tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        self.name = f"{type(self._tok).__name__} from {directory}"
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def stream(self) -> _DiffStream:
        return _DiffStream(self)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            return self.encode(plain_chat_text(messages))
        # rendered to text, then encoded: apply_chat_template(tokenize=True) returns a list of ids in
        # transformers 4.x but a BatchEncoding in 5.x; the template already holds any BOS it wants
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self._tok.encode(text, add_special_tokens=False))


def load_tokenizer(model: str) -> Tokenizer:
    """The checkpoint's tokenizer when ``model`` is a directory holding one, else the byte tokenizer."""
    path = Path(model)
    if path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES):
        return HFTokenizer(path)
    return ByteTokenizer()
