"""Admission control: at most max_batch_size + max_queue choices (prompts x n) are in progress
at once (generating, scored or waiting for the batch); a request beyond that is refused with
503 and Retry-After: 1 (the openai SDK and lm-evaluation-harness retry it), unless nothing is
in progress, so a request larger than the capacity can always run alone.
"""

from collections.abc import Callable

from .errors import ApiError

__all__ = ["Admission"]


class Admission:
    """The choices in progress, against a capacity.

    Args:
        capacity: the most choices in progress at once (--max-batch-size + --max-queue).

    Attributes:
        in_progress: the choices admitted and not yet released.
    """

    def __init__(self, capacity: int):
        self.capacity, self.in_progress = capacity, 0

    def admit(self, choices: int) -> Callable[[], None]:
        """Admit a request of `choices` choices; returns the function releasing them (once,
        however often it is called).

        Raises:
            ApiError: 503 (code server_busy, Retry-After: 1) when they do not fit and some
                are in progress.
        """
        if self.in_progress and self.in_progress + choices > self.capacity:
            raise ApiError(
                503,
                f"the server is busy: {self.in_progress} choices are in progress or queued (at "
                f"most {self.capacity}: --max-batch-size + --max-queue); retry in a second",
                code="server_busy",
                headers={"Retry-After": "1"},
            )
        self.in_progress += choices
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self.in_progress -= choices

        return release
