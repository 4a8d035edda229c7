"""A ``paths.base.Loan`` that records how it was given back, so a test asserts each loan is released once."""

from __future__ import annotations


class CountingLoan:
    def __init__(self) -> None:
        self.calls: list[str] = []  # "left" (sent, ZeroMQ let go) or "dropped" (never sent), in order

    def left(self) -> None:
        self.calls.append("left")

    def dropped(self) -> None:
        self.calls.append("dropped")
