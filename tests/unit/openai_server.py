"""A small OpenAI-compatible HTTP server for the tests of examples/raw_openai_loop: the real
``openai`` client talks to it on 127.0.0.1, with no network.

It serves ``POST /v1/chat/completions``, plain or streamed (server-sent events: the text in
words, each tool call's arguments split over several chunks, a last chunk with the usage when
``stream_options.include_usage`` is set, then ``data: [DONE]``), scripted by a list of replies.
The reply to a request is the script's item at the request's *turn*: the number of assistant
messages it holds. So a request sent again (a model step run again after a crash) gets the same
reply as the first time, and two runs of one script each get the whole script.

It keeps every request it received (``requests``): its turn, the messages, the tools offered,
whether it streamed, and the usage it answered with.

In process::

    with OpenAIServer([reply(tool_calls=[call("c1", "lookup_order", {...})]), reply("Done.")]) as s:
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key="test")

As a process (``--port 0``: a free port; the first line printed is the base URL; ``GET
/_requests`` lists the requests received)::

    python -m tests.unit.openai_server --port 0 --script replies.json

where ``replies.json`` is a list of ``{"text": ..., "tool_calls": [{"id", "name", "arguments"}],
"usage": {"prompt_tokens", "completion_tokens"}}`` (each key optional; ``arguments`` an object or
its JSON text).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

Reply = dict[str, Any]
"""``{"text": str | None, "tool_calls": [{"id", "name", "arguments"}], "usage": {...}}``."""


def call(id: str, name: str, arguments: Any) -> dict[str, Any]:
    """A scripted tool call; ``arguments`` a dict (sent as JSON text) or the text itself."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": id, "name": name, "arguments": text}


def reply(
    text: str | None = None,
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    usage: dict[str, int] | None = None,
) -> Reply:
    """A scripted reply: text, tool calls, or both; ``usage`` (``prompt_tokens``,
    ``completion_tokens``) replaces the default, which is computed from the sizes."""
    out: Reply = {"text": text, "tool_calls": tool_calls or []}
    if usage is not None:
        out["usage"] = usage
    return out


class OpenAIServer:
    """``POST /v1/chat/completions`` on 127.0.0.1, in a thread of this process."""

    def __init__(self, script: list[Reply], *, port: int = 0) -> None:
        self.script = [
            {**r, "tool_calls": [call(**c) for c in r.get("tool_calls") or []]} for r in script
        ]
        self._lock = threading.Lock()
        self._requests: list[dict[str, Any]] = []
        self.failing: dict[int, int] = {}
        """Turn -> the HTTP status its requests get instead of their reply (an outage, a
        revoked key): set with ``POST /_fail {"turn": 1, "status": 503}`` (status null:
        answer again). Failed requests are counted in ``failed``."""
        self.failed: collections.Counter[int] = collections.Counter()
        self._http = _HTTPServer(("127.0.0.1", port), _Handler)
        self._http.owner = self
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The chat completion requests received, in order of arrival."""
        with self._lock:
            return list(self._requests)

    def turns(self) -> collections.Counter[int]:
        """How many requests reached each turn."""
        return collections.Counter(r["turn"] for r in self.requests)

    def start(self) -> OpenAIServer:
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join()
            self._thread = None
        self._http.server_close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- answering -----------------------------------------------------------------------------

    def answer(self, body: dict[str, Any], authorization: str) -> tuple[Reply, dict[str, Any]]:
        """The scripted reply to a request and the usage to send; records the request."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _Refused("'messages' must be a list")
        turn = sum(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
        with self._lock:
            status = self.failing.get(turn)
            if status is not None:
                self.failed[turn] += 1
        if status is not None:
            raise _Failing(status)
        if turn >= len(self.script):
            raise _Refused(f"the script has {len(self.script)} replies: none for turn {turn}")
        scripted = self.script[turn]
        calls = scripted.get("tool_calls") or []
        produced = (scripted.get("text") or "") + "".join(c["arguments"] for c in calls)
        prompt = scripted.get("usage", {}).get("prompt_tokens", len(json.dumps(messages)) // 4)
        completion = scripted.get("usage", {}).get("completion_tokens", len(produced) // 4 + 1)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        tools = [t.get("function", {}).get("name") for t in body.get("tools") or []]
        with self._lock:
            self._requests.append(
                {
                    "turn": turn,
                    "model": body.get("model"),
                    "stream": bool(body.get("stream")),
                    "stream_options": body.get("stream_options"),
                    "tools": tools,
                    "authorization": authorization,
                    "messages": messages,
                    "usage": usage,
                    "at": time.time(),
                }
            )
        return scripted, usage


class _Refused(Exception):
    """A request the server answers with HTTP 400."""


class _Failing(Exception):
    """A request the server answers with the status of a failure set by ``/_fail``."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: OpenAIServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    @property
    def owner(self) -> OpenAIServer:
        return self.server.owner

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/_requests":
            self._json(200, self.owner.requests)
        elif self.path.rstrip("/") == "/_failed":
            self._json(200, {str(k): v for k, v in self.owner.failed.items()})
        else:
            self._error(404, f"no route GET {self.path}")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path.rstrip("/") == "/_fail":
            fail = json.loads(raw)
            with self.owner._lock:
                if fail.get("status") is None:
                    self.owner.failing.pop(int(fail["turn"]), None)
                else:
                    self.owner.failing[int(fail["turn"])] = int(fail["status"])
            self._json(200, {"ok": True})
            return
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._error(404, f"no route POST {self.path}")
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise _Refused("the body must be a JSON object")
            scripted, usage = self.owner.answer(body, self.headers.get("Authorization", ""))
        except _Failing as e:
            self._error(e.status, f"scripted failure {e.status}")
            return
        except (ValueError, _Refused) as e:
            self._error(400, str(e))
            return
        completion_id = f"chatcmpl-{len(self.owner.requests)}"
        model = str(body.get("model") or "scripted")
        if body.get("stream"):
            options = body.get("stream_options") or {}
            self._stream(completion_id, model, scripted, usage, bool(options.get("include_usage")))
        else:
            self._json(200, _completion(completion_id, model, scripted, usage))

    # --- writing -------------------------------------------------------------------------------

    def _json(self, status: int, data: Any) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, status: int, message: str) -> None:
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        self._json(status, {"error": error})

    def _stream(
        self,
        completion_id: str,
        model: str,
        scripted: Reply,
        usage: dict[str, Any],
        with_usage: bool,
    ) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in _chunks(completion_id, model, scripted, usage, with_usage):
            self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def _message(scripted: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": scripted.get("text")}
    calls = scripted.get("tool_calls") or []
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls
        ]
    return message


def _finish(scripted: Reply) -> str:
    return "tool_calls" if scripted.get("tool_calls") else "stop"


def _completion(
    completion_id: str, model: str, scripted: Reply, usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": _message(scripted),
                "finish_reason": _finish(scripted),
                "logprobs": None,
            }
        ],
        "usage": usage,
    }


def _chunks(
    completion_id: str, model: str, scripted: Reply, usage: dict[str, Any], with_usage: bool
) -> list[dict[str, Any]]:
    """The chunks of a streamed reply: the role, the text word by word, each tool call (its id
    and name, then its arguments in three pieces), the finish reason, and the usage."""
    base = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }
    if with_usage:
        base["usage"] = None  # every chunk but the last, as OpenAI sends them

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {**base, "choices": [choice]}

    out = [chunk({"role": "assistant", "content": ""})]
    for word in re.findall(r"\s*\S+\s*", scripted.get("text") or ""):
        out.append(chunk({"content": word}))
    for index, c in enumerate(scripted.get("tool_calls") or []):
        start = {"name": c["name"], "arguments": ""}
        out.append(
            chunk(
                {
                    "tool_calls": [
                        {"index": index, "id": c["id"], "type": "function", "function": start}
                    ]
                }
            )
        )
        args = c["arguments"]
        step = max(1, -(-len(args) // 3))
        for i in range(0, len(args), step):
            piece = {"index": index, "function": {"arguments": args[i : i + step]}}
            out.append(chunk({"tool_calls": [piece]}))
    out.append(chunk({}, _finish(scripted)))
    if with_usage:
        out.append({**base, "choices": [], "usage": usage})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--script", type=Path, required=True, help="a JSON list of replies")
    args = parser.parse_args(argv)
    server = OpenAIServer(json.loads(args.script.read_text()), port=args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with server:
        print(server.base_url, flush=True)
        stop.wait()
    sys.exit(0)


if __name__ == "__main__":
    main()
