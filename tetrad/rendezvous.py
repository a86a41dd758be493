"""Wait until the master's DNS name resolves: the worker pods' init container.

Pod 0's name appears in DNS once it has an IP (the Service publishes not-ready addresses), so a
worker scheduled first waits here, bounded by the rendezvous timeout, instead of crash-looping.
Run as `python -m tetrad.rendezvous`; configured by the PET_* env of tetrad.render.env.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from tetrad.api.contract import ENV_RDZV_TIMEOUT


def wait_for(host: str, timeout: float, interval: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.getaddrinfo(host, None)
            return True
        except socket.gaierror:
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval)


def main() -> int:
    host = os.environ["PET_MASTER_ADDR"]
    timeout = float(os.environ.get(ENV_RDZV_TIMEOUT, "900"))
    print(f"waiting up to {timeout:.0f}s for the master {host} to resolve", flush=True)
    if wait_for(host, timeout):
        print(f"{host} resolves", flush=True)
        return 0
    print(f"{host} did not resolve within {timeout:.0f}s; is pod 0 scheduled?", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
