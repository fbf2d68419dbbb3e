"""Load on an OpenAI-compatible server: chat-completion requests streamed at a fixed concurrency, each one
timed (time to first token, time per output token, end-to-end) and its output tokens counted.

    results, wall = run_load(url, bodies, concurrency=8, timeout=300)

A closed loop: ``concurrency`` workers each send one request, wait for its last byte, send the next, so the
server holds ``concurrency`` requests at once until the queue runs dry. ``timeout`` bounds a whole request
(connecting, waiting, every byte of the stream), not one socket read: a server that trickles stays bounded.
Output tokens are the server's own count (``usage.completion_tokens``, asked for with ``stream_options``);
a server that does not send it is counted one token per streamed chunk (``counted_by = "chunks"``).
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from vatspec.data.endpoints import body_chunks, open_request


@dataclass
class Request:
    """One request's measurement: seconds from sending it to its first output text (``ttft``) and to its
    last byte (``latency``); ``error`` says why it failed (its figures then do not count)."""

    index: int  # the prompt's index in the bodies sent
    start: float = 0.0  # monotonic seconds
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    finish: str | None = None
    counted_by: str = "usage"
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency is not None

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None for one token or fewer)."""
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "tpot": self.tpot}


def stream_chat(url: str, body: dict, timeout: float, key: str | None = None, result: Request | None = None) -> Request:
    """POST ``body`` (streamed) to ``url``'s ``/v1/chat/completions`` and time it; never raises for the
    server's faults (they are ``result.error``)."""
    res = result or Request(index=-1)
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    res.start = t0 = time.monotonic()
    chunks, conn = 0, None
    try:
        conn, sock, resp = open_request(url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions", payload,
                                        timeout, key, accept="text/event-stream")
        if resp.status != 200:
            detail = resp.read(300).decode("utf-8", "replace").strip()
            res.error = f"HTTP {resp.status}: {detail}"
            return res
        buf = b""
        for data in body_chunks(resp, sock, t0 + timeout):
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                item = line[5:].strip()
                if item == b"[DONE]":
                    buf = b""
                    break
                event = json.loads(item)
                if "error" in event:
                    res.error = f"the stream reports an error: {str(event['error'])[:200]}"
                    return res
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") \
                            or delta.get("tool_calls"):
                        chunks += 1
                        if res.ttft is None:
                            res.ttft = time.monotonic() - t0
                    if choice.get("finish_reason"):
                        res.finish = choice["finish_reason"]
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    res.output_tokens = int(usage["completion_tokens"])
        res.latency = time.monotonic() - t0
        if res.output_tokens == 0 and chunks:
            res.output_tokens, res.counted_by = chunks, "chunks"
        if res.finish is None:
            res.error = "the stream ended without a finish reason (the server cut it)"
    except TimeoutError:
        res.error = f"no complete answer within --timeout {timeout:g} s"
    except (OSError, http.client.HTTPException) as e:
        res.error = f"{type(e).__name__}: {e}"
    except (ValueError, TypeError, AttributeError) as e:
        res.error = f"a malformed stream event ({type(e).__name__}: {e})"
    finally:
        if conn is not None:
            conn.close()
    return res


def run_load(url: str, bodies: Sequence[dict], concurrency: int, timeout: float,
             key: str | None = None) -> tuple[list[Request], float]:
    """Every body sent once, ``concurrency`` at a time: the measurements in the bodies' order and the wall
    seconds from the first request sent to the last answered."""
    results = [Request(index=i) for i in range(len(bodies))]
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(bodies)):
        todo.put(i)

    def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            stream_chat(url, bodies[i], timeout, key, results[i])

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(bodies)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - t0
