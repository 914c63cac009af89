"""`masgraph serve`: serve a graph behind an OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from masgraph.cli.common import plural, print_topology, removed_if_left_empty, with_device
from masgraph.cli.flags import device_arg, model_flag, non_negative_int, positive_float, positive_int
from masgraph.cli.port import STARTUP_FAILURE, check_port, port_fix
from masgraph.errors import MasgraphError
from masgraph.rundir.layout import CONFIG, EVENTS, SPEC, SUMMARY

if TYPE_CHECKING:
    from masgraph.serve.agent import Agent

HELP = "serve a graph behind an OpenAI-compatible endpoint (/v1/chat/completions)"

HOST = "127.0.0.1"
"""Where `serve` binds by default: this machine only (no config model holds the address)."""
PORT = 8000
"""The port `serve` binds by default (no config model holds it)."""


def kib(n_bytes: int) -> int:
    """Bytes as whole KiB (--max-body-kb)."""
    return n_bytes // 1024


def add_arguments(sv: argparse.ArgumentParser) -> None:
    from masgraph.runtime.runner import RunConfig
    from masgraph.serve.server import ServeConfig, serve

    sv.add_argument("graph", help="a bundle (`masgraph export`: a directory or .tar.gz) or a graph YAML file")
    sv.add_argument("--checkpoint", help="serve trained adapters (and topology): a training run dir or "
                                         "RUN/checkpoints/step-N")
    sv.add_argument("--host", default=HOST, help="address to bind (default %(default)s: this machine only)")
    sv.add_argument("--port", type=non_negative_int, default=PORT, help="port (default %(default)s)")
    sv.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default: $MASGRAPH_API_KEY, else none)")
    sv.add_argument("--allow-public-without-key", action="store_true",
                    help="serve a non-loopback --host without an API key (refused otherwise)")
    sv.add_argument("--topology", choices=["greedy", "sample"], help="how the topology policy picks each question's "
                    "sub-graph (default: greedy when learned, sample for the untrained prior)")
    sv.add_argument("--deterministic", action="store_true", help="bit-exact answers whatever the load (slower)")
    device_arg(sv)
    model_flag(sv, "--max-concurrency", ServeConfig, "max_concurrency", type=positive_int,
               help="episodes running at once (default %(default)s: one engine batch of every node's calls)")
    model_flag(sv, "--max-queue", ServeConfig, "max_queue", type=non_negative_int,
               help="requests waiting for a slot beyond those; more get 429 with Retry-After at once "
                    "(default %(default)s)")
    model_flag(sv, "--max-wait", ServeConfig, "max_wait_s", type=positive_float, help="longest a request waits in "
               "the queue, in s (503 with Retry-After; default: --timeout)")
    model_flag(sv, "--timeout", ServeConfig, "timeout_s", type=positive_float,
               help="limit of one episode in s, from when it starts (504; default %(default)g)")
    model_flag(sv, "--max-connections", ServeConfig, "max_connections", type=positive_int, help="open connections "
               "at once (503 beyond; default: --max-concurrency + --max-queue + 64)")
    model_flag(sv, "--max-body-kb", ServeConfig, "max_body_bytes", to_flag=kib, type=positive_int,
               help="largest request body (413; default %(default)s)")
    sv.add_argument("--mcp", nargs="?", const="stdio", choices=["stdio", "http"],
                    help="serve the agent as an MCP server with one tool, ask(question) -> answer and trace id: over "
                         "stdio (`--mcp`, for a client that starts this command) or streamable HTTP "
                         "(`--mcp http`: http://HOST:PORT/mcp), instead of the OpenAI endpoint")
    sv.add_argument("--no-store", action="store_true", help="keep no traces (default: a run dir under --runs-dir)")
    sv.add_argument("--conversations", metavar="DIR", help="keep the fact stores of `scope: conversation` memory "
                    "nodes in DIR (one file per conversation; a restart continues them; default: in memory only)")
    model_flag(sv, "--runs-dir", RunConfig, "runs_dir", help="where trace directories go (default %(default)s/)")
    model_flag(sv, "--log-level", serve, "log_level", choices=["critical", "error", "warning", "info", "debug"],
               help="server log level (info logs every request)")
    sv.set_defaults(fn=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from masgraph.rundir.store import new_run_dir
    from masgraph.serve.agent import Agent, open_source
    from masgraph.serve.server import ServeConfig, check_bind, serve

    api_key = args.api_key or os.environ.get("MASGRAPH_API_KEY") or None
    if args.mcp != "stdio":  # (a stdio MCP server binds nothing)
        check_bind(args.host, api_key, args.allow_public_without_key)
        check_port(args.host, args.port)  # a port in use: an error line now, not after the model has loaded
    conversations = None
    if args.conversations:  # an unusable directory fails now, not after the model has loaded
        from masgraph.memory.conversations import ConversationStores

        conversations = ConversationStores(args.conversations)
    graph, bundle = open_source(args.graph)
    graph = with_device(graph, args.device, args.graph)
    if args.topology and graph.spec.topology is None:
        raise MasgraphError(f"--topology {args.topology}: graph {graph.spec.name!r} has no `topology:` section; "
                            "drop the flag")
    store = None
    if not args.no_store:
        Path(args.runs_dir).mkdir(parents=True, exist_ok=True)  # unwritable: fails before the model loads
        store = new_run_dir(args.runs_dir, f"{graph.spec.name}-serve")
    config = ServeConfig(api_key=api_key, max_body_bytes=args.max_body_kb * 1024, max_concurrency=args.max_concurrency,
                         max_queue=args.max_queue, max_wait_s=args.max_wait, timeout_s=args.timeout, store=store,
                         max_connections=args.max_connections)
    print(f"loading {graph.spec.name} ({plural(len(graph.spec.nodes), 'node')}) ...", file=sys.stderr)
    with nullcontext() if store is None else removed_if_left_empty(store):
        agent = Agent(graph, args.checkpoint, args.topology, args.deterministic, bundle=bundle)
    if conversations is not None:
        agent.engine.conversations = conversations
        print(f"conversation memories go to {args.conversations}", file=sys.stderr)
    if agent.topology is not None:
        print_topology(agent.topology, agent.mode)
    if store is not None:
        print(f"traces go to {store} (--no-store to keep none)", file=sys.stderr)
    host = f"[{args.host}]" if ":" in args.host else args.host
    if args.mcp:
        return _serve_mcp(agent, args, api_key, store, host)
    print(f"serving model {graph.spec.name!r} at http://{host}:{args.port}/v1 (OpenAI-compatible chat completions"
          f"{'; bearer key required' if api_key else ''}); Ctrl-C stops", file=sys.stderr)
    try:
        serve(agent, graph.spec.name, args.host, args.port, config, log_level=args.log_level)
    except SystemExit as exc:  # uvicorn could not start (logged above): the port was taken while the model loaded
        if exc.code != STARTUP_FAILURE:
            raise
        if store is not None:
            remove_unused_store(store)
        raise MasgraphError(f"the server could not start at http://{host}:{args.port} (uvicorn's message above; "
                            f"{port_fix(args.port)})") from None
    return 0


def _serve_mcp(agent: Agent, args: argparse.Namespace, api_key: str | None, store: Path | None, host: str) -> int:
    from masgraph.serve.mcp import PATH, serve_mcp

    where = "stdio" if args.mcp == "stdio" else f"http://{host}:{args.port}{PATH} (streamable HTTP" + (
        "; bearer key required)" if api_key else ")")
    print(f"serving {agent.name!r} as an MCP server (tool: ask) on {where}", file=sys.stderr)
    serve_mcp(agent, args.mcp, host=args.host, port=args.port, api_key=api_key, timeout_s=args.timeout,
              store=store, log_level=args.log_level)
    return 0


def remove_unused_store(store: Path) -> None:
    """Removes the trace dir of a server that never started: only what RunStore writes, and no episode in it."""
    from masgraph.rundir.store import INDEX

    files = {SPEC, CONFIG, SUMMARY, EVENTS, INDEX}
    try:
        entries = list(store.iterdir())
        if all(p.name in files and p.is_file() for p in entries) and not any(
                p.stat().st_size for p in entries if p.name in (EVENTS, INDEX)):
            for p in entries:
                p.unlink()
            store.rmdir()
    except OSError:
        pass
