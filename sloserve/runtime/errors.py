"""The error a client's bad input raises anywhere in the runtime (kept apart from request.py so
that the modules request.py builds on can raise it too)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input from a client; the message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
