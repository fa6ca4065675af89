"""The OpenAI request bodies SpecECD accepts, checked field by field.

Fields follow OpenAI's API reference; vLLM's extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``; ``logprobs_mode``,
per request here, where vLLM sets it for the whole engine) and SpecECD's own
(``k``, ``mode``, ``proactive``, ``draft_source``, ``cloud_only``; for completions,
``token_healing``) sit
beside them in the body, the way vLLM
takes its extras. An unknown field is refused (``extra="forbid"``), and so is a known one
SpecECD cannot honour (:func:`unsupported`), each with a message that names the field.

Constraints come as OpenAI's ``response_format`` (``json_object``; ``json_schema``, compiled
as vLLM compiles it: an object carries only the properties its schema names unless the
schema allows more, with ``strict`` left out or true; ``strict: false`` alone lets objects
carry others, OpenAI's meaning of it), as
vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) or its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``; :meth:`Sampling.constraint` makes one
:class:`~spececd.core.params.Constraint` of them (at most one may be given).

Nothing here is decided twice: the sampling defaults and ranges are
:class:`~spececd.core.params.SamplingParams`' (OpenAI's own ``temperature`` ceiling of
2 and its ``max_tokens`` of 16 for completions aside), and the names ``mode`` and
``proactive`` and ``draft_source`` take are the values of :class:`~spececd.core.params.Mode` (its
lossless ones), :class:`~spececd.edge.options.Proactive` and
:class:`~spececd.edge.options.DraftKind`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spececd.core.params import (
    LOGIT_BIAS_LIMIT,
    LOGPROBS_MODES,
    MAX_TOP_LOGPROBS,
    PENALTY_LIMIT,
    TOP_K_LIMIT,
    Constraint,
    Mode,
    SamplingParams,
)
from spececd.edge.options import DraftKind, Proactive
from spececd.errors import InputError

Stop = str | Annotated[list[str], Field(max_length=4)] | None
DEFAULT = SamplingParams()
Penalty = Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]

if TYPE_CHECKING:
    ModeName: TypeAlias = str
    ProactiveName: TypeAlias = str
    DraftName: TypeAlias = str
    LogprobsModeName: TypeAlias = str
else:  # the enums' values, as literals: the OpenAPI document lists them
    ModeName = Literal[tuple(mode.value for mode in Mode if not mode.lossy)]
    ProactiveName = Literal[tuple(choice.value for choice in Proactive)]
    DraftName = Literal[tuple(kind.value for kind in DraftKind)]
    LogprobsModeName = Literal[LOGPROBS_MODES]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: no padding is added to the events


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path (``messages[0].content``) of the first string in ``value`` that holds a
    lone surrogate, or None. Walked with a stack of its own, each path built only when found:
    a body nested deeper than Python's recursion limit (json.loads takes some) is no server
    error, and no deep body costs its depth squared."""
    labels: list[tuple[int, str]] = [(-1, path)]  # (parent, label): a path's steps
    stack: list[tuple[int, Any]] = [(0, value)]
    while stack:
        at, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                steps = []
                while at >= 0:
                    at, label = labels[at]
                    steps.append(label)
                return "".join(reversed(steps))
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):
                # ASCII-safe (a key may hold the surrogate: it is escaped there).
                labels.append((at, f".{str(key).encode('utf-8', 'backslashreplace').decode()}"))
                stack.append((len(labels) - 1, inner))
                stack.append((len(labels) - 1, key))  # the key before its value
        elif isinstance(item, list):
            for i in reversed(range(len(item))):
                labels.append((at, f"[{i}]"))
                stack.append((len(labels) - 1, item[i]))
    return None


class FieldError(InputError):
    """A request field's value is invalid: ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of its fields."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": ...}``, the text the
    output is expected to be (a string, or text parts joined), drafted first where the
    output follows it (:class:`~spececd.edge.sources.PredictedDraft`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)


class Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] = DEFAULT.temperature
    top_p: Annotated[float, Field(gt=0, le=1)] = DEFAULT.top_p
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    prediction: Prediction | None = None  # Predicted Outputs: a draft source, nothing more
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
    logprobs_mode: LogprobsModeName = DEFAULT.logprobs_mode  # which logprobs (vLLM's names)
    # SpecECD's own.
    k: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    mode: ModeName | None = None
    proactive: ProactiveName | None = None
    draft_source: DraftName | None = None  # where drafts come from (default: the server's)
    cloud_only: bool | None = None  # the server generates alone (default: the server's)
    # Constraints: OpenAI's, vLLM's, vLLM's older (see the module docstring).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        """JSON's ``\\ud800`` escapes can spell a lone surrogate, which is no Unicode
        text (UTF-8 cannot encode it, and a tokenizer refuses it): a 400 naming the
        field, wherever it sits in the body."""
        where = _lone_surrogate(data, "")
        if where is not None:
            raise FieldError(where.lstrip("."), f"`{where.lstrip('.')}` holds a lone UTF-16 "
                             "surrogate (a \\ud800-\\udfff escape without its pair), "
                             "which is not Unicode text: send the character itself, or "
                             "both halves of its surrogate pair")
        return data

    @model_validator(mode="before")
    @classmethod
    def _nulls_left_out(cls, data: Any) -> Any:
        """A null where the field takes none is the field left out, as OpenAI and vLLM
        read it (clients send ``"temperature": null``): the field's default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items() if value is not None
                or key not in fields or type(None) in get_args(fields[key].annotation)}

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def constraint(self) -> Constraint | None:
        """The one constraint the request asks for (None: none); raises
        :class:`FieldError` naming the field when it is invalid, or when two are given."""
        found = self.constraint_field()
        return found[1] if found else None

    def constraint_field(self) -> tuple[str, Constraint] | None:
        """:meth:`constraint`, with the field that asked for it."""
        found: list[tuple[str, Constraint]] = []

        def add(param: str, kind: str, spec: str = "", strict: bool = True) -> None:
            try:
                found.append((param, Constraint(kind, spec, strict)))
            except InputError as exc:
                raise FieldError(param, f"{param}: {exc}") from None

        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            add("response_format", "json_object")
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise FieldError("response_format", "response_format: type json_schema needs "
                                 "a json_schema object (name, schema, strict)")
            add("response_format", "json_schema", json.dumps(rf.json_schema.json_schema),
                rf.json_schema.strict is not False)
        so = self.structured_outputs
        if so is not None:
            given = [name for name in ("json_", "regex", "choice", "grammar", "json_object")
                     if getattr(so, name) not in (None, False)]
            if len(given) != 1:
                raise FieldError("structured_outputs", "structured_outputs: give exactly one "
                                 "of json, regex, choice, grammar, json_object")
            if so.json_ is not None:
                add("structured_outputs.json", "json_schema", _schema_text(so.json_))
            elif so.regex is not None:
                add("structured_outputs.regex", "regex", so.regex)
            elif so.choice is not None:
                add("structured_outputs.choice", "choice", json.dumps(so.choice))
            elif so.grammar is not None:
                add("structured_outputs.grammar", "grammar", so.grammar)
            else:
                add("structured_outputs.json_object", "json_object")
        if self.guided_json is not None:
            add("guided_json", "json_schema", _schema_text(self.guided_json))
        if self.guided_regex is not None:
            add("guided_regex", "regex", self.guided_regex)
        if self.guided_choice is not None:
            add("guided_choice", "choice", json.dumps(self.guided_choice))
        if self.guided_grammar is not None:
            add("guided_grammar", "grammar", self.guided_grammar)
        if len(found) > 1:
            raise FieldError(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain "
                             f"the output: give one")
        return found[0] if found else None


class CompletionRequest(Sampling):
    prompt: str | list[str] | Annotated[list[int], Field(min_length=1)] | list[list[int]]
    # SpecECD's own: heal a text prompt's last token (spececd.healing); default: the
    # server's (off unless `spececd api --token-healing`), off with echo. Token-id
    # prompts are never healed.
    token_healing: bool | None = None
    # 0: nothing generated (with echo: the prompt's log-probabilities alone, for scoring)
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool = False  # the prompt before the completion (and its logprobs, if asked)
    logprobs: TopLogprobs | None = None  # per token, with this many alternatives
    suffix: str | None = None
    best_of: int | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI returns it


class ToolCallParam(BaseModel):
    """A call an assistant message made, as OpenAI returns it and clients send it back."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant's tool calls
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool message's: the call it answers
    refusal: str | None = None  # as the openai client sends a returned message back

    @model_validator(mode="after")
    def _consistent(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant "
                             f"message with tool_calls may leave it out)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(
            part.text for part in self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None  # needs logprobs
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's fields that change nothing here (IGNORED): taken, their types checked, and
    # ignored, as vLLM takes them. Values are not held to OpenAI's lists, which grow: a
    # value OpenAI adds is still ignored.
    store: bool | None = None  # nothing is stored
    metadata: dict[str, str] | None = None  # of a stored completion
    service_tier: str | None = None  # one tier
    reasoning_effort: str | None = None  # the models served do not reason
    verbosity: str | None = None
    prompt_cache_key: str | None = None  # the verifier reuses cached prefixes by itself
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # OpenAI's fields for what SpecECD does not do: refused when they ask for it
    # (unsupported()), as OpenAI refuses them for a model without it.
    modalities: list[str] | None = None  # ["text"] is what any model here writes
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # deprecated by OpenAI for tools
    function_call: str | dict[str, Any] | None = None  # deprecated for tool_choice

    @model_validator(mode="after")
    def _tool_choice(self) -> ChatRequest:
        # A FieldError here reaches the client as itself (param and message), not as
        # pydantic's "Value error, ..." about the whole body.
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise FieldError("tool_choice", "tool_choice asks for a tool call, but tools is "
                             "empty: give tools, or leave tool_choice out")
        names = [tool.function.name for tool in self.tools or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"tool_choice names the function "
                             f"{choice.function.name!r}, which is not among tools "
                             f"({', '.join(map(repr, names))}): name one of them")
        return self


# Chat fields of OpenAI's that are taken and ignored (docs/guide/openai-api.md lists them).
IGNORED = ("user", "store", "metadata", "service_tier", "reasoning_effort", "verbosity",
           "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
           "safety_identifier", "stream_options.include_obfuscation")


def unsupported(request: Sampling) -> tuple[str, str] | None:
    """The first field set to something SpecECD does not do (yet), and why; None if
    none."""
    checks: list[tuple[str, bool, str]] = []
    if isinstance(request, CompletionRequest):
        checks += [
            ("suffix", request.suffix is not None, "suffix (insertion) is not supported"),
            ("best_of", request.best_of not in (None, request.n),
             "best_of is not supported: use n"),
        ]
    else:
        assert isinstance(request, ChatRequest)
        checks += [
            ("top_logprobs", request.top_logprobs is not None and not request.logprobs,
             "top_logprobs needs logprobs: true"),
            ("modalities", bool(set(request.modalities or ()) - {"text"}),
             "this model writes text only (modalities [\"text\"]), not audio"),
            ("audio", request.audio is not None, "this model writes no audio"),
            ("web_search_options", request.web_search_options is not None,
             "this model has no web search"),
            ("moderation", request.moderation is not None,
             "this server runs no moderation model (moderate with a model of your own)"),
            ("functions", request.functions is not None, "functions (deprecated by OpenAI) "
             "are not taken: send each as a tool, {\"type\": \"function\", \"function\": "
             "...}, in tools"),
            ("function_call", request.function_call is not None, "function_call "
             "(deprecated by OpenAI) is not taken: send tool_choice"),
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
