"""A stand-in for a serving engine's launch command in the serve-bench fault tests.

Run as ``python fake_engine.py -m vllm.entrypoints.openai.api_server --model M --port P [--speculative-config J]``
(through a wrapper script given as ``--engine-python``), it serves the OpenAI routes serve-bench uses, streamed
answers and vLLM's spec-decode counters on ``/metrics``, and keeps a child process of its own, so the tests see
that the whole process group is stopped. ``FAKE_ENGINE`` picks its behaviour:
- ``ok``;
- ``refuse``: exits 3 at once with an error, as an engine refusing a draft (``refuse-draft``: only with a draft);
- ``die-after=N``: exits after N chat requests;
- ``hang``: never answers.
``FAKE_PIDS``: a file each process appends its pid to. With ``-c``, it prints a version, as
``python -c 'import vllm; print(vllm.__version__)'`` does."""

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = os.environ.get("FAKE_ENGINE", "ok")
TOKENS = 12  # output tokens of every answer
ACCEPT = [1, 1, 0]  # per round of a draft: accepted count pattern


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["-c"]:
        print("0.0.1-fake")
        return
    with open(os.environ["FAKE_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["FAKE_PIDS"], "a") as f:
        f.write(f"{child.pid}\n")
    if MODE == "refuse" or (MODE == "refuse-draft" and "--speculative-config" in argv):
        print("ValueError: the draft's config.json has no draft_vocab_size", flush=True)
        sys.exit(3)
    if MODE == "hang":
        time.sleep(600)
    port = int(argv[argv.index("--port") + 1])
    model = argv[argv.index("--model") + 1]
    spec = json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else None
    k = spec["num_speculative_tokens"] if spec else 0
    state = {"chats": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * k}
    die_after = int(MODE.split("=")[1]) if MODE.startswith("die-after=") else None
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code, body: bytes, ctype="application/json"):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": model}]}).encode())
            elif self.path == "/metrics":
                lines = []
                if spec:
                    lines += [f'vllm:spec_decode_num_drafts_total{{engine="0"}} {state["drafts"]}.0',
                              f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {state["draft_tokens"]}.0',
                              f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {state["accepted"]}.0']
                    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{j}"}} {v}.0'
                              for j, v in enumerate(state["per_pos"])]
                self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain")
            else:
                self._send(404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                state["chats"] += 1
                chats = state["chats"]
            if die_after is not None and chats > die_after:
                os._exit(7)
            n = min(TOKENS, body.get("max_tokens", TOKENS))
            if spec:  # rounds of k drafts until n tokens are committed
                lock.acquire()
                done, r = 0, 0
                while done < n:
                    a = min(ACCEPT[r % len(ACCEPT)], k)
                    state["drafts"] += 1
                    state["draft_tokens"] += k
                    state["accepted"] += a
                    for j in range(a):
                        state["per_pos"][j] += 1
                    done += a + 1
                    r += 1
                lock.release()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(n):
                time.sleep(0.002 if spec else 0.004)
                event = {"choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                      "finish_reason": "length" if i == n - 1 else None}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
