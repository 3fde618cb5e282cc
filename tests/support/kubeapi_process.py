"""The STAND-IN Kubernetes API server (`tests.support.kubeapi`) as a process of its own.

For the soak (bench/soak), where certs replicas keep their CA in a Secret and
elect a leader over a Lease: in its own process the stand-in's HTTP threads
do not share a GIL with the load generator, whose latency would otherwise
become the Lease renewals' latency. It binds 127.0.0.1 port 0 and writes its
URL to `--url-file` (atomically, once it serves); SIGTERM or SIGINT stops it.

Run: python -m tests.support.kubeapi_process --url-file PATH
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from tests.support.kubeapi import KubeAPI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url-file", type=Path, required=True)
    arguments = parser.parse_args()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with KubeAPI() as api:
        temporary = arguments.url_file.with_suffix(".tmp")
        temporary.write_text(api.url + "\n")
        temporary.replace(arguments.url_file)
        stop.wait()


if __name__ == "__main__":
    main()
