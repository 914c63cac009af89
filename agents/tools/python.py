"""Python tool: runs a snippet in an isolated subprocess — its own user, mount and network namespaces
(`unshare -rnm`), every mount read-only except a fresh temp dir (its cwd), no network, and CPU-time,
memory, file-size and wall-clock limits. Without namespace support it refuses rather than run unsandboxed."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import sys
import tempfile

from pydantic import Field

from masgraph.agents.tools.registry import ToolError, ToolOptions, register_kind

# Inside the namespaces: make every mount read-only, then re-expose the temp dir read-write.
_JAIL = r"""
set -e
while read -r _ mnt _; do mount -o remount,bind,ro "$mnt" 2>/dev/null || true; done < /proc/self/mounts
mount -o remount,bind,ro / 2>/dev/null || mount --bind / / && mount -o remount,bind,ro /
mount --bind "$JAIL_DIR" "$JAIL_DIR" && mount -o remount,bind,rw "$JAIL_DIR"
cd "$JAIL_DIR"
exec "$JAIL_PY" -I -B snippet.py
"""


def _limits(cpu_s: int, memory_mb: int, file_mb: int):
    def apply() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
    return apply


async def run_python(code: str, timeout_s: float = 10.0, memory_mb: int = 512, max_output: int = 4000) -> str:
    """Run `code` sandboxed; return stdout (and stderr on failure), raise ToolError on failure/timeout."""
    if shutil.which("unshare") is None:
        raise ToolError("the python tool needs `unshare` (util-linux) for its sandbox; it is not installed")
    with tempfile.TemporaryDirectory(prefix="masgraph-py-") as jail:
        with open(os.path.join(jail, "snippet.py"), "w") as f:
            f.write(code)
        env = {"JAIL_DIR": jail, "JAIL_PY": sys.executable, "PATH": "/usr/bin:/bin", "HOME": jail,
               "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        proc = await asyncio.create_subprocess_exec(
            "unshare", "-rnm", "sh", "-c", _JAIL, env=env, cwd=jail, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=_limits(int(timeout_s) + 1, memory_mb, 16))
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            _kill(proc)
            await proc.wait()
            raise ToolError(f"python snippet exceeded {timeout_s}s and was killed") from None
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    if "unshare:" in stderr and proc.returncode != 0:
        raise ToolError(f"sandbox unavailable (user namespaces disabled?): {stderr.strip()[:200]}")
    if proc.returncode != 0:
        reason = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        raise ToolError(f"python failed ({reason}): {(stderr or stdout).strip()[-max_output:]}")
    return stdout.strip()[-max_output:] or "(no output; print() the result)"


def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class PythonOptions(ToolOptions):
    cpu_timeout_s: float = Field(10.0, gt=0, le=600)
    """CPU/wall limit of one snippet, in seconds."""
    memory_mb: int = Field(512, ge=32, le=65536)
    """Address-space limit of the snippet, in MiB."""


@register_kind("python", "runs a Python snippet in a sandbox and returns what it prints, e.g. Input: print(2**10)",
               options=PythonOptions)
def make_python(options: PythonOptions):
    async def python(code: str) -> str:
        return await run_python(code, options.cpu_timeout_s, options.memory_mb)
    return python
