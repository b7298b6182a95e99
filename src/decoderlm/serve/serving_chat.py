"""POST /v1/chat/completions (OpenAI's chat completions): a conversation rendered with the
model's chat template (`decoderlm.tokenizers.chat_template`) into a prompt's ids, continued by
the completion path (`serving_completion.ServingCompletion`: its checks, limits, continuous
batching, time limit and admission), answered in chat's shape whole or as Server-Sent Events
as vLLM streams them: per choice a chunk with `delta.role` "assistant", chunks of content, a
chunk with the finish_reason; with stream_options.include_usage a chunk with no choices and
the usage; then [DONE].

A reply ends, finish_reason "stop", at the template's end-of-turn token or one of the
tokenizer's end-of-text ids (`ChatTemplate.end_ids`; not in the text) or at a stop text. A
model without a chat template refuses chat requests (400), as does a template that fails on
the conversation (400 naming the template's message).
"""

import contextlib
import json
from collections.abc import AsyncIterator

from ..tokenizers.chat_template import ChatTemplate, ChatTemplateError
from .errors import ApiError, refuse_extra_fields
from .protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatReply,
    ChatStreamChoice,
    ChatTopLogprob,
    CompletionLogprobs,
)
from .serving_completion import NO_OP_FIELDS, CheckedCompletion, Disconnected, ServingCompletion
from .serving_completion import usage as usage_of

__all__ = ["CHAT_NO_OP_FIELDS", "ServingChat"]

# chat fields not implemented here, with the values that ask for nothing from them
CHAT_NO_OP_FIELDS = {
    **{k: v for k, v in NO_OP_FIELDS.items() if k != "suffix"},
    "parallel_tool_calls": [None, True, False],
    "tools": [None, []],
    "tool_choice": [None, "none", "auto"],
    "store": [None, False],
    "metadata": [None, {}],
    "service_tier": [None, "auto", "default"],
}


class ServingChat:
    """POST /v1/chat/completions for the model of `completion`: `check_chat`, then `complete`
    or `stream`; ApiError for a request it cannot answer.

    Args:
        completion: the completion path that generates the replies.
        template: the model's chat template (None: chat requests are refused).
    """

    def __init__(self, completion: ServingCompletion, template: ChatTemplate | None):
        self.completion, self.template = completion, template

    def check_chat(self, req: ChatCompletionRequest) -> CheckedCompletion:
        """The conversation rendered and checked as a completion of its ids, admitted;
        ApiError 400 for a model without a template, a template that fails, response_format
        other than text, a setting beyond the limits (404 for another model, 503 busy)."""
        refuse_extra_fields(req, CHAT_NO_OP_FIELDS)
        self.completion.models.check_model(req.model)
        if req.response_format not in (None, {"type": "text"}):
            raise ApiError(
                400,
                f"response_format {json.dumps(req.response_format)} is not supported; this "
                'server answers in text only (omit response_format or send {"type": "text"})',
                "response_format",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.template is None:
            raise ApiError(
                400,
                "this model has no chat template; serve it with --chat-template FILE (a Jinja "
                "template) or use /v1/completions",
                "messages",
            )
        try:
            ids = self.template.encode(req.conversation())
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        limit = self.completion.limits.max_tokens_limit
        job_req = req.completion_request(ids, limit)
        try:
            return self.completion.check_completion(job_req, self.template.end_ids, "chatcmpl")
        except ApiError as e:
            if e.param == "max_tokens" and req.max_completion_tokens is not None:
                e.param, e.message = (
                    "max_completion_tokens",
                    e.message.replace("max_tokens", "max_completion_tokens"),
                )
            elif e.param == "prompt":
                e.param, e.message = "messages", f"the rendered conversation: {e.message}"
            elif e.param == "logprobs":
                e.param, e.message = "top_logprobs", e.message.replace("logprobs", "top_logprobs")
            raise

    async def complete(
        self, job: CheckedCompletion, disconnected: Disconnected
    ) -> ChatCompletionResponse | None:
        """The whole reply of every choice, or None once the client has gone."""
        results = await self.completion.generate_choices(job, disconnected)
        if results is None:
            return None
        top = _top_logprobs(job)
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatReply(content=c.text),
                logprobs=None if top is None else _chat_logprobs(c.logprobs, top),
                finish_reason=c.finish_reason,
            )
            for c, _ in results
        ]
        return ChatCompletionResponse(
            id=job.id,
            created=job.created,
            model=self.completion.models.name,
            choices=choices,
            usage=usage_of(job, {c.index: counts for c, counts in results}),
        )

    async def stream(self, job: CheckedCompletion) -> AsyncIterator[str]:
        """Server-Sent Events of a streamed reply (vLLM's order: every choice's role chunk,
        then the choices' content in index order, each ending with a finish_reason chunk; an
        error body in place of a failed choice's rest), the usage when asked, [DONE]."""
        options = job.request.stream_options
        include_usage = options is not None and options.include_usage
        top = _top_logprobs(job)

        def event(choices: list[ChatStreamChoice], totals=None) -> str:
            chunk = ChatCompletionStreamResponse(
                id=job.id,
                created=job.created,
                model=self.completion.models.name,
                choices=choices,
                usage=totals,
            )
            data = chunk.model_dump(exclude=None if include_usage else {"usage"})
            return f"data: {json.dumps(data)}\n\n"

        for index in range(job.request.n * len(job.prompts)):
            delta = ChatDelta(role="assistant", content="")
            yield event([ChatStreamChoice(index=index, delta=delta)])
        counts: dict[int, tuple[int, int]] = {}  # each choice's tokens so far (`usage_of`)
        async with contextlib.aclosing(self.completion.stream_pieces(job)) as pieces:
            async for index, piece in pieces:
                if isinstance(piece, ApiError):
                    yield f"data: {json.dumps(piece.body())}\n\n"
                    continue
                counts[index] = piece.completion_tokens, piece.cached_tokens
                logprobs = None if top is None else _chat_logprobs(piece.logprobs, top)
                if piece.text or logprobs and logprobs.content:
                    delta = ChatDelta(content=piece.text)
                    yield event([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs)])
                if piece.finish_reason is not None:
                    done = ChatStreamChoice(
                        index=index, delta=ChatDelta(), finish_reason=piece.finish_reason
                    )
                    yield event([done])
        if include_usage:
            yield event([], usage_of(job, counts))
        yield "data: [DONE]\n\n"


def _top_logprobs(job: CheckedCompletion) -> int | None:
    """The request's top_logprobs (0 when only logprobs), None without logprobs."""
    return job.request.logprobs


def _chat_logprobs(lp: CompletionLogprobs | None, top: int) -> ChatLogprobs:
    """Chat's logprobs of a completion's: per token its text, log-probability, UTF-8 bytes
    and its `top` most likely tokens (each with its own bytes: a token holding part of a
    character has the text U+FFFD)."""
    content = []
    for (text, logprob, raw), alternatives in lp._ranked if lp is not None else ():
        content.append(
            ChatLogprob(
                token=text,
                logprob=logprob,
                bytes=list(raw),
                top_logprobs=[
                    ChatTopLogprob(token=t, logprob=v, bytes=list(b))
                    for t, v, b in alternatives[:top]
                ],
            )
        )
    return ChatLogprobs(content=content)
