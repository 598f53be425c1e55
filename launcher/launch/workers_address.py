"""Where the agents and workers of several machines reach each other, found from the route to the rendezvous
endpoint rather than from this machine's name: rank 0's store, who serves the rendezvous, gloo's interface.

Left to torch, each is this machine's name resolved (`socket.getfqdn()`, `gethostname()`), which many clusters
and containers resolve on this machine only, to 127.0.1.1 (Debian's and Ubuntu's /etc/hosts), or nowhere
(pytorch#150532, #73656). A run then waited minutes and failed, one node or many.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path

from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address


def host_of(endpoint: str) -> str:
    """The endpoint's host as torchrun reads it (an IPv6 address in brackets or not)."""
    return parse_rendezvous_endpoint(endpoint, default_port=0)[0]


def loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


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


def torch_would_serve(host: str) -> bool:
    """torch's own guess whether this machine is `host` (c10d's is_host left unset): right for localhost, a
    loopback address and this machine's own name, even where that name resolves to an address of another machine
    (a NAT's or floating one); it raises where this machine's name resolves nowhere."""
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
        return bool(_matches_machine_hostname(host))
    except Exception:  # noqa: BLE001 - (a private function: gone, or failing, it guesses nothing)
        return False


def workers_address(endpoint: str) -> str | None:
    """Where the workers of every node reach this machine, should its agent be rank 0 (torchrun's --local-addr):
    the endpoint's host as given where it is this machine (every node already reaches it by that name), else this
    machine's address on the route to it, which the other nodes, on the endpoint's network, reach too. None: the
    endpoint does not resolve here (the rendezvous then fails with its own error)."""
    host = host_of(endpoint)
    route = route_toward(host)
    if route is None:
        return None
    mine, theirs = route
    return host if mine == theirs or loopback(mine) or torch_would_serve(host) else mine


def serves_rendezvous(endpoint: str) -> bool | None:
    """Whether this node's agent serves the c10d store at `endpoint` (is_host), for nodes that each run the same
    command: False on another machine than the endpoint's; True on the endpoint's machine where torch's guess
    says no (its address is not what this machine's name resolves to: no node served it, and every agent waited
    launcher.rdzv_timeout_s); None, torch's guess, where it is right (localhost, a loopback address, this
    machine's name: where two launchers share this machine, the second then joins as a client) or the endpoint
    does not resolve here. (Two launchers on the endpoint's machine at an address its name does not resolve to
    both serve: the second fails at once, where before both waited.)"""
    host = host_of(endpoint)
    route = route_toward(host)
    if route is None or torch_would_serve(host):
        return None
    mine, theirs = route
    if mine != theirs and not loopback(mine):
        return False
    return None if loopback(theirs) else True


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds `address` (Linux: /proc for IPv6, an ioctl for
    IPv4's primary addresses); None where none is found."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.version == 6:
        try:
            rows = [row.split() for row in Path("/proc/net/if_inet6").read_text().splitlines()]
        except OSError:
            return None
        return next((row[-1] for row in rows if ipaddress.IPv6Address(int(row[0], 16)) == ip), None)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # (no IPv4 address)
                continue
            if socket.inet_ntoa(answer[20:24]) == str(ip):
                return name
    return None


def gloo_interface(endpoint: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for the workers of a node of several: the interface of its route to the endpoint. gloo
    (the process group on CPUs; on GPUs, the groups of the out-of-memory agreement and of fsdp's checkpoints)
    binds what this machine's name resolves to: 127.0.1.1 on Debian and Ubuntu, which the other machines'
    ranks cannot reach. Nothing where the user set it (a faster network than the endpoint's: IPoIB), or where the
    route is this machine's loopback (nodes on one machine, or an endpoint named as this machine: gloo's own
    choice stands)."""
    route = route_toward(host_of(endpoint))
    if "GLOO_SOCKET_IFNAME" in os.environ or route is None or loopback(route[0]):
        return {}
    name = interface_of(route[0])
    return {"GLOO_SOCKET_IFNAME": name} if name else {}
