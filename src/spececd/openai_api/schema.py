"""The OpenAI request bodies SpecECD accepts, checked field by field.

Fields follow OpenAI's API reference; vLLM's extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``) and SpecECD's own
(``k``, ``mode``, ``proactive``, ``cloud_only``) sit beside them in the body, the way vLLM
takes its extras. An unknown field is refused (``extra="forbid"``), and so is a known one
SpecECD cannot honour (:func:`unsupported`), each with a message that names the field.

Nothing here is decided twice: the sampling defaults and ranges are
:class:`~spececd.core.sampling.SamplingParams`' (OpenAI's own ``temperature`` ceiling of
2 and its ``max_tokens`` of 16 for completions aside), and the names ``mode`` and
``proactive`` take are the values of :class:`~spececd.core.sampling.Mode` (its lossless
ones) and :class:`~spececd.edge.options.Proactive`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field

from spececd.core.sampling import (
    LOGIT_BIAS_LIMIT,
    PENALTY_LIMIT,
    TOP_K_LIMIT,
    Mode,
    SamplingParams,
)
from spececd.edge.options import Proactive

Stop = str | Annotated[list[str], Field(max_length=4)] | None
DEFAULT = SamplingParams()
Penalty = Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)]

if TYPE_CHECKING:
    ModeName: TypeAlias = str
    ProactiveName: TypeAlias = str
else:  # the enums' values, as literals: the OpenAPI document lists them
    ModeName = Literal[tuple(mode.value for mode in Mode if not mode.lossy)]
    ProactiveName = Literal[tuple(choice.value for choice in Proactive)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] = DEFAULT.temperature
    top_p: Annotated[float, Field(gt=0, le=1)] = DEFAULT.top_p
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    user: str | None = None
    presence_penalty: Penalty = DEFAULT.presence_penalty
    frequency_penalty: Penalty = DEFAULT.frequency_penalty
    logit_bias: dict[int, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT,
                                                 le=LOGIT_BIAS_LIMIT)]] | None = None
    # Beyond OpenAI's, as vLLM accepts them.
    top_k: Annotated[int, Field(ge=-1, le=TOP_K_LIMIT)] = DEFAULT.top_k  # 0 or -1: off
    min_p: Annotated[float, Field(ge=0, le=1)] = DEFAULT.min_p
    repetition_penalty: Annotated[float, Field(gt=0)] = DEFAULT.repetition_penalty
    ignore_eos: bool = False  # go on past the model's end-of-sequence tokens
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # more that end a choice
    # SpecECD's own.
    k: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    mode: ModeName | None = None
    proactive: ProactiveName | None = None
    cloud_only: bool | None = None  # the server generates alone (default: the server's)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(Sampling):
    prompt: str | list[str] | Annotated[list[int], Field(min_length=1)] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def unsupported(request: Sampling) -> tuple[str, str] | None:
    """The first field set to something SpecECD does not do yet, and why; None if none."""
    checks: list[tuple[str, bool, str]] = []
    if isinstance(request, CompletionRequest):
        checks += [
            ("echo", request.echo, "echo is not supported"),
            ("logprobs", request.logprobs is not None, "logprobs are not supported"),
            ("suffix", request.suffix is not None, "suffix (insertion) is not supported"),
            ("best_of", request.best_of not in (None, request.n),
             "best_of is not supported: use n"),
        ]
    else:
        assert isinstance(request, ChatRequest)
        checks += [
            ("logprobs", request.logprobs, "logprobs are not supported"),
            ("top_logprobs", request.top_logprobs is not None, "logprobs are not supported"),
        ]
    for name, is_set, why in checks:
        if is_set:
            return name, f"{why}; leave {name} out"
    return None


class ErrorDetail(BaseModel):
    message: str = Field(description="what was wrong and what to do")
    type: str = Field(description="invalid_request_error (the request's fault) or "
                      "server_error")
    param: str | None = Field(description="the request field at fault, if one is")
    code: str | None = Field(description="a stable code, e.g. model_not_found, "
                             "invalid_api_key, request_too_large, cloud_unreachable")


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every status but 200 carries it."""

    error: ErrorDetail
