"""A stand-in for llama.cpp's ``llama-server``, for tests of the llama.cpp baseline client.

Speaks the two endpoints the client uses: ``GET /health`` (503 for ``FAKE_STARTUP_S``
seconds, then 200) and ``POST /completion`` (answers after ``FAKE_DELAY_S`` seconds with
``tokens_predicted`` = ``n_predict`` and ``tokens_evaluated`` = the prompt's length).
It appends one JSON line per event to ``$FAKE_LOG``: its argv and PID at start, then every
completion request's body with the number of requests in flight when it arrived.
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
        with LOCK:
            IN_FLIGHT[0] -= 1
        self.reply(200, {"content": "", "tokens_predicted": body["n_predict"],
                         "tokens_evaluated": len(body["prompt"]), "stop_type": "limit"})


class Server(ThreadingHTTPServer):
    request_queue_size = 64          # the default listen backlog of 5 resets 16 connects


def main() -> None:
    if "--version" in sys.argv:
        print("version: 1 (fake)")
        return
    if os.environ.get("FAKE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = sys.argv[1:]
    log({"argv": args, "pid": os.getpid()})
    server = Server((args[args.index("--host") + 1],
                                  int(args[args.index("--port") + 1])), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main()
