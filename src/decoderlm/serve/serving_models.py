"""The endpoints about the model served and its tokenizer: GET /health, GET /v1/models (and
/v1/models/{id}), POST /tokenize, POST /detokenize and GET /tokenizer_info (vLLM's shapes,
which lm-evaluation-harness reads). Each `ServingModels` method takes a request model (or
nothing) and returns a response model, raising `errors.ApiError` for one it cannot answer.
"""

import time

from .errors import ApiError, refuse_extra_fields
from .protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from .tokens import check_token_ids, encode, eos_token_and_id

__all__ = ["ServingModels"]


class ServingModels:
    """The model served under one id, and its tokenizer.

    Args:
        model: the DecoderLM (its config's max_positions is the context length reported).
        tokenizer: its tokenizer.
        name: the model id clients send.

    Attributes:
        created: when the server was built (Unix time, seconds), the model card's `created`.
    """

    def __init__(self, model, tokenizer, name: str):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.created = int(time.time())

    @property
    def max_model_len(self) -> int:
        """The model's context length, in tokens."""
        return self.model.config.max_positions

    def health(self) -> HealthResponse:
        """GET /health."""
        return HealthResponse()

    def check_model(self, name: str | None) -> None:
        """ApiError 404 unless `name` is None or the served model's id."""
        if name not in (None, self.name):
            raise ApiError(
                404,
                f"model {name!r} is not served here; this server serves {self.name!r} "
                f"(GET /v1/models)",
                "model",
                "model_not_found",
            )

    def model_card(self, model_id: str | None = None) -> ModelCard:
        """GET /v1/models/{model_id}; ApiError 404 for another id."""
        self.check_model(model_id)
        return ModelCard(id=self.name, created=self.created, max_model_len=self.max_model_len)

    def models(self) -> ModelList:
        """GET /v1/models."""
        return ModelList(data=[self.model_card()])

    def tokenizer_info(self) -> TokenizerInfo:
        """GET /tokenizer_info (end of text: see `tokens`)."""
        tok = self.tokenizer
        eos, eos_id = eos_token_and_id(tok)
        return TokenizerInfo(
            tokenizer_class=type(tok).__name__,
            kind=tok.kind,
            vocab_size=tok.vocab_size,
            eos_token=eos,
            eos_token_id=eos_id,
            bos_token=None,
            pad_token=None,
            unk_token=getattr(tok, "unk_token", None),
            model_max_length=self.max_model_len,
            chat_template=getattr(tok, "chat_template", None),
        )

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """POST /tokenize; ApiError 400 for a text the vocabulary cannot encode."""
        refuse_extra_fields(req, {})
        self.check_model(req.model)
        try:
            ids = encode(self.tokenizer, req.prompt)
        except ValueError as e:
            raise ApiError(400, f"prompt: {e}", "prompt") from None
        strs = [self.tokenizer.decode([i]) for i in ids] if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """POST /detokenize; ApiError 400 for an id outside the vocabulary."""
        refuse_extra_fields(req, {})
        self.check_model(req.model)
        ids = check_token_ids(req.tokens, self.tokenizer.vocab_size)
        return DetokenizeResponse(prompt=self.tokenizer.decode(ids))
