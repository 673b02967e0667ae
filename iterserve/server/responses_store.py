"""Stored responses (responses.py): an in-memory LRU by response id, each with its conversation, and for a
background response its run until it ends."""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from iterserve.server.errors import ApiError
from iterserve.server.request_stream import RequestStream

RUNNING = ("queued", "in_progress")  # a background response's statuses before it ends


@dataclass
class Stored:
    response: dict[str, Any]  # the body GET returns
    messages: list[dict[str, Any]]  # the conversation so far, its reply included once done, without instructions
    stream: RequestStream | None = None  # a background response's engine request, until it ends
    task: asyncio.Task | None = None  # the run that fills `response` in

    @property
    def running(self) -> bool:
        return self.response["status"] in RUNNING

    def cancel(self) -> None:
        """Abort the engine request (its KV blocks freed at the next step) and stop the run; status cancelled."""
        self.response = {**self.response, "status": "cancelled"}
        if self.stream is not None and not self.stream.finished:
            self.stream.finished = True
            self.stream.engine.abort(self.stream.request_id)
        if self.task is not None:
            self.task.cancel()


@dataclass
class ResponseStore:
    capacity: int = 1024
    items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, stored: Stored) -> None:
        self.items[stored.response["id"]] = stored
        self.items.move_to_end(stored.response["id"])
        while len(self.items) > self.capacity:
            # a running background response stays: its client has nothing else to read it by
            oldest = next((k for k, s in self.items.items() if not s.running), None)
            if oldest is None:
                break
            del self.items[oldest]

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self.items.get(response_id)
        if stored is None:
            raise ApiError(404, f"no stored response with id {response_id!r} (never stored, deleted, or evicted: "
                                f"this server keeps the latest {self.capacity})", "not_found_error", param)
        self.items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        stored = self.get(response_id)
        if stored.running:
            stored.cancel()
        del self.items[response_id]
