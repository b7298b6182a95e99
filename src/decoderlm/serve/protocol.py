"""The request and response bodies of the HTTP API, as pydantic models (FastAPI publishes them
in the app's OpenAPI schema, GET /openapi.json).

The completion, model and error bodies follow OpenAI's legacy completions API; the tokenizer
bodies follow vLLM's (/tokenize, /detokenize, /tokenizer_info), which lm-evaluation-harness
reads. Request bodies are checked strictly (no "yes" for true, no true for 1), a null field
means its default, as OpenAI's API reference has it, and fields outside the model are kept in
`model_extra` for the serving code to refuse or accept (`serving.NO_OP_FIELDS`), so a misspelt
option is never silently dropped. Needs pydantic (installed with the [serve] extra's FastAPI).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from ..generation.params import SamplingParams

__all__ = [
    "StrictRequest",
    "StreamOptions",
    "CompletionRequest",
    "CompletionLogprobs",
    "CompletionChoice",
    "Usage",
    "CompletionResponse",
    "CompletionStreamResponse",
    "ChatMessage",
    "ChatCompletionRequest",
    "ChatLogprob",
    "ChatLogprobs",
    "ChatChoice",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatStreamChoice",
    "ChatCompletionStreamResponse",
    "ModelCard",
    "ModelList",
    "TokenizeRequest",
    "TokenizeResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "TokenizerInfo",
    "HealthResponse",
    "ErrorInfo",
    "ErrorResponse",
]

Prompt = str | list[str] | list[int] | list[list[int]]


class StrictRequest(BaseModel):
    """A request body: strict types, null for the default, unknown fields kept in
    `model_extra` (to be refused by the serving code unless they ask for nothing)."""

    model_config = ConfigDict(strict=True, extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_the_default(cls, value, info):
        """null means the default, as OpenAI's API reference has it for every field
        ("integer or null, defaults to 16", ...); a required field stays required."""
        field = cls.model_fields[info.field_name]
        return field.default if value is None and not field.is_required() else value


class StreamOptions(BaseModel):
    """Options of a streamed completion; other options (include_obfuscation, ...) are
    ignored, as they change nothing here."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = Field(
        False,
        description="send a last chunk with no choices and the usage (and usage: null on the "
        "others)",
    )


class CompletionRequest(StrictRequest):
    """POST /v1/completions: OpenAI's legacy completions request.

    OpenAI fields with no effect here are accepted at the values that ask for nothing (best_of
    1, suffix null, presence_penalty / frequency_penalty 0, logit_bias {} or null) and refused
    otherwise; any other unknown field is refused.
    """

    model: str | None = Field(None, description="the served model's id (null: the one served)")
    prompt: Prompt = Field(
        description="a string, a list of strings, a list of token ids or a list of lists of "
        "token ids; each prompt gets n choices"
    )
    max_tokens: int = Field(
        16, ge=0, description="the most tokens generated per choice (0: with echo, score only)"
    )
    temperature: float = Field(
        1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="sampling temperature; 0: greedy"
    )
    top_p: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="nucleus sampling: the smallest set of tokens of this total probability "
        "(1: off; 0: greedy)",
    )
    top_k: int | None = Field(
        None,
        ge=-1,
        description="sample among the k most likely tokens (vLLM's; -1, 0 or null: off)",
    )
    n: int = Field(1, ge=1, description="completions per prompt")
    stop: str | list[str] | None = Field(
        None,
        description="text(s) that end a choice (not included in its text); at most the "
        "server's limit (decoderlm serve --max-stop)",
    )
    stream: bool = Field(False, description="answer with Server-Sent Events of chunks")
    stream_options: StreamOptions | None = Field(
        None, description="options of a streamed answer (only with stream: true)"
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="seeds the sampling; choice i of a prompt uses seed + i"
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        description="return each token's log-probability and this many most likely tokens "
        "(at most the server's limit, decoderlm serve --max-logprobs)",
    )
    echo: bool = Field(False, description="the prompt comes first in each choice's text")
    ignore_eos: bool = Field(
        False,
        description="go on past the end-of-text token (vLLM's; by default a choice ends there, "
        'finish_reason "stop", where the vocabulary has one)',
    )
    user: str | None = Field(None, description="accepted and ignored")

    def to_sampling_params(
        self, eos_token_id: int | None = None, seed: int | None = None
    ) -> SamplingParams:
        """The request's sampling settings for one choice, in the scheduler's terms.

        OpenAI's conventions are converted here: max_tokens is max_new_tokens, top_k -1, 0 or
        null is no top-k, top_p 1 is no nucleus, a single stop string is one stop text.

        Args:
            eos_token_id: the tokenizer's end-of-text token id (None: the model's, see
                `SamplingParams`); ignore_eos runs on past it.
            seed: this choice's seed (the server gives choice i of a prompt seed + i); None:
                the request's seed.

        Raises:
            UserError: a setting SamplingParams refuses (the body's checks refuse them first).
        """
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k if self.top_k not in (None, -1, 0) else None,
            top_p=self.top_p if self.top_p < 1.0 else None,
            seed=self.seed if seed is None else seed,
            stop=stop,
            eos_token_id=eos_token_id,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
        )


class CompletionLogprobs(BaseModel):
    """The log-probabilities of a choice's tokens (OpenAI's legacy logprobs object).

    A log-probability is the log-softmax (nats) of the model's raw logits (before temperature,
    top-k and top-p) over the tokenizer's ids. With echo the prompt's tokens come first, the
    first one with null entries (it has no context).
    """

    tokens: list[str] = Field(description="the text of each token, decoded alone")
    token_logprobs: list[float | None] = Field(description="each token's log-probability (nats)")
    top_logprobs: list[dict[str, float] | None] = Field(
        description="per token, the `logprobs` most likely tokens and the chosen one, {token "
        "text: log-probability} (tokens whose texts are equal share one key)"
    )
    text_offset: list[int] = Field(
        description="where each token starts in the choice's text, in characters (Python str "
        "indices): for a token that starts inside a multi-byte UTF-8 character, where that "
        "character starts (tiktoken's decode_with_offsets)"
    )
    # per token (text, logprob, UTF-8 bytes) of it and of its most likely tokens, most likely
    # first, tokens of equal text kept apart: what chat's logprobs are made of (not sent here)
    _ranked: list = PrivateAttr(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (in a streamed chunk: the piece of it since the last chunk)."""

    text: str = Field(description="the generated text (with echo: after the prompt's)")
    index: int = Field(description="prompt index x n + the choice's number for that prompt")
    logprobs: CompletionLogprobs | None = Field(
        description="the tokens' log-probabilities (null unless the request asked for them)"
    )
    finish_reason: Literal["stop", "length"] | None = Field(
        description="stop: the end-of-text token or a stop text was generated; length: "
        "max_tokens were, or the server's time limit ended the request; null: not finished "
        "yet (streamed chunks)"
    )


class PromptTokensDetails(BaseModel):
    """What became of the prompt tokens (OpenAI's usage.prompt_tokens_details)."""

    cached_tokens: int = Field(
        description="prompt tokens whose keys and values were kept from an earlier request "
        "(prefix caching) and not computed again; once per prompt, as prompt_tokens"
    )


class Usage(BaseModel):
    """Token counts of a completion."""

    prompt_tokens: int = Field(description="tokens of every prompt (once per prompt, not per n)")
    completion_tokens: int = Field(description="tokens generated, every choice together")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens")
    prompt_tokens_details: PromptTokensDetails = Field(description="the prompt tokens' details")


class CompletionResponse(BaseModel):
    """The answer to a completion request that is not streamed."""

    id: str = Field(description='"cmpl-" and a random hexadecimal string')
    object: Literal["text_completion"] = Field("text_completion", description="the kind of body")
    created: int = Field(description="when the request was answered (Unix time, seconds)")
    model: str = Field(description="the served model's id")
    choices: list[CompletionChoice] = Field(description="the choices, in index order")
    usage: Usage = Field(description="token counts")


class CompletionStreamResponse(BaseModel):
    """One Server-Sent Event of a streamed completion ("data: {chunk}"; the stream ends with
    "data: [DONE]"): one choice's piece of text, or, last and only with
    stream_options.include_usage, no choices and the usage."""

    id: str = Field(description="the completion's id, the same in every chunk")
    object: Literal["text_completion"] = Field("text_completion", description="the kind of body")
    created: int = Field(description="when the request was answered (Unix time, seconds)")
    model: str = Field(description="the served model's id")
    choices: list[CompletionChoice] = Field(description="one choice's piece, or none (usage)")
    usage: Usage | None = Field(
        None,
        description="present only with stream_options.include_usage: null but on the last "
        "chunk, which holds the totals",
    )


class TextPart(BaseModel):
    """A text part of a message's content (OpenAI's {"type": "text", "text": ...})."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"] = Field(description='"text" (the only kind of part served)')
    text: str = Field(description="the text")


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="who wrote it (developer: as system)"
    )
    content: str | list[TextPart] = Field(
        description="its text, or a list of text parts (joined with no separator)"
    )
    name: str | None = Field(None, description="accepted and ignored")

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(StrictRequest):
    """POST /v1/chat/completions: OpenAI's chat completions request.

    The conversation is rendered with the model's chat template (`ChatTemplate`) and
    continued as a completion of those ids; the reply ends at the template's end-of-turn
    token or the end-of-text token. OpenAI fields with no effect here are accepted at the
    values that ask for nothing, as for completions; response_format only as "text".
    """

    model: str | None = Field(None, description="the served model's id (null: the one served)")
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_tokens: int | None = Field(
        None, ge=1, description="the most tokens generated per choice (deprecated by OpenAI)"
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="the most tokens per choice (null: max_tokens, else the limit)"
    )
    temperature: float = Field(
        1.0, ge=0.0, le=2.0, allow_inf_nan=False, description="sampling temperature; 0: greedy"
    )
    top_p: float = Field(
        1.0, ge=0.0, le=1.0, allow_inf_nan=False, description="nucleus sampling (1: off)"
    )
    top_k: int | None = Field(
        None, ge=-1, description="sample among the k most likely tokens (-1, 0 or null: off)"
    )
    n: int = Field(1, ge=1, description="replies to generate")
    stop: str | list[str] | None = Field(None, description="text(s) that end a reply")
    stream: bool = Field(False, description="answer with Server-Sent Events of chunks")
    stream_options: StreamOptions | None = Field(
        None, description="options of a streamed answer (only with stream: true)"
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="seeds the sampling; choice i uses seed + i"
    )
    logprobs: bool = Field(False, description="return each generated token's log-probability")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="with logprobs: this many most likely tokens per token"
    )
    response_format: dict | None = Field(
        None, description='only {"type": "text"} (structured output is not served)'
    )
    user: str | None = Field(None, description="accepted and ignored")

    def conversation(self) -> list[dict]:
        """The messages as the template takes them: [{"role", "content": str}]."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def completion_request(self, prompt: list[int], max_tokens: int) -> CompletionRequest:
        """The completion of the rendered conversation's ids with this request's settings
        (`max_tokens`: the reply's limit when the request sets none)."""
        limit = self.max_completion_tokens or self.max_tokens or max_tokens
        return CompletionRequest(
            model=self.model,
            prompt=prompt,
            max_tokens=limit,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            n=self.n,
            stop=self.stop,
            stream=self.stream,
            stream_options=self.stream_options,
            seed=self.seed,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


class ChatTopLogprob(BaseModel):
    """One of the most likely tokens at a position."""

    token: str = Field(description="the token's text")
    logprob: float = Field(description="its log-probability (nats)")
    bytes: list[int] | None = Field(description="the UTF-8 bytes of its text")


class ChatLogprob(ChatTopLogprob):
    """A generated token's log-probability and the most likely tokens at its position."""

    top_logprobs: list[ChatTopLogprob] = Field(description="top_logprobs most likely, first first")


class ChatLogprobs(BaseModel):
    """The log-probabilities of a reply's tokens."""

    content: list[ChatLogprob] | None = Field(description="one per token of the reply")


class ChatReply(BaseModel):
    """The assistant's message."""

    role: Literal["assistant"] = Field("assistant", description="always assistant")
    content: str = Field(description="the reply's text")


class ChatChoice(BaseModel):
    """One reply."""

    index: int = Field(description="the choice's number")
    message: ChatReply = Field(description="the reply")
    logprobs: ChatLogprobs | None = Field(description="null unless the request asked")
    finish_reason: Literal["stop", "length"] | None = Field(
        description="stop: the end-of-turn or end-of-text token or a stop text; length: "
        "max_completion_tokens or the server's time limit"
    )


class ChatCompletionResponse(BaseModel):
    """The answer to a chat request that is not streamed."""

    id: str = Field(description='"chatcmpl-" and a random hexadecimal string')
    object: Literal["chat.completion"] = Field("chat.completion", description="the kind of body")
    created: int = Field(description="when the request was answered (Unix time, seconds)")
    model: str = Field(description="the served model's id")
    choices: list[ChatChoice] = Field(description="the replies, in index order")
    usage: Usage = Field(description="token counts (prompt_tokens: the rendered conversation)")


class ChatDelta(BaseModel):
    """A streamed piece of a reply: the role first, then its text."""

    role: Literal["assistant"] | None = Field(None, description="in a choice's first chunk")
    content: str | None = Field(None, description="the new text")


class ChatStreamChoice(BaseModel):
    """One choice's piece in a streamed chunk."""

    index: int = Field(description="the choice's number")
    delta: ChatDelta = Field(description="the new piece")
    logprobs: ChatLogprobs | None = Field(None, description="the new tokens' (when asked)")
    finish_reason: Literal["stop", "length"] | None = Field(
        None, description="set on the choice's last chunk"
    )


class ChatCompletionStreamResponse(BaseModel):
    """One Server-Sent Event of a streamed chat reply ("data: {chunk}"; the stream ends with
    "data: [DONE]"): per choice a chunk with the role, chunks of text, a chunk with the
    finish_reason; with stream_options.include_usage a last chunk with no choices and the
    usage."""

    id: str = Field(description="the completion's id, the same in every chunk")
    object: Literal["chat.completion.chunk"] = Field(
        "chat.completion.chunk", description="the kind of body"
    )
    created: int = Field(description="when the request was answered (Unix time, seconds)")
    model: str = Field(description="the served model's id")
    choices: list[ChatStreamChoice] = Field(description="one choice's piece, or none (usage)")
    usage: Usage | None = Field(None, description="only on the last chunk, when asked")


class ModelCard(BaseModel):
    """GET /v1/models/{id}: the model served."""

    id: str = Field(description="the id clients send as `model`")
    object: Literal["model"] = Field("model", description="the kind of body")
    created: int = Field(description="when the server started (Unix time, seconds)")
    owned_by: str = Field("decoderlm", description="always decoderlm")
    max_model_len: int = Field(description="the model's context length, in tokens")


class ModelList(BaseModel):
    """GET /v1/models: the one model served."""

    object: Literal["list"] = Field("list", description="the kind of body")
    data: list[ModelCard] = Field(description="the models served (one)")


class TokenizeRequest(StrictRequest):
    """POST /tokenize: a text to turn into token ids (vLLM's request)."""

    model: str | None = Field(None, description="the served model's id (null: the one served)")
    prompt: str = Field(
        description='the text; special tokens\' strings (e.g. "<|endoftext|>") are their ids'
    )
    add_special_tokens: bool = Field(True, description="accepted; no BOS token is ever added")
    return_token_strs: bool = Field(False, description="also return each token's text")


class TokenizeResponse(BaseModel):
    """The answer to POST /tokenize."""

    count: int = Field(description="the number of tokens")
    max_model_len: int = Field(description="the model's context length, in tokens")
    tokens: list[int] = Field(description="the token ids")
    token_strs: list[str] | None = Field(
        description="each token's text, decoded alone (null unless return_token_strs)"
    )


class DetokenizeRequest(StrictRequest):
    """POST /detokenize: token ids to turn into text (vLLM's request)."""

    model: str | None = Field(None, description="the served model's id (null: the one served)")
    tokens: list[int] = Field(description="token ids, each in [0, vocab_size)")


class DetokenizeResponse(BaseModel):
    """The answer to POST /detokenize."""

    prompt: str = Field(description="the decoded text")


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info: what a client needs to know of the tokenizer (vLLM's shape)."""

    tokenizer_class: str = Field(description="the tokenizer's Python class name")
    kind: str = Field(description="the tokenizer's kind (char, byte, gpt2, ...)")
    vocab_size: int = Field(description="the number of token ids")
    eos_token: str | None = Field(
        description="the end-of-text text: the tokenizer's end-of-text token (GPT-2: "
        '"<|endoftext|>"), else "\\n" when it is one token, else null'
    )
    eos_token_id: int | None = Field(description="the end-of-text token's id")
    bos_token: None = Field(description="no beginning-of-text token is used")
    pad_token: None = Field(description="no padding token is used")
    unk_token: str | None = Field(description="the tokenizer's unknown token, if it has one")
    model_max_length: int = Field(description="the model's context length, in tokens")
    chat_template: str | None = Field(description="the chat template served, or null")


class HealthResponse(BaseModel):
    """GET /health."""

    status: Literal["ok"] = Field("ok", description="always ok while the server answers")


class ErrorInfo(BaseModel):
    """What went wrong (the inside of OpenAI's error body)."""

    message: str = Field(description="one line naming the problem and what to do")
    type: Literal["invalid_request_error", "server_error"] = Field(
        description="invalid_request_error (status 400, 401, 404, 413) or server_error (500, 503)"
    )
    param: str | None = Field(description="the request field at fault, if one is")
    code: str | None = Field(
        description="model_not_found (404), invalid_api_key (401, a wrong key), "
        "request_too_large (413), server_busy (503), else null"
    )


class ErrorResponse(BaseModel):
    """Every error, with status 400 (bad request), 401 (no or a wrong API key), 404 (unknown
    model or path), 413 (body too large), 500 or 503 (queue full; Retry-After)."""

    error: ErrorInfo = Field(description="what went wrong")
