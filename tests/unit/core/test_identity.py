"""waygate.core.identity is the one identity-matching rule; the tunnel uses it
without reaching into the resolver's internals."""

from __future__ import annotations

import subprocess
import sys

from waygate.core.identity import matches, patterns_problem


def test_patterns_and_matching() -> None:
    assert matches("spiffe://w.local/ns/a/sa/tunnel-*", "spiffe://w.local/ns/a/sa/tunnel-1")
    assert not matches("spiffe://w.local/ns/a/sa/x", "spiffe://w.local/ns/a/sa/xy")
    assert matches("Proxy.Example.com.", "proxy.example.com")
    assert patterns_problem(["spiffe://w.local/*", "proxy.example.com"]) is None
    assert "only at the end" in (patterns_problem(["spiffe://w.local/*/x"]) or "")


def test_the_tunnel_server_imports_no_resolver_internals() -> None:
    code = (
        "import sys, waygate.tunnel.server, waygate.tunnel.server_app; "
        "print(sorted(m for m in sys.modules if m.startswith('waygate.resolver.access')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert loaded.strip() == "[]"
