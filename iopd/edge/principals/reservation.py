"""What a request reserves against its principal's token limits.

A request is admitted against its input estimate (``iopd.tokens``) plus
``n`` x its maximum output (``max_tokens``, ``max_completion_tokens`` or
``max_output_tokens``); when it sets none, against a documented default
per choice, :data:`DEFAULT_OUTPUT_RESERVATION_TOKENS`.  The reservation is
settled with the metered usage when the request ends
(``iopd.edge.principals.limiter``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_OUTPUT_RESERVATION_TOKENS", "Reservation", "reservation_for"]

#: Output tokens reserved per choice for a request that sets no maximum output.
DEFAULT_OUTPUT_RESERVATION_TOKENS = 4096


@dataclass(frozen=True)
class Reservation:
    """The tokens a request is admitted against: its input estimate plus its maximum output.

    With an explicit maximum (``explicit_output``) the whole reservation
    must fit every token limit, else the request can never be admitted.
    Without one, the output part is the default and is cut down to the
    smallest token limit in force, then at admission to what the token
    windows have left (``limit_decisions.cut_to_room``), so a request that
    set no ``max_tokens`` is never refused as one that cannot fit; only its
    input must fit.
    ``input_param``/``output_param`` name the request fields a "can never
    fit" answer points at.
    """

    input_tokens: int
    output_tokens: int
    explicit_output: bool = True
    input_param: str = "messages"
    output_param: str | None = "max_tokens"

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError("a reservation is never negative")

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def required(self) -> int:
        """The part that must fit a token limit."""
        return self.tokens if self.explicit_output else self.input_tokens


def reservation_for(
    input_tokens: int,
    max_output_tokens: int | None,
    *,
    n: int = 1,
    output_param: str = "max_tokens",
    input_param: str = "messages",
) -> Reservation:
    """A request's reservation: input estimate + ``n`` x (its maximum output, or the default)."""
    n = max(1, n)
    explicit = max_output_tokens is not None
    per_choice = (
        max(0, max_output_tokens)
        if max_output_tokens is not None
        else (DEFAULT_OUTPUT_RESERVATION_TOKENS)
    )
    return Reservation(
        max(0, input_tokens),
        n * per_choice,
        explicit,
        input_param,
        output_param if explicit else None,
    )
