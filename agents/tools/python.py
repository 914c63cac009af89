"""Python tool: runs a snippet like a notebook cell (the last expression's repr is printed) in a bubblewrap
sandbox (see sandbox.py): no network, no host files, capped processes, memory, CPU, wall time and output."""

from __future__ import annotations

import sys

from pydantic import Field

from masgraph.agents.tools.registry import ToolError, ToolOptions, register_kind
from masgraph.agents.tools.sandbox import SandboxLimits, run_sandboxed

# Runs inside the sandbox: exec the cell's body, then eval a trailing expression and print its repr (unless
# None), as a notebook does. Tracebacks start at the snippet's own frames.
_RUNNER = """\
import ast, sys, traceback
def main():
    src = open("snippet.py", encoding="utf-8").read()
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        tree = ast.parse(src, "snippet.py")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "snippet.py", "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "snippet.py", "eval"), ns)
            if value is not None:
                print(repr(value))
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "snippet.py":
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)
main()
"""


async def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 512, max_output: int = 4000,
                     limits: SandboxLimits | None = None) -> str:
    """Run `code` sandboxed as a notebook cell; return what it printed, raise ToolError on failure or timeout.

    `limits` overrides the defaults built from `timeout_s` and `memory_mb`; `max_output` characters are kept.
    """
    limits = limits or SandboxLimits(wall_s=timeout_s, memory_mb=memory_mb)
    result = await run_sandboxed([sys.executable, "-I", "-B", "-c", _RUNNER], {"snippet.py": code.encode()}, limits)
    if result.exit_code != 0:
        reason = f"killed by signal {result.exit_code - 128}" if result.exit_code > 128 else \
            f"exit code {result.exit_code}"
        raise ToolError(f"python failed ({reason}): {(result.stderr or result.stdout).strip()[-max_output:]}")
    return result.stdout.strip()[-max_output:] or "(no output; print() the result)"


class PythonOptions(ToolOptions):
    cpu_timeout_s: float = Field(10.0, gt=0, le=600)
    """CPU/wall limit of one snippet, in seconds."""
    memory_mb: int = Field(512, ge=32, le=65536)
    """Address-space limit of the snippet, in MiB."""


@register_kind("python", "runs a Python snippet like a notebook cell (the last expression is shown) and returns "
                         "what it prints, e.g. Input: 2**10", options=PythonOptions)
def make_python(options: PythonOptions):
    async def python(code: str) -> str:
        return await run_python(code, options.cpu_timeout_s, options.memory_mb)
    return python
