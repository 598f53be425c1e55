"""The address at which torchrun's agent tells every worker to find rank 0's store (its --local-addr).

Left to torch, the agent of rank 0 publishes this machine's `socket.getfqdn()`, a name that many clusters and
containers resolve on this machine only, or nowhere (pytorch#150532): its own store's client then spends 300 s
trying to connect to that name, and the run fails, one node or many. An address every node already reaches
takes its place, found without a name lookup of this machine.
"""
from __future__ import annotations

import ipaddress
import socket

from launcher.compat import TORCHRUN_LOCAL_ADDR


def route_toward(host: str) -> tuple[str, str] | None:
    """(this machine's address on its route to `host`, `host`'s address); None where `host` does not resolve or
    no route leads there. A UDP socket's connect sends nothing: the kernel only picks the source address."""
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)
            return probe.getsockname()[0], target[0]
    except OSError:
        return None


def workers_address(endpoint: str) -> str | None:
    """Where the workers of every node reach this machine, should its agent be rank 0: the rendezvous endpoint's
    host as given where it is this machine (every node already reaches it by that name: a Debian /etc/hosts that
    maps this machine's name to 127.0.1.1 does not change that), else this machine's address on the route to it,
    which the other nodes, on the endpoint's network, reach too. None: the endpoint does not resolve here (the
    rendezvous then fails with its own error)."""
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    route = route_toward(host)
    if route is None:
        return None
    mine, theirs = route
    if mine == theirs or ipaddress.ip_address(mine.split("%")[0]).is_loopback:
        return host
    return mine


def local_addr_args(endpoint: str) -> list[str]:
    """torchrun's --local-addr for a node that meets the others at `endpoint` ("localhost" for one node alone);
    nothing where this torchrun has no such flag or no address was found (torch's getfqdn() stands)."""
    address = workers_address(endpoint) if TORCHRUN_LOCAL_ADDR else None
    return [f"--local-addr={address}"] if address else []
