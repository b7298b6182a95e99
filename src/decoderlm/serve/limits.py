"""The server's limits: what one request may ask for, how many sequences are decoded together
and wait, how long a request may take and how large its body may be (`ServeLimits`).

`decoderlm serve` takes each field as its own flag (`decoderlm.arguments.Fields`); this module
imports neither FastAPI nor pydantic nor torch, so the command's --help needs none of them.
"""

from dataclasses import dataclass
from typing import ClassVar

from ..errors import UserError, flag_name

__all__ = ["ServeLimits"]


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for, the batch, the queue, the time and the body size.

    A request beyond a limit is refused with a 400 naming it (`serving_completion`); beyond
    the batch and the queue, with a 503 (`admission`); a body over max_body_bytes, with a 413
    (`guard`).

    Attributes:
        max_tokens_limit: the largest max_tokens a request may ask for.
        max_prompt_tokens: the longest prompt accepted, in tokens.
        max_logprobs: the largest logprobs a request may ask for, at most 20.
        max_stop: the most stop strings in a request.
        max_batch_size: the most sequences decoded together; more requests wait.
        max_queue: the most choices waiting beyond the batch; a request that does not fit
            gets 503 with Retry-After: 1 (the openai SDK and lm-eval retry it).
        request_timeout: seconds a request may take from its arrival; then its unfinished
            choices end with the text so far and finish_reason "length" (0: no limit).
        max_body_bytes: the largest request body, in bytes (more: 413).
        enable_prefix_caching: keep the keys and values of the last --max-batch-size
            sequences that finished, and prefill a prompt that starts with one's tokens from
            them (vLLM's flag of that name); false: every prompt is prefilled whole, so that
            in bfloat16 no greedy answer depends on an earlier request.
        max_choices: the most prompts x n in one request (the same for every server: no flag).

    Raises:
        UserError: a count below its least value (max_tokens_limit, max_prompt_tokens,
            max_batch_size, max_body_bytes: 1; max_stop, max_queue: 0), max_logprobs outside
            [0, 20], or a negative request_timeout; the message names the flag.
    """

    max_tokens_limit: int = 1024
    max_prompt_tokens: int = 4096
    max_logprobs: int = 5
    max_stop: int = 16
    max_batch_size: int = 8
    max_queue: int = 64
    request_timeout: float = 600.0
    max_body_bytes: int = 4 * 2**20
    enable_prefix_caching: bool = True
    max_choices: ClassVar[int] = 16

    def __post_init__(self):
        least = {
            "max_tokens_limit": 1,
            "max_prompt_tokens": 1,
            "max_stop": 0,
            "max_batch_size": 1,
            "max_queue": 0,
            "max_body_bytes": 1,
        }
        for name, value in least.items():
            if getattr(self, name) < value:
                raise UserError(
                    f"{flag_name(name)} must be an integer >= {value}, got {getattr(self, name)}"
                )
        if not 0 <= self.max_logprobs <= 20:
            raise UserError(f"--max-logprobs must be in [0, 20], got {self.max_logprobs}")
        if not self.request_timeout >= 0:
            raise UserError(f"--request-timeout must be >= 0 seconds, got {self.request_timeout}")
