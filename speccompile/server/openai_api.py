"""The OpenAI wire format for ``speccompile serve``: request bodies and their checks, prompts (text, token
ids, the tokenizer's chat template), stop strings, and response bodies / SSE chunks.

Kept apart from the server (slots, queue, metrics) because it is pure data handling: every function here
can be tested without a socket. Bad input raises ``APIError``, which the server turns into a 4xx with the
OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from speccompile.runtime import InputError, SpeculativeModel
from speccompile.runtime.artifact.schema import check_json_shape
from speccompile.runtime.errors import one_line, quote

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions
MAX_STOP_STRINGS = 8
MAX_BODY_DEPTH = 16
"""Deepest nesting a request body may have (a chat request with content parts nests 5 deep)."""
MAX_KEY = 256
"""Longest object key a request body may hold."""


# -- errors --------------------------------------------------------------------------------------------


class APIError(InputError):
    """A request the server refuses: HTTP status plus an OpenAI-style error body (one-line message)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, str(self), param, code, kind
        self.headers = headers or {}


class SafeJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a body that quotes what a client sent can always be
    encoded (a lone surrogate would make Starlette's UTF-8 rendering raise, and the server drop the
    connection)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The OpenAI error body; the message on one bounded line, the param a bounded name."""
    body = {
        "error": {
            "message": one_line(message),
            "type": kind,
            "param": None if param is None else one_line(param, 120),
            "code": code,
        }
    }
    return SafeJSONResponse(body, status_code=status, headers=headers)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """The first pydantic error as one line naming the field, and the field (the error's ``param``)."""
    err = exc.errors(include_input=False, include_url=False)[0]
    loc = [str(part) for part in err.get("loc", ())]
    name = ".".join(loc) or None
    shown = quote(name, 80)[1:-1] if name and len(name) <= 80 else quote(name, 80)
    if err["type"] == "extra_forbidden":
        return f"unrecognized request argument '{shown}'; remove it (this server does not support it)", name
    if err["type"] == "missing":
        return f"missing required field '{shown}'", name
    if not loc:
        return f"the request body must be a JSON object ({err['msg']})", None
    return f"field '{shown}': {err['msg']}", name


# -- request bodies --------------------------------------------------------------------------------------


class BaseRequest(BaseModel):
    """Fields shared by both endpoints. Unknown fields are refused (400), as the OpenAI API does, so a
    misspelt parameter is not silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "5" is not an int, "yes" is not a bool

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (as in vLLM); 0 = no top-k cut
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(BaseRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[dict[str, Any]], None] = None


class ChatRequest(BaseRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON number")


def parse_request(raw: bytes, schema: type[BaseRequest]) -> BaseRequest:
    """A JSON body as ``schema``, with 400s that name the problem (FastAPI's default is a 422 list).

    Hostile shapes are refused before anything recursive or the tokenizer reads them: bodies that are not
    UTF-8 JSON, NaN / Infinity (not JSON), integers of more digits than Python converts, nesting deeper
    than ``MAX_BODY_DEPTH``, keys longer than ``MAX_KEY``, and strings that are not Unicode text (lone
    surrogates such as ``"\\ud800"``, valid JSON but refused by the tokenizer): each a 400 naming the
    field. The body's size is bounded before this (``RequestGuard``: 413)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw, parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}); send a JSON object") from None
    except ValueError as exc:  # NaN / Infinity, or an integer over sys.get_int_max_str_digits() digits
        raise APIError(
            400, f"the request body holds a value this server does not accept ({exc}); send plain JSON numbers"
        ) from None
    except RecursionError:
        raise APIError(
            400, f"the request body is nested too deeply (at most {MAX_BODY_DEPTH} levels); send a flatter JSON object"
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        check_json_shape(
            data,
            "",
            max_depth=MAX_BODY_DEPTH,
            max_string=len(raw),
            max_key=MAX_KEY,
            error=InputError,
            fix=f"send a JSON object of UTF-8 text, nested at most {MAX_BODY_DEPTH} deep",
            what="field ",
        )
    except InputError as exc:
        raise APIError(400, str(exc), getattr(exc, "field", None)) from None
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(400, message, param) from None


def refuse_unsupported(req: BaseRequest) -> None:
    """400 for OpenAI parameters this server does not implement, instead of silently ignoring them."""
    unsupported = {
        "n": req.n != 1,
        "presence_penalty": req.presence_penalty != 0,
        "frequency_penalty": req.frequency_penalty != 0,
        "logit_bias": bool(req.logit_bias),
        "logprobs": bool(getattr(req, "logprobs", None)),
        "top_logprobs": bool(getattr(req, "top_logprobs", None)),
        "echo": bool(getattr(req, "echo", False)),
        "best_of": (getattr(req, "best_of", None) or 1) != 1,
        "suffix": getattr(req, "suffix", None) is not None,
    }
    for name, used in unsupported.items():
        if used:
            hint = "; send one request per completion" if name in ("n", "best_of") else ""
            raise APIError(
                400, f"'{name}' is not supported by this server{hint}", param=name, code="unsupported_parameter"
            )


@dataclass
class SamplingOptions:
    """Checked sampling parameters, as keyword arguments for ``model.stream``."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: list[str]

    def stream_kwargs(self) -> dict:
        return dict(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
        )


def check_sampling(req: BaseRequest, max_tokens: int | None, prompt_tokens: int, context: int) -> SamplingOptions:
    """Range checks with messages naming the value and the fix; max_tokens defaults to the rest of the context."""
    if not 0.0 <= req.temperature <= 2.0:  # any value in between is safe (runtime/sampling.py)
        raise APIError(
            400, f"temperature must be between 0 and 2 (got {req.temperature}); use 0 for greedy", "temperature"
        )
    if not 0.0 < req.top_p <= 1.0:
        raise APIError(400, f"top_p must be in (0, 1] (got {req.top_p})", "top_p")
    if req.top_k < 0:
        raise APIError(400, f"top_k must be 0 (no cut) or positive (got {quote(req.top_k)})", "top_k")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise APIError(400, f"seed must be an integer in 0..2**63-1 (got {quote(req.seed)})", "seed")
    if prompt_tokens >= context:
        raise APIError(
            400,
            f"the prompt is {prompt_tokens} tokens but the model's context is {context}; shorten the prompt",
            "prompt",
            code="context_length_exceeded",
        )
    room = context - prompt_tokens
    if max_tokens is None:
        max_tokens = room
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1 (got {quote(max_tokens)})", "max_tokens")
    if max_tokens > room:
        raise APIError(
            400,
            f"the prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}: together "
            f"{prompt_tokens + max_tokens}, over the model's context of {context} tokens; "
            f"lower max_tokens to at most {max(room, 0)} or shorten the prompt",
            "max_tokens",
            code="context_length_exceeded",
        )
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported (got {len(stops)})", "stop")
    return SamplingOptions(max_tokens, req.temperature, req.top_p, req.top_k, req.seed, [s for s in stops if s])


# -- prompts: plain text, token ids, chat ----------------------------------------------------------------


def completion_prompt_ids(model: SpeculativeModel, prompt) -> list[int]:
    """One prompt (text or token ids) -> token ids; batches are refused, not silently truncated."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(
                400, f"batched prompts ({len(prompt)}) are not supported; send one request per prompt", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise APIError(400, "the prompt is empty; send some text", "prompt")
        ids = tokenize(lambda: model.tokenizer.encode(prompt), "prompt")
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise APIError(400, "the prompt is empty; send some text or token ids", "prompt")
    vocab = model.manifest.config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in 0..{vocab - 1}", "prompt")
    return ids


class ChatTemplate:
    """The artifact tokenizer's Jinja chat template, rendered in a sandbox as transformers renders it
    (``apply_chat_template`` with ``add_generation_prompt=True``), then tokenized without adding special
    tokens, since the template writes them itself. No transformers needed at serve time."""

    def __init__(self, source: str, tokenizer_json: Path, special_tokens: dict[str, str]):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self._special_tokens = special_tokens

    @classmethod
    def from_artifact(cls, root: Path) -> "ChatTemplate | None":
        """The template from ``tokenizer/chat_template.jinja`` or ``tokenizer_config.json``, or None."""
        folder = root / "tokenizer"
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not source and (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        if not source:
            return None
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                special[key] = value
        return cls(source, folder / "tokenizer.json", special)

    def render(self, messages: list[dict]) -> str:
        import jinja2

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True, tools=None, documents=None, **self._special_tokens
            )
        except jinja2.exceptions.TemplateError as exc:
            raise APIError(400, f"the model's chat template refused these messages: {exc}", "messages") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as exc:
            # A template written for other message shapes (e.g. content parts where it expects a string).
            raise APIError(
                400,
                f"the model's chat template cannot render these messages ({type(exc).__name__}: "
                f"{quote(str(exc), 120)})",
                "messages",
            ) from None

    def prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        if not messages:
            raise APIError(400, "messages is empty; send at least one message", "messages")
        plain = [_message_dict(m, i) for i, m in enumerate(messages)]
        text = self.render(plain)
        ids = tokenize(lambda: self._tokenizer.encode(text, add_special_tokens=False).ids, "messages")
        if not ids:
            raise APIError(400, "the rendered chat prompt is empty", "messages")
        return ids


def tokenize(encode, field: str) -> list[int]:
    """``encode()``, with what the tokenizer refuses (text it cannot take) as a 400 naming ``field``."""
    try:
        return encode()
    except (TypeError, ValueError, UnicodeError) as exc:  # tokenizers raises TypeError for text it cannot read
        raise APIError(
            400,
            f"the tokenizer cannot encode the {field} ({type(exc).__name__}: {quote(str(exc), 120)}); send UTF-8 text",
            field,
        ) from None


def _message_dict(message: ChatMessage, index: int) -> dict:
    """A message for the template: content parts joined into one string (text parts only)."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    f"messages[{index}]: only text content parts are supported (got type {part.get('type')!r})",
                    "messages",
                )
            texts.append(part["text"])
        content = "".join(texts)
    return {**message.model_dump(exclude_none=True), "content": content or ""}


# -- stop strings ----------------------------------------------------------------------------------------


class StopCutter:
    """Cut streamed text at the first stop string, as OpenAI clients expect: the stop string itself is
    not returned, and text that may still turn into a stop string is held back until it cannot."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """The part of ``delta`` (plus held-back text) that is safe to send now."""
        if self.stopped:
            return ""
        self.pending += delta
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(stop[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# -- what a request produced ---------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request produced: the text sent (stop strings cut), every generated token and the stats."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" | "length" | "cancelled"
    seconds: float
    rounds: int | None
    mean_accepted: float | None
    acceptance_rate: float | None
    stop_reason: str  # the runtime's: eos | length | context | stop_string | cancelled
    drafted: int | None = None  # known when decoding ran to the end
    accepted: int | None = None
    ttft: float | None = None  # seconds from arrival to the first token (the batch scheduler measures it)
    cached_tokens: int = 0  # prompt tokens whose KV was copied from an earlier prompt's (a shared prefix)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "total_tokens": self.prompt_tokens + len(self.token_ids),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},  # OpenAI's field for reused prompt KV
        }

    def extension(self) -> dict:
        """The ``speccompile`` field of a response: round statistics, ignored by standard clients."""
        return {
            "mean_accepted": self.mean_accepted,
            "acceptance_rate": self.acceptance_rate,
            "rounds": self.rounds,
            "stop_reason": self.stop_reason,
            "token_ids": self.token_ids,
            "tokens_per_s": len(self.token_ids) / self.seconds if self.seconds > 0 else None,
        }


# -- response formats ------------------------------------------------------------------------------------


@dataclass
class CompletionFormat:
    model_name: str
    id: str = field(default_factory=lambda: "cmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def full(self, outcome: Outcome) -> dict:
        choice = {"index": 0, "text": outcome.text, "logprobs": None, "finish_reason": outcome.finish_reason}
        return {
            **self._base("text_completion"),
            "choices": [choice],
            "usage": outcome.usage(),
            "speccompile": outcome.extension(),
        }

    def first_chunk(self) -> dict | None:
        return None

    def chunk(self, text: str, token_ids: list[int]) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        return {**self._base("text_completion"), "choices": [choice], "speccompile": {"token_ids": token_ids}}

    def last_chunk(self, outcome: Outcome) -> dict:
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": outcome.finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "speccompile": outcome.extension()}

    def usage_chunk(self, outcome: Outcome) -> dict:
        return {**self._base("text_completion"), "choices": [], "usage": outcome.usage()}


@dataclass
class ChatFormat(CompletionFormat):
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))

    def full(self, outcome: Outcome) -> dict:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": outcome.text},
            "logprobs": None,
            "finish_reason": outcome.finish_reason,
        }
        return {
            **self._base("chat.completion"),
            "choices": [choice],
            "usage": outcome.usage(),
            "speccompile": outcome.extension(),
        }

    def first_chunk(self) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, text: str, token_ids: list[int]) -> dict:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice], "speccompile": {"token_ids": token_ids}}

    def last_chunk(self, outcome: Outcome) -> dict:
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": outcome.finish_reason}
        return {**self._base("chat.completion.chunk"), "choices": [choice], "speccompile": outcome.extension()}

    def usage_chunk(self, outcome: Outcome) -> dict:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": outcome.usage()}


def sse_event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
