"""The port probe of `masgraph serve`: a port in use is one error line before the model loads."""

from __future__ import annotations

from masgraph.errors import MasgraphError

STARTUP_FAILURE = 3
"""uvicorn's exit status when its server could not start (e.g. the port is in use)."""


def check_port(host: str, port: int) -> None:
    """A MasgraphError unless `host`:`port` can be bound now, as uvicorn binds it (asyncio's create_server: every
    address the host resolves to, SO_REUSEADDR), so a port in use is one error line before the model loads.

    The check closes its sockets: a process that takes the port while the model loads is still possible (then the
    server's start fails and `cmd_serve` reports it). Handing the bound socket to uvicorn would close that window,
    but masgraph.server.serve takes no socket (it would need a `sock` argument passed on as
    uvicorn.Server(uvicorn.Config(app, ...)).run(sockets=[sock]))."""
    import errno
    import socket

    if port == 0:  # any free port
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise MasgraphError(f"--host {host}: not an address of this machine ({exc.strerror}); use e.g. 127.0.0.1 "
                            "(this machine only) or 0.0.0.0 (every interface)") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's create_server does
            try:
                sock.bind(address)
            except OSError as exc:
                why = {errno.EADDRINUSE: "another process is listening there",
                       errno.EACCES: "a port below 1024 needs root",
                       errno.EADDRNOTAVAIL: "--host is not an address of this machine"}.get(exc.errno, "")
                raise MasgraphError(f"cannot serve at {host}:{port}: {exc.strerror or exc}"
                                    f"{f' ({why})' if why else ''}; {port_fix(port)}") from None


def port_fix(port: int) -> str:
    """What to do about a port that cannot be bound."""
    return f"pick another --port, or stop what uses port {port} (`ss -ltnp 'sport = :{port}'` shows it)"
