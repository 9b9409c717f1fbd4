"""The engine's bootstrap server: SGLang's own `EngineInfoBootstrapServer`, run as SGLang runs it.

Routes and codes are SGLang's (PUT /register_transfer_engine_info, GET /get_transfer_engine_info?rank=r with
404 for an unregistered rank and 400 for a negative one, GET /health). The loopback adds one thing SGLang
does not need: a rank whose process died is unregistered, so asking for it answers 404 instead of stale
addresses (a real SGLang server goes down as a whole when one of its ranks dies).
"""

from __future__ import annotations

import time

import requests


class BootstrapServer:
    """SGLang's bootstrap server on `host:port`, in a daemon thread of this process."""

    def __init__(self, host: str, port: int):
        from sglang.srt.entrypoints.engine_info_bootstrap_server import EngineInfoBootstrapServer

        self.host, self.port = host, port
        self._server = EngineInfoBootstrapServer(host, port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until this server (not some other listener on the port) serves /health."""
        uvicorn_server = getattr(self._server, "_server", None)
        thread = getattr(self._server, "_thread", None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if thread is not None and not thread.is_alive():
                raise RuntimeError(f"bootstrap server could not start on {self.host}:{self.port} (port in use?)")
            if uvicorn_server is None or uvicorn_server.started:
                try:
                    if requests.get(f"{self.url}/health", timeout=2).text == "OK":
                        return
                except requests.RequestException:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"bootstrap server on {self.host}:{self.port} did not come up in {timeout} s")

    def registered_ranks(self) -> list[int]:
        with self._server.lock:
            return sorted(self._server.transfer_engine_info)

    def unregister(self, rank: int) -> None:
        with self._server.lock:
            self._server.transfer_engine_info.pop(rank, None)

    def close(self) -> None:
        self._server.close()
