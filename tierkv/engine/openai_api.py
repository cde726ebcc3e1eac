"""The OpenAI wire format: pydantic request models, the checks that refuse what the engine cannot honour,
and the response and stream-chunk bodies.

Every parameter is either honoured or refused with HTTP 400 naming it and its value; none that changes the
output is silently ignored. The engine decodes greedily, so ``temperature`` must be 0 (or absent). The
sampling fields vLLM and SGLang accept are accepted at their neutral values (``top_p`` 1, ``top_k`` -1 or 0,
``min_p`` 0, ``repetition_penalty`` 1, ``presence_penalty`` / ``frequency_penalty`` 0, ``best_of`` 1,
``min_tokens`` 0, ``logit_bias`` and ``stop_token_ids`` empty, ``skip_special_tokens`` and
``spaces_between_special_tokens`` true, ``include_stop_str_in_output`` false), and ``top_k`` 1 (greedy itself); with ``temperature`` 0 any
``top_p`` / ``top_k`` / ``min_p`` is accepted, as those only filter what greedy decoding never samples.
``seed`` is accepted because greedy output is the same for every seed; ``ignore_eos`` is honoured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_NEW_TOKENS = 4096
MAX_TOP_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body; ``param`` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None  # None: the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM / SGLang sampling extensions, accepted at their neutral values (see the module docstring)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    best_of: int | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


def parse_request(model: type[_Common], body: bytes) -> _Common:
    """Validate ``body`` against ``model``; ApiError 400 naming the first bad field, then the refusals."""
    try:
        request = model.model_validate_json(body or b"")
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"body is not valid JSON: {first['msg']}") from None
        field_name = str(first["loc"][0]) if first["loc"] else None  # the top-level field, as clients name it
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}", param=field_name) from None
    _refuse_unsupported(request)
    return request


# field -> the values that leave greedy output unchanged (None: absent)
_NEUTRAL = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (None, 1),
            "best_of": (None, 1), "min_tokens": (0,), "stop_token_ids": (None, []), "skip_special_tokens": (True,),
            "spaces_between_special_tokens": (True,), "include_stop_str_in_output": (False,)}
# filters of the sampled distribution: no-ops under greedy decoding, refused when temperature is absent
_FILTERS = {"top_p": (None, 1), "top_k": (None, -1, 0, 1), "min_p": (None, 0)}


def _refuse_unsupported(req: _Common) -> None:
    if req.temperature not in (None, 0):
        raise ApiError(400, f"temperature: only greedy decoding is supported (0 or absent), got {req.temperature}",
                       "temperature")
    for name, neutral in _NEUTRAL.items():
        if getattr(req, name) not in neutral:
            raise ApiError(400, f"{name}: only {' or '.join(map(str, (v for v in neutral if v is not None)))} is "
                                f"supported (greedy decoding, no penalties), got {getattr(req, name)}", name)
    if req.temperature != 0:
        for name, neutral in _FILTERS.items():
            if getattr(req, name) not in neutral:
                raise ApiError(400, f"{name}: only {' or '.join(map(str, neutral[1:]))} is supported unless "
                                    f"temperature is 0 (greedy decoding), got {getattr(req, name)}", name)
    if req.logit_bias:
        raise ApiError(400, f"logit_bias: not supported, got {len(req.logit_bias)} entries", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    if any(not s for s in stop_strings(req)) or len(stop_strings(req)) > 4:
        raise ApiError(400, "stop: up to 4 non-empty strings", "stop")
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        raise ApiError(400, "logprobs: prompt logprobs (echo with logprobs) are not computed", "logprobs")
    if isinstance(req, ChatRequest) and req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs true", "top_logprobs")


def stop_strings(req: _Common) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def max_new_tokens(req: _Common) -> int:
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens or DEFAULT_MAX_TOKENS


def top_logprobs_wanted(req: _Common) -> int | None:
    """How many alternatives to report per token, or None for no logprobs."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt: batches are not supported, got {len(prompt)} prompts", "prompt")
        prompt = prompt[0]
    return prompt


def chat_messages(req: ChatRequest) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content if isinstance(m.content, str)
             else "".join(part.text for part in m.content)} for m in req.messages]


# ---- responses ----------------------------------------------------------------------------------
@dataclass
class TokenOut:
    """One generated token as the client sees it: its id, the text it released and its log-probabilities."""

    token_id: int
    text: str
    piece: str = ""  # the token decoded alone (filled only when logprobs are asked for)
    logprob: float | None = None
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def completion_logprobs(tokens: list[TokenOut], offset: int) -> dict:
    text_offset, pos = [], offset
    for t in tokens:
        text_offset.append(pos)
        pos += len(t.text)
    return {"tokens": [t.piece for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [dict(t.top) for t in tokens], "text_offset": text_offset}


def chat_logprobs(tokens: list[TokenOut]) -> dict:
    def entry(piece: str, logprob: float) -> dict:
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    return {"content": [entry(t.piece, t.logprob) | {"top_logprobs": [entry(p, lp) for p, lp in t.top]}
                        for t in tokens]}


def envelope(kind: str, rid: str, model: str, choice: dict, created_unix: int) -> dict:
    """A response or chunk body; every chunk of one response carries its id and creation time."""
    return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{rid}", "object": kind,
            "created": created_unix, "model": model, "choices": [choice]}
