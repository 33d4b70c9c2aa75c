"""A stand-in for llama.cpp's ``llama-server``, for tests of the llama.cpp baseline client.

Speaks the endpoints the clients use: ``GET /health`` (503 for ``FAKE_STARTUP_S``
seconds, then 200), ``POST /completion`` (answers after ``FAKE_DELAY_S`` seconds with
``tokens_predicted`` = ``n_predict`` and ``tokens_evaluated`` = the prompt's length),
``GET /v1/models`` (one model, ``fake.gguf``) and a streamed ``POST /v1/chat/completions``
(``benchmarks/compare_chat.py``: after ``FAKE_DELAY_S``, ``max_tokens`` chunks of one word
``FAKE_TOKEN_S`` seconds apart, then the usage: ``prompt_tokens`` the number of words of the
messages + 5). ``FAKE_ALLOC_MB`` makes it hold that many MB of touched memory from its start.
It appends one JSON line per event to ``$FAKE_LOG``: its argv and PID at start, then every
completion request's path and body with the number of requests in flight when it arrived.
``--version`` prints a version line and exits. ``FAKE_IGNORE_TERM=1`` ignores SIGTERM.
"""

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STARTED = time.monotonic()
LOCK = threading.Lock()
IN_FLIGHT = [0]


def log(event: dict) -> None:
    with LOCK, open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(event) + "\n")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            return self.reply(200, {"object": "list", "data": [{"id": "fake.gguf"}]})
        if self.path != "/health":
            return self.reply(404, {})
        if time.monotonic() - STARTED < float(os.environ.get("FAKE_STARTUP_S", "0")):
            return self.reply(503, {"error": {"code": 503, "message": "Loading model"}})
        self.reply(200, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with LOCK:
            IN_FLIGHT[0] += 1
            in_flight = IN_FLIGHT[0]
        log({"path": self.path, "body": body, "in_flight": in_flight})
        time.sleep(float(os.environ.get("FAKE_DELAY_S", "0")))
        try:
            if self.path == "/v1/chat/completions":
                return self.stream_chat(body)
        finally:
            # Before the /completion reply is written: a client that sends its next request
            # as soon as this one is answered must not find it still counted.
            with LOCK:
                IN_FLIGHT[0] -= 1
        self.reply(200, {"content": "", "tokens_predicted": body["n_predict"],
                         "tokens_evaluated": len(body["prompt"]), "stop_type": "limit"})

    def stream_chat(self, body: dict) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def event(data) -> None:
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        n = body["max_tokens"]
        prompt = sum(len(m["content"].split()) for m in body["messages"]) + 5
        event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
        for i in range(n):
            time.sleep(float(os.environ.get("FAKE_TOKEN_S", "0")))
            event({"choices": [{"index": 0, "delta": {"content": f"w{i} "},
                                "finish_reason": "length" if i == n - 1 else None}]})
        event({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                        "total_tokens": prompt + n}})
        self.wfile.write(b"data: [DONE]\n\n")


class Server(ThreadingHTTPServer):
    request_queue_size = 64          # the default listen backlog of 5 resets 16 connects


def main() -> None:
    if "--version" in sys.argv:
        print("version: 1 (fake)")
        return
    if os.environ.get("FAKE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = sys.argv[1:]
    held = b"\1" * int(float(os.environ.get("FAKE_ALLOC_MB", "0")) * 1e6)  # noqa: F841
    log({"argv": args, "pid": os.getpid()})
    server = Server((args[args.index("--host") + 1],
                                  int(args[args.index("--port") + 1])), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
