"""`waygate certs serve` in-process: stopping the process shuts the signing pool down."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from tests.support.poll import until
from waygate.certs import app
from waygate.certs.service import CertsService
from waygate.core.runtime import ServiceProcess
from waygate.core.settings import load_settings


async def test_stopping_the_process_shuts_the_signing_pool_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump({"tokens": [{"token": "t" * 40, "name": "ops", "admin": True}]})
    )
    tokens.chmod(0o600)
    settings = load_settings(
        app.Settings,
        flags={
            "grpc_port": "0", "admin_port": "0", "ca_dir": str(tmp_path / "ca"),
            "tokens_file": str(tokens),
        },
        env={},
    )  # fmt: skip
    made: list[CertsService] = []

    class Recorded(CertsService):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(app, "CertsService", Recorded)
    process = ServiceProcess("certs", settings)
    running = asyncio.ensure_future(process.run(lambda p: app.setup(p, settings)))
    try:
        await until(lambda: process.readiness.ready, "certs ready")
        (service,) = made
        assert not service.executor._pool._shutdown
        process.request_stop()
        assert await asyncio.wait_for(running, 30) == 0
        assert service.executor._pool._shutdown
    finally:
        if not running.done():
            process.request_stop()
            await asyncio.wait_for(running, 30)
