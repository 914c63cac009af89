"""Which torch build fits this machine: the CPU wheel, or a CUDA build when an NVIDIA GPU is visible.

`make setup` runs `python -m masgraph.torch_build install --want $(TORCH)` in a venv that has no torch yet,
then `... check --want $(TORCH)` once torch is in. Standard library only at import time, so it runs there.

`want` is `auto | cpu | cuda | cuXYZ`: `auto` is `cuda` when `nvidia-smi` lists a GPU, else `cpu`; `cuda` is
PyPI's default Linux build (CUDA); `cu126`, `cu128`, `cu130`, ... come from download.pytorch.org.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

TORCH_VERSION = "2.13.0"
PYTORCH_INDEX = "https://download.pytorch.org/whl"
KNOWN_CUDA = ("cu126", "cu128", "cu130")
"""CUDA builds suggested when the driver is too old for the installed one (any cuXYZ is accepted)."""
CHOICES = "auto, cpu, cuda or cuXYZ (e.g. cu126, cu128, cu130)"
_GPU_LINE = re.compile(r"^GPU \d+: (.+?)(?: \(UUID: [^)]*\))?\s*$")


def parse_nvidia_smi_list(text: str) -> list[str]:
    """The GPU names in `nvidia-smi -L` output (its `GPU N: NAME (UUID: ...)` lines)."""
    return [m.group(1).strip() for line in text.splitlines() if (m := _GPU_LINE.match(line.strip()))]


def _run_nvidia_smi(args: Sequence[str], timeout: float) -> str:
    """`nvidia-smi ARGS` stdout, or "" when it is not on PATH, fails or hangs."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def detect_gpus(timeout: float = 10.0) -> list[str]:
    """The NVIDIA GPUs usable here (empty: none), as `nvidia-smi -L` lists them. Only nvidia-smi counts: a container
    started without its GPUs still shows the host's in /proc/driver/nvidia, and cannot use them."""
    return parse_nvidia_smi_list(_run_nvidia_smi(["-L"], timeout))


def driver_cuda(timeout: float = 10.0) -> str | None:
    """The newest CUDA version the NVIDIA driver supports ("12.8"), from `nvidia-smi`'s header; None if unknown."""
    m = re.search(r"CUDA Version:\s*(\d+\.\d+)", _run_nvidia_smi([], timeout))
    return m.group(1) if m else None


def choose(want: str, gpus: Sequence[str]) -> tuple[str | None, str]:
    """(choice, "") for a wanted build: `cpu`, `cuda` or `cuXYZ` (auto: cuda with a GPU, else cpu);
    (None, error message) for anything else."""
    w = want.strip().lower()
    if w == "auto":
        return ("cuda" if gpus else "cpu"), ""
    if w in ("cpu", "cuda") or re.fullmatch(r"cu\d{3}", w):
        return w, ""
    return None, f"TORCH={want!r} is not a torch build; use {CHOICES}"


def cuda_tag(cuda_version: str | None) -> str | None:
    """The wheel tag for a CUDA version: "12.8" -> "cu128"; None for a CPU build."""
    if not cuda_version:
        return None
    parts = cuda_version.split(".")
    return f"cu{parts[0]}{parts[1] if len(parts) > 1 else '0'}"


def tag_cuda(tag: str) -> str:
    """The CUDA version for a wheel tag: "cu128" -> "12.8"."""
    digits = tag[2:]
    return f"{digits[:-1]}.{digits[-1]}"


def pip_commands(choice: str, platform: str = sys.platform) -> list[list[str]]:
    """The `pip install` arguments for a choice, tried in order until one succeeds. cpu: the normal pip config
    first (a local wheel, an index that has it), then PyTorch's CPU index; off Linux PyPI's default is the CPU
    build. cuda: PyPI's default Linux build (a +cpu wheel excluded). cuXYZ: PyTorch's index for that CUDA version."""
    if choice == "cpu":
        if not platform.startswith("linux"):
            return [["install", f"torch=={TORCH_VERSION}"]]
        spec = f"torch=={TORCH_VERSION}+cpu"
        return [["install", spec], ["install", spec, "--extra-index-url", f"{PYTORCH_INDEX}/cpu"]]
    if choice == "cuda":  # PyPI's build, never a +cpu wheel another source offers (== would match it, and win)
        return [["install", f"torch=={TORCH_VERSION},!={TORCH_VERSION}+cpu"]]
    return [["install", f"torch=={TORCH_VERSION}+{choice}", "--extra-index-url", f"{PYTORCH_INDEX}/{choice}"]]


def satisfies(choice: str, version: str | None, cuda_version: str | None) -> bool:
    """Whether an installed torch (`version`, its build's CUDA version) already is the build for a choice."""
    if version is None or version.split("+")[0] != TORCH_VERSION:
        return False
    if choice == "cpu":
        return cuda_version is None
    if choice == "cuda":
        return cuda_version is not None
    return cuda_tag(cuda_version) == choice


def installed_torch() -> tuple[str | None, str | None]:
    """(version, CUDA version) of the torch in this interpreter, read from its files without importing it;
    (None, None) when there is none."""
    try:
        version = importlib.metadata.version("torch")
        spec = importlib.util.find_spec("torch")
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None, None
    if spec is None or not spec.submodule_search_locations:
        return None, None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return version, None
    m = re.search(r"^cuda\b[^=]*=\s*['\"]([\d.]+)['\"]", text, re.MULTILINE)
    return version, (m.group(1) if m else None)


def _as_tuple(version: str) -> tuple[int, ...]:
    """ "12.8" -> (12, 8); () when it is not a version."""
    try:
        return tuple(int(x) for x in version.split("."))
    except ValueError:
        return ()


def suggest_cuda(driver: str | None, venv: str = ".venv") -> str:
    """What to run for a CUDA build the driver cannot serve: the newest known cuXYZ the driver supports
    (`driver`: its CUDA version, None when unknown)."""
    known = ", ".join(KNOWN_CUDA)
    if driver is None or not _as_tuple(driver):
        return f"rm -rf {venv} && make setup TORCH=cuXYZ for the CUDA version `nvidia-smi` reports or lower ({known})"
    fits = [t for t in KNOWN_CUDA if _as_tuple(tag_cuda(t)) <= _as_tuple(driver)]
    if not fits:
        return f"the driver supports CUDA {driver}, older than torch {TORCH_VERSION}'s builds ({known}): update it"
    return f"the driver supports CUDA {driver}: rm -rf {venv} && make setup TORCH={fits[-1]}"


def check(want: str, gpus: Sequence[str], torch_version: str, cuda_version: str | None, cuda_available: bool,
          device_count: int, *, torch_gpus: Sequence[str] = (), driver: str | None = None,
          venv: str = ".venv") -> tuple[bool, str]:
    """(ok, message) for an installed torch against the wanted build on this machine. Refuses a CPU build where
    CUDA is wanted (or auto found a GPU), a CUDA build that sees no GPU where CUDA is wanted, and a CUDA build
    for another version than TORCH=cuXYZ; each message says what to run."""
    choice, error = choose(want, gpus)
    if choice is None:
        return False, error
    name = ", ".join(gpus) if gpus else ""
    setup = "make setup" if want.strip().lower() == "auto" else f"make setup TORCH={choice}"
    if cuda_version is None:  # the CPU build
        if choice == "cpu":
            return True, f"ok: torch {torch_version}, CPU build" + (f" (this machine has an NVIDIA GPU: {name})"
                                                                    if gpus else "")
        if gpus:
            return False, (f"torch {torch_version} is the CPU build but this machine has an NVIDIA GPU ({name}); "
                           f"for the GPU: rm -rf {venv} && {setup}; to stay on the CPU: make setup TORCH=cpu")
        return False, (f"torch {torch_version} is the CPU build and TORCH={want} asks for CUDA, but no NVIDIA GPU "
                       f"is visible here (nvidia-smi lists none); on this machine: make setup TORCH=cpu; "
                       f"on a GPU machine: rm -rf {venv} && {setup}")
    build = f"torch {torch_version} (CUDA {cuda_version})"
    if choice not in ("cpu", "cuda") and cuda_tag(cuda_version) != choice:
        return False, (f"{build} is built for CUDA {cuda_version} but TORCH={choice} asks for CUDA "
                       f"{tag_cuda(choice)}; rm -rf {venv} && make setup TORCH={choice}")
    if cuda_available and device_count > 0:
        names = list(torch_gpus) or list(gpus)
        shown = f": {', '.join(names)}" if names else ""
        return True, (f"ok: torch {torch_version}, CUDA {cuda_version}, {device_count} GPU"
                      f"{'s' if device_count > 1 else ''}{shown}")
    if gpus:
        if choice == "cpu":
            return True, (f"ok: {build} runs on the CPU here (TORCH=cpu); the CPU wheel is smaller: "
                          f"rm -rf {venv} && make setup TORCH=cpu")
        return False, (f"{build} cannot see the NVIDIA GPU that nvidia-smi lists ({name}): the driver is likely "
                       f"too old for this build; {suggest_cuda(driver, venv)}; "
                       f"or the CPU: rm -rf {venv} && make setup TORCH=cpu")
    if choice == "cpu" or want.strip().lower() == "auto":
        return True, (f"ok: {build} runs on the CPU here (no NVIDIA GPU visible); the CPU wheel is smaller: "
                      f"rm -rf {venv} && make setup TORCH=cpu")
    return False, (f"{build} is a CUDA build but no NVIDIA GPU is visible here (nvidia-smi lists none) and "
                   f"TORCH={want} asks for one; on this machine: rm -rf {venv} && make setup TORCH=cpu")


def _venv_label() -> str:
    """This interpreter's venv as the user typed it: relative to the working directory when inside it."""
    prefix = Path(sys.prefix)
    try:
        return str(prefix.relative_to(Path.cwd()))
    except ValueError:
        return str(prefix)


def _install(want: str) -> int:
    """Install the torch build for `want` into this interpreter unless it is already there."""
    gpus = detect_gpus()
    choice, error = choose(want, gpus)
    if choice is None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    why = f"NVIDIA GPU: {', '.join(gpus)}" if gpus else "no NVIDIA GPU visible"
    print(f"torch_build: TORCH={want} -> {choice} ({why})")
    version, cuda_version = installed_torch()
    # auto on a machine with no GPU keeps a CUDA build already there (it runs on the CPU; the check accepts it)
    kept_cuda = want.strip().lower() == "auto" and choice == "cpu" and satisfies("cuda", version, cuda_version)
    if satisfies(choice, version, cuda_version) or kept_cuda:
        print(f"torch_build: torch {version} already installed; left as it is")
        return 0
    attempts = pip_commands(choice)
    for i, args in enumerate(attempts):
        cmd = [sys.executable, "-m", "pip", *args[:1], "-q", "--disable-pip-version-check", *args[1:]]
        print("torch_build: pip " + " ".join(args))
        last = i == len(attempts) - 1
        done = subprocess.run(cmd, capture_output=not last, text=True, check=False)
        if done.returncode == 0:
            return 0
        if not last:
            print("torch_build: not found with the default pip config; trying the next source")
    print(f"error: pip could not install torch {TORCH_VERSION} for TORCH={want} ({choice}); see pip's message above",
          file=sys.stderr)
    return 1


def _check(want: str) -> int:
    """Import torch and print the ok line, or `error: ...` on stderr with exit status 1."""
    try:
        import torch  # here, not at the top: torch may be absent (an error line, not a traceback)

        version = str(torch.__version__)
        cuda_version = torch.version.cuda
        available = bool(torch.cuda.is_available())
        count = int(torch.cuda.device_count()) if available else 0
        torch_gpus = [str(torch.cuda.get_device_name(i)) for i in range(count)]
    except Exception as e:  # a missing or broken torch: one line that says so
        print(f"error: torch does not import in {sys.executable} ({type(e).__name__}: {e}); "
              f"run: make setup", file=sys.stderr)
        return 1
    gpus = detect_gpus()
    needs_driver = cuda_version is not None and not available and bool(gpus)
    ok, message = check(want, gpus, version, cuda_version, available, count, torch_gpus=torch_gpus,
                        driver=driver_cuda() if needs_driver else None, venv=_venv_label())
    print(message if ok else f"error: {message}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m masgraph.torch_build install|check [--want W]`; W defaults to $TORCH, else auto."""
    parser = argparse.ArgumentParser(prog="python -m masgraph.torch_build", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["install", "check"])
    parser.add_argument("--want", default=os.environ.get("TORCH") or "auto", help=CHOICES)
    args = parser.parse_args(argv)
    return _install(args.want) if args.action == "install" else _check(args.want)


if __name__ == "__main__":
    sys.exit(main())
