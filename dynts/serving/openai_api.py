"""The OpenAI request surface of ``dynts serve``: bodies parsed within limits, every field checked.

:func:`parse_body` reads JSON with a size and a nesting limit (checked without recursion, before
``json.loads``); :func:`parse_request` turns a ``/v1/completions`` or ``/v1/chat/completions`` body
into a :class:`CompletionRequest` or raises :class:`BadRequest` (HTTP 4xx, an OpenAI-style error,
never a 500). Fields a server cannot honour (``logprobs``, ``echo``, ``best_of > n``, ``suffix``,
``logit_bias``, ``tools``, a non-text ``response_format``) are refused by name instead of ignored.
:func:`encode` tokenizes the prompts (the server runs it in a worker thread).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..evictors.base import EVICTORS
from .sampling import SamplingParams
from ..core import EvictionSettings, serving_methods

__all__ = ["MAX_BODY_BYTES", "MAX_DEPTH", "MAX_N", "BadRequest", "CompletionRequest", "encode", "error_body",
           "parse_body", "parse_request"]

MAX_BODY_BYTES = 16 * 1024 * 1024  # a request body larger than this gets 413
MAX_DEPTH = 32  # JSON nesting deeper than this gets 400
MAX_N = 16  # choices per request
MAX_STOP = 16  # stop strings per request
ROLES = {"system", "developer", "user", "assistant", "tool"}
# chat_template_kwargs that would change what apply_chat_template returns, not how it renders
RESERVED_TEMPLATE_KWARGS = {"conversation", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
                            "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs", "add_generation_prompt",
                            "continue_final_message"}
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(rb"[\[\]{}]")


class BadRequest(ValueError):
    """A request the server refuses; ``status`` is the HTTP code (400 unless said)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def parse_body(raw: bytes, *, max_bytes: int = MAX_BODY_BYTES, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The JSON object of a request body; :class:`BadRequest` for anything else."""
    if len(raw) > max_bytes:
        raise BadRequest(f"the request body is {len(raw)} bytes, over this server's limit of {max_bytes}", 413)
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub(b'""', raw)):
        depth += 1 if bracket in b"[{" else -1
        deepest = max(deepest, depth)
        if deepest > max_depth:
            raise BadRequest(f"the request body nests deeper than {max_depth} levels")
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


@dataclass
class CompletionRequest:
    """One parsed completions or chat request (prompts not yet tokenized)."""

    chat: bool
    model: str | None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)


def _kind(value: Any, types: type | tuple[type, ...], name: str, hint: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"{name}={value!r} must be {hint}", param=name)
    if not isinstance(value, types):
        raise BadRequest(f"{name} must be {hint}, got {type(value).__name__}", param=name)
    return value


def _optional_int(body: Mapping[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    hint = "a positive int" if low == 1 else f"an int >= {low}"
    _kind(value, int, name, hint)
    if value < low:
        raise BadRequest(f"{name}={value!r} must be {hint}", param=name)
    return value


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list of {'role', 'content'} objects", param="messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}",
                             param="messages")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role={role!r} must be one of {sorted(ROLES)}", param="messages")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}} (this server "
                                     "takes text only)", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts, got "
                             f"{type(content).__name__}", param="messages")
        out.append({"role": role, "content": content})
    return out


def _prompts(value: Any) -> list[str | list[int]]:
    hint = "prompt must be a string, a list of strings, a list of token ids or a list of token id lists"
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise BadRequest(hint, param="prompt")
    if all(isinstance(p, str) for p in value):
        return list(value)
    is_id = lambda t: isinstance(t, int) and not isinstance(t, bool) and t >= 0  # noqa: E731
    if all(is_id(t) for t in value):
        return [list(value)]
    if all(isinstance(p, list) and p and all(is_id(t) for t in p) for p in value):
        return [list(p) for p in value]
    raise BadRequest(hint, param="prompt")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP:
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP} strings", param="stop")
    return tuple(s for s in stops if s)


def _refuse_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise BadRequest("logprobs are not returned by dynts serve; drop logprobs/top_logprobs", param="logprobs")
    if body.get("echo"):
        raise BadRequest("echo=true is not supported by dynts serve (prompt logprobs are not computed)", param="echo")
    if not chat and body.get("suffix"):
        raise BadRequest("suffix is not supported by dynts serve", param="suffix")
    if body.get("logit_bias"):
        raise BadRequest("logit_bias is not supported by dynts serve", param="logit_bias")
    if body.get("tools") or body.get("functions"):
        raise BadRequest("tools/functions are not supported by dynts serve", param="tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in (None, "text")):
        raise BadRequest("response_format other than {'type': 'text'} is not supported by dynts serve",
                         param="response_format")


def check_kv_fields(body: Mapping[str, Any], settings: EvictionSettings) -> None:
    """``kv_method`` / ``kv_budget`` / ``kv_local_window`` must match the server's (they are set per server)."""
    method = body.get("kv_method")
    if method is not None:
        if not isinstance(method, str) or method not in EVICTORS:
            raise BadRequest(f"kv_method={method!r} is unknown; this server runs {settings.evictor.name!r} "
                             f"(methods that can be served: {serving_methods()})", param="kv_method")
        if method != settings.evictor.name:
            raise BadRequest(f"kv_method={method!r}: this server runs {settings.evictor.name!r}; start "
                             "`dynts serve --kv-method ...` for another method", param="kv_method")
    for name, mine in (("kv_budget", settings.budget), ("kv_local_window", settings.local_window)):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value != mine):
            raise BadRequest(f"{name}={value!r}: this server runs {name}={mine}; it is set per server", param=name)


def parse_request(body: Mapping[str, Any], *, chat: bool, settings: EvictionSettings,
                  default_sampling: SamplingParams) -> CompletionRequest:
    """Check every field of ``body`` the server reads; :class:`BadRequest` names the first bad one."""
    check_kv_fields(body, settings)
    _refuse_unsupported(body, chat)
    model = body.get("model")
    if model is not None:
        _kind(model, str, "model", "a string")
    req = CompletionRequest(chat=chat, model=model)
    if chat:
        req.messages = _messages(body.get("messages"))
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise BadRequest(f"chat_template_kwargs may not set {reserved} (the server tokenizes the prompt itself)",
                             param="chat_template_kwargs")
        req.chat_template_kwargs = kwargs
    else:
        if "prompt" not in body:
            raise BadRequest("prompt is required", param="prompt")
        req.prompts = _prompts(body["prompt"])
    req.n = _optional_int(body, "n", 1) or 1
    if req.n > MAX_N:
        raise BadRequest(f"n={req.n} is over this server's limit of {MAX_N} choices", param="n")
    best_of = _optional_int(body, "best_of", 1)
    if best_of is not None and best_of != req.n:
        raise BadRequest(f"best_of={best_of} differs from n={req.n}; dynts serve returns every choice it samples",
                         param="best_of")
    req.stream = bool(_kind(body.get("stream", False) or False, bool, "stream", "a boolean"))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    req.include_usage = bool(_kind(options.get("include_usage", False) or False, bool, "stream_options.include_usage",
                                   "a boolean"))
    tokens = [_optional_int(body, name, 1) for name in ("max_tokens", "max_completion_tokens")]
    req.max_tokens = tokens[1] if tokens[1] is not None else tokens[0]
    req.stop = _stop(body.get("stop"))
    req.ignore_eos = bool(_kind(body.get("ignore_eos", False) or False, bool, "ignore_eos", "a boolean"))
    for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        if body.get(name) is not None:
            _kind(body[name], (int, float), name, "a number")
    for name in ("top_k", "seed"):
        if body.get(name) is not None:
            _kind(body[name], int, name, "an int")
    try:
        req.sampling = SamplingParams.from_request(body, default_sampling)
    except ValueError as err:
        raise BadRequest(str(err)) from None
    return req


def encode(tokenizer, req: CompletionRequest, vocab_size: int) -> list[list[int]]:
    """Token ids of every prompt of ``req`` (chat: the template with the generation prompt)."""
    if req.chat:
        try:
            text = tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True,
                                                 **req.chat_template_kwargs)
        except Exception as err:  # a template that raises on these messages (jinja errors, bad kwargs)
            raise BadRequest(f"the chat template cannot render these messages: {type(err).__name__}: {err}",
                             param="messages") from None
        if not isinstance(text, str):
            raise BadRequest("the chat template did not render text with these chat_template_kwargs",
                             param="chat_template_kwargs")
        return [tokenizer(text, add_special_tokens=False)["input_ids"]]
    out = []
    for i, prompt in enumerate(req.prompts):
        if isinstance(prompt, str):
            out.append(tokenizer(prompt)["input_ids"])
            continue
        bad = next((t for t in prompt if t >= vocab_size), None)
        if bad is not None:
            raise BadRequest(f"prompt[{i}] has token id {bad}, outside the vocabulary (size {vocab_size})", param="prompt")
        out.append(prompt)
    return out
