"""Wire schemas of the proxy: the server config and the OpenAI request bodies (pydantic).

Requests ignore fields they do not know (harnesses send ``user``, ``metadata``,
``store`` ...), but a known field whose value would change what
is sampled and that the proxy cannot honour (penalties, ``logit_bias``,
a JSON ``response_format``, ``echo``) is refused with a 400 that names it,
never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "FunctionCallIn",
    "ProxyConfig",
    "RewardRequest",
    "SessionRequest",
    "ToolCallIn",
    "ToolIn",
]


class ProxyConfig(BaseModel):
    """Limits and defaults of one proxy server."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field("agentrl", description="Name listed by /v1/models and echoed in replies.")
    token: str | None = Field(None, description="Admin bearer token; None: no token needed (bind 127.0.0.1).")
    max_request_bytes: int = Field(8 << 20, ge=1024, description="Larger request bodies get 413.")
    max_context_tokens: int = Field(4096, ge=16, description="Prompt plus max_tokens must fit this budget.")
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request gives none.")
    clamp_max_tokens: bool = Field(
        True, description="A max_tokens over the room the prompt leaves in max_context_tokens is lowered to "
        "that room (harnesses ask 32k-64k of any model; the reply then ends with reason length); false: "
        "a 400, as vLLM answers.")
    max_n: int = Field(16, ge=1, description="Largest n (choices per request).")
    max_concurrent: int = Field(1024, ge=1, description="Requests in flight; more get 503 with Retry-After.")
    max_sessions: int = Field(4096, ge=1, description="Sessions kept; the oldest closed one is dropped first, "
                              "else the open one idle longest past session_idle_s (closed and written first).")
    session_idle_s: float = Field(
        3600.0, gt=0, description="An open session no request named for this long is closed (its tree written "
        "to out, meta closed_by: idle) when a new session needs its room; a harness that never closes its "
        "session otherwise filled max_sessions for good.")
    tool_call_style: Literal["hermes", "json"] = Field(
        "hermes", description="How tools are described to a model whose template has no tools support.")
    check_prefix: int = Field(
        8, ge=0, description="Compare a session's context with a full template re-render on its first two "
        "observations and every N-th after, to detect unstable templates (1 or true: every turn; 0 or "
        "false: never); the check grows with the conversation, as rollout.template_check_every.")
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with a 503.")
    generate_timeout_s: float = Field(600.0, gt=0, description="A generation over this gets 504.")
    auto_create_sessions: bool = Field(
        False, description="A call to an unknown /sessions/{id} creates it instead of a 404.")
    out: str | None = Field(None, description="JSONL file each closed session's tree is appended to.")
    max_stored_responses: int = Field(
        4096, ge=0, description="Responses calls with store: true whose conversation is kept for "
        "previous_response_id; the oldest is dropped first.")

    @model_validator(mode="after")
    def _idle_outlasts_a_call(self) -> ProxyConfig:
        """A session is idle from its last request, so a call still generating is at most
        generate_timeout_s old: a shorter session_idle_s could close a session under its call."""
        if self.session_idle_s <= self.generate_timeout_s:
            raise ValueError(f"session_idle_s ({self.session_idle_s:g}) must be longer than generate_timeout_s "
                             f"({self.generate_timeout_s:g}): a session is idle from its last request")
        return self


# -- chat ------------------------------------------------------------------------------
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text.")


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, description="Tool name.")
    arguments: str | dict[str, Any] = Field("{}", description="JSON arguments (string or object).")


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = Field(None, description="Call id.")
    type: Literal["function"] = Field("function", description="Always 'function'.")
    function: FunctionCallIn = Field(description="What is called.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Speaker.")
    content: str | list[ContentPart] | None = Field(None, description="Text or text parts.")
    name: str | None = Field(None, description="Speaker or tool name.")
    tool_calls: list[ToolCallIn] | None = Field(None, description="Calls an assistant made.")
    tool_call_id: str | None = Field(None, description="role=tool: the call answered.")

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        # Checked before the union, whose error would be its str branch's ("content.str: ...").
        if isinstance(v, list):
            for j, p in enumerate(v):
                kind = p.get("type") if isinstance(p, dict) else getattr(p, "type", None)
                if kind != "text":
                    raise ValueError(f"part {j} is of type {kind!r}: only text parts are supported (no images, "
                                     "audio or files: the policy reads text)")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionSpecIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, description="Tool name.")
    description: str = Field("", description="What the tool does.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}}, description="JSON schema.")


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = Field("function", description="Always 'function'.")
    function: FunctionSpecIn = Field(description="The tool.")


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: dict[str, str] = Field(description='{"name": TOOL}.')


class _Sampling(BaseModel):
    """Fields both endpoints share. OpenAI's ranges; top_k and the token-id
    fields are the vLLM extensions that token-exact clients use."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field("", description="Any name is accepted; replies carry the served name.")
    n: int = Field(1, ge=1, description="Choices to sample.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass.")
    top_k: int | None = Field(None, ge=-1, description="vLLM extension; 0 or -1 disables.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to sample at most.")
    stop: str | list[str] | None = Field(None, description="Strings that end the choice.")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end the choice.")
    # 64 bits, as OpenAI's: a larger seed overflowed hf's generator, failing its whole batch
    seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1, description="Seed of the request's random stream.")
    stream: bool = Field(False, description="Answer as server-sent events.")
    stream_options: dict[str, Any] | None = Field(None, description="{include_usage: bool}.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string in the text.")
    return_token_ids: bool = Field(False, description="Add prompt_token_ids and token_ids per choice.")
    presence_penalty: float = Field(0.0, description="Not supported unless 0.")
    frequency_penalty: float = Field(0.0, description="Not supported unless 0.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported unless empty.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("at most 16 non-empty stop strings")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v:
            raise ValueError("only 0 is supported (the sampled distribution must be the policy's)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("not supported (the sampled distribution must be the policy's)")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    tools: list[ToolIn] | None = Field(None, description="Tools the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (default with tools), none, required or a named tool.")
    parallel_tool_calls: bool | None = Field(
        None, description="false: the reply returns at most one tool call (the first the model wrote).")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens.")
    logprobs: bool = Field(False, description="Return the sampled tokens' logprobs.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Alternatives per token.")
    response_format: dict[str, Any] | None = Field(None, description="Only {type: text}.")
    continue_final_message: bool = Field(
        False, description="vLLM extension: the reply continues the final assistant message (a prefill).")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and v.get("type", "text") != "text":
            raise ValueError("only type 'text' is supported (no constrained decoding)")
        return v

    @model_validator(mode="after")
    def _alias(self) -> ChatRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _prefill(self) -> ChatRequest:
        if self.continue_final_message:
            last = self.messages[-1]
            if last.role != "assistant" or last.tool_calls:
                raise ValueError("continue_final_message needs a final assistant message without tool calls")
            if len(self.messages) < 2:
                raise ValueError("continue_final_message needs a message before the one it continues")
            if self.messages[-2].role == "assistant":  # the turn it continues would be two
                raise ValueError("continue_final_message: the message before the one it continues is an "
                                 "assistant message too; send them as one")
        return self


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: text or token-id prompts."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="One prompt or a batch.")
    max_tokens: int | None = Field(16, ge=1, description="Tokens to sample at most (OpenAI default 16).")
    logprobs: int | None = Field(None, ge=0, le=20, description="Token logprobs plus this many alternatives.")
    return_tokens_as_token_ids: bool = Field(False, description='Tokens as "token_id:N".')
    echo: bool = Field(False, description="Not supported.")
    suffix: str | None = Field(None, description="Not supported.")

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, p: Any) -> Any:
        if not p or (isinstance(p, list) and any(isinstance(x, list | str) and not x for x in p)):
            raise ValueError("must not be empty")
        return p

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# -- sessions --------------------------------------------------------------------------
SESSION_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"


class SessionRequest(BaseModel):
    """``POST /sessions``."""

    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(
        None, pattern=SESSION_ID_PATTERN, description="Chosen id; default a random one.")
    meta: dict[str, Any] = Field(default_factory=dict, description="Copied into the tree's meta.")
    seed: int | None = Field(None, description="Base of the session's sampling streams: each call samples "
                             "from a stream derived from this seed, its prompt, the lowest index of that prompt's "
                             "streams no recorded or in-flight call holds, and its own seed if it sends one; so a harness "
                             "that sends no seeds, or always the same one, still repeats.")


class RewardRequest(BaseModel):
    """``POST /sessions/{id}/reward``: for the session's last call, or a named call."""

    model_config = ConfigDict(extra="forbid")

    reward: float = Field(description="The reward.")
    call_id: str | None = Field(None, description="A call's id (the response id); None: the session.")
    choice: int | None = Field(None, ge=0, description="One choice of that call; None: all of them.")
    terminated: bool = Field(True, description="Session rewards: the episode ended (not truncated).")
