"""vLLM's decode instance as vLLM's EPD proxy meets it, for what the proxy sends it (no vLLM runs
on a CPU): it records each chat request and answers it with a one-word completion. Its `/health`
(the proxy's probe) is 200."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Decoder(ThreadingHTTPServer):
    """On 127.0.0.1, a free port (`server_address`), serving in a daemon thread until `shutdown`."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        decoder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # the proxy's health probe
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                decoder.requests.append(body)
                reply = {"id": "chatcmpl-d", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "cat"},
                                      "logprobs": None, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}}
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"
