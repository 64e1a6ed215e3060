"""Offline guard for env tests (tau2's tests and the fork tests import it): every non-loopback connection refused."""
from __future__ import annotations

import socket

import pytest


@pytest.fixture
def offline(monkeypatch):
    """Refuse every non-loopback connection; proxies point at a dead local port."""
    real_connect = socket.socket.connect

    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "localhost", "::1") and self.family != socket.AF_UNIX:
            raise OSError(f"network disabled in tests: {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
