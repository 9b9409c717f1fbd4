"""A STAND-IN for the SGLang routes scripts/grpo_check.py uses (tests only): GET /model_info, POST /generate and
POST /weights_checker {"action": "checksum"} (SGLang's answer layout: one entry per rank with its checksums).

The weight version is read from a file at every request (the test moves it); greedy output_ids and checksums are
fixed functions of the version and the input ids. Accepts (and ignores) sglang.launch_server's other arguments.
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def output_ids(version: str, input_ids: list[int], n: int) -> list[int]:
    return [(sum(input_ids) * 31 + int(version) * 7 + i) % 500 for i in range(n)]


def checksums(version: str) -> dict[str, str]:
    return {name: f"{name}-{int(version) * 13 % 97:04x}" for name in ("model.embed_tokens.weight", "lm_head.weight")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--version-file", required=True)
    args, _ = parser.parse_known_args()
    version_file = Path(args.version_file)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def answer(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer({"weight_version": version_file.read_text().strip()})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            version = version_file.read_text().strip()
            if self.path.startswith("/weights_checker"):
                rank = {"parallelism_info": {"tp_rank": 0}, "checksums": checksums(version)}
                self.answer({"success": True, "ranks": [rank]})
                return
            n = req["sampling_params"]["max_new_tokens"]
            meta = {"finish_reason": {"type": "length"}, "weight_version": version}
            self.answer({"output_ids": output_ids(version, req["input_ids"], n), "meta_info": meta})

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
