"""Log format choice (auto|json|text) against a real terminal and a real pipe, and the
grpc core verbosity default that every waygate process (and its children) gets."""

from __future__ import annotations

import json
import logging
import os
import pty

from waygate.core.logs import JsonFormatter, TextFormatter, text_wanted
from waygate.core.settings import GRPC_CORE_VERBOSITY, quiet_grpc_core


def test_auto_is_text_on_a_terminal_and_json_on_a_pipe() -> None:
    leader, follower = pty.openpty()
    read_end, write_end = os.pipe()
    with (
        open(follower, "w") as terminal,
        open(write_end, "w") as pipe,
        open(leader, "rb"),
        open(read_end, "rb"),
    ):
        assert text_wanted("auto", terminal) is True
        assert text_wanted("auto", pipe) is False
        assert text_wanted("json", terminal) is False
        assert text_wanted("text", pipe) is True


def test_text_is_one_readable_line_and_json_one_object() -> None:
    record = logging.LogRecord(
        "waygate.x", logging.WARNING, __file__, 1, "refusing %s", ("x",), None
    )
    record.limit = "max_streams"
    text = TextFormatter("certs").format(record)
    assert "\n" not in text
    assert " WARNING certs  refusing x  limit=max_streams" in text
    entry = json.loads(JsonFormatter("certs").format(record))
    assert entry["msg"] == "refusing x" and entry["limit"] == "max_streams"


def test_grpc_core_is_quieted_unless_the_user_chose_a_verbosity() -> None:
    environ: dict[str, str] = {}
    quiet_grpc_core(environ)
    assert environ == {"GRPC_VERBOSITY": GRPC_CORE_VERBOSITY}
    chosen = {"GRPC_VERBOSITY": "DEBUG"}
    quiet_grpc_core(chosen)
    assert chosen == {"GRPC_VERBOSITY": "DEBUG"}
