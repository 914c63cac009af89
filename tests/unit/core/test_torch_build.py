"""`make setup`'s torch build fits the machine: choose/check/pip commands on hand-made inputs, and the CLI run as
`make` runs it, against a fake `nvidia-smi` on PATH and the venv's real torch or a fake CUDA torch. Nothing here
installs anything (pip is replaced where the install path runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from masgraph import torch_build as tb
from masgraph.torch_build import check, choose, pip_commands, satisfies

ROOT = Path(__file__).resolve().parents[3]
H100 = "NVIDIA H100 80GB HBM3"
CPU_BUILD = tb.installed_torch()[1] is None


# ---- choose ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("want", "gpus", "choice"), [
    ("auto", [], "cpu"), ("auto", [H100], "cuda"), ("cpu", [H100], "cpu"), ("cuda", [], "cuda"),
    ("cu128", [], "cu128"), ("CU126", [H100], "cu126"), (" cpu ", [], "cpu"),
])
def test_choose(want, gpus, choice):
    assert choose(want, gpus) == (choice, "")


@pytest.mark.parametrize("want", ["gpu", "cu12", "cuda:0", "", "rocm"])
def test_choose_refuses_other_names_and_lists_the_choices(want):
    choice, error = choose(want, [])
    assert choice is None
    assert repr(want) in error and "auto, cpu, cuda or cuXYZ" in error


# ---- pip commands ----------------------------------------------------------------------------------------

def test_pip_commands_cpu_tries_the_pip_config_first_then_pytorchs_cpu_index():
    assert pip_commands("cpu", "linux") == [
        ["install", "torch==2.13.0+cpu"],
        ["install", "torch==2.13.0+cpu", "--extra-index-url", "https://download.pytorch.org/whl/cpu"],
    ]


def test_pip_commands_cuda_and_cuxyz():
    assert pip_commands("cuda", "linux") == [["install", "torch==2.13.0,!=2.13.0+cpu"]]
    assert pip_commands("cu126", "linux") == [
        ["install", "torch==2.13.0+cu126", "--extra-index-url", "https://download.pytorch.org/whl/cu126"]]


def test_pip_commands_cpu_off_linux_is_pypis_default():
    assert pip_commands("cpu", "darwin") == [["install", "torch==2.13.0"]]


@pytest.mark.parametrize(("choice", "version", "cuda", "ok"), [
    ("cpu", "2.13.0+cpu", None, True), ("cpu", "2.13.0", "12.8", False), ("cpu", "2.12.1+cpu", None, False),
    ("cpu", None, None, False), ("cuda", "2.13.0", "12.8", True), ("cuda", "2.13.0+cpu", None, False),
    ("cu128", "2.13.0", "12.8", True), ("cu128", "2.13.0+cu128", "12.8", True),
    ("cu128", "2.13.0+cu126", "12.6", False),
])
def test_satisfies(choice, version, cuda, ok):
    assert satisfies(choice, version, cuda) is ok


# ---- install: pip only when needed, the fallback only when the first source fails ------------------------

class FakePip:
    def __init__(self, codes: list[int]):
        self.codes, self.calls = codes, []

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        return subprocess.CompletedProcess(cmd, self.codes[len(self.calls) - 1], "", "")


def _install(monkeypatch, want, gpus, installed, codes):
    pip = FakePip(codes)
    monkeypatch.setattr(tb, "detect_gpus", lambda: list(gpus))
    monkeypatch.setattr(tb, "installed_torch", lambda: installed)
    monkeypatch.setattr(tb.subprocess, "run", pip)
    monkeypatch.setattr(tb.sys, "platform", "linux")
    return tb.main(["install", "--want", want]), [c[c.index("pip") + 1:] for c in pip.calls]


def test_install_leaves_a_fitting_torch_alone(monkeypatch):
    assert _install(monkeypatch, "auto", [], ("2.13.0+cpu", None), []) == (0, [])
    # auto with no GPU keeps a CUDA build (it runs on the CPU); an explicit TORCH=cpu swaps it for the CPU wheel
    assert _install(monkeypatch, "auto", [], ("2.13.0+cu128", "12.8"), []) == (0, [])
    assert _install(monkeypatch, "cpu", [], ("2.13.0+cu128", "12.8"), [0])[1] != []
    # a CPU build on a GPU machine is replaced, and never by another +cpu wheel
    rc, calls = _install(monkeypatch, "auto", [H100], ("2.13.0+cpu", None), [0])
    assert rc == 0 and calls[0][-1] == "torch==2.13.0,!=2.13.0+cpu"


def test_the_cuda_requirement_excludes_the_cpu_wheel():
    from pip._vendor.packaging.specifiers import SpecifierSet

    [[_, requirement]] = pip_commands("cuda", "linux")
    spec = SpecifierSet(requirement.removeprefix("torch"))
    assert "2.13.0" in spec and "2.13.0+cu128" in spec and "2.13.0+cpu" not in spec


def test_install_cpu_falls_back_to_pytorchs_index_only_when_the_pip_config_fails(monkeypatch):
    rc, calls = _install(monkeypatch, "auto", [], (None, None), [0])
    assert rc == 0 and calls == [["install", "-q", "--disable-pip-version-check", "torch==2.13.0+cpu"]]
    rc, calls = _install(monkeypatch, "cpu", [H100], (None, None), [1, 0])
    assert rc == 0 and len(calls) == 2 and calls[1][-2:] == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]


def test_install_auto_with_a_gpu_asks_pypi_for_its_default_cuda_build(monkeypatch):
    rc, calls = _install(monkeypatch, "auto", [H100], (None, None), [0])
    assert rc == 0 and calls == [["install", "-q", "--disable-pip-version-check", "torch==2.13.0,!=2.13.0+cpu"]]


def test_install_fails_when_every_source_fails(monkeypatch, capsys):
    rc, calls = _install(monkeypatch, "cu128", [], ("2.13.0+cpu", None), [1])
    assert rc == 1 and len(calls) == 1 and "error: pip could not install" in capsys.readouterr().err


def test_install_refuses_an_unknown_build_name(monkeypatch, capsys):
    assert _install(monkeypatch, "gpu", [], (None, None), []) == (2, [])
    assert "error: TORCH='gpu'" in capsys.readouterr().err


# ---- check -------------------------------------------------------------------------------------------------

def test_check_accepts_the_cpu_build_without_a_gpu():
    ok, msg = check("auto", [], "2.13.0+cpu", None, False, 0)
    assert ok and msg.startswith("ok: torch 2.13.0+cpu")


def test_check_refuses_the_cpu_build_on_a_gpu_machine_and_says_what_to_run():
    ok, msg = check("auto", [H100], "2.13.0+cpu", None, False, 0)
    assert not ok
    assert msg == ("torch 2.13.0+cpu is the CPU build but this machine has an NVIDIA GPU (NVIDIA H100 80GB HBM3); "
                   "for the GPU: rm -rf .venv && make setup; to stay on the CPU: make setup TORCH=cpu")
    ok, msg = check("cu128", [H100], "2.13.0+cpu", None, False, 0, venv="/tmp/v")
    assert not ok and "rm -rf /tmp/v && make setup TORCH=cu128" in msg


def test_check_accepts_the_cpu_build_on_a_gpu_machine_when_cpu_was_asked():
    ok, msg = check("cpu", [H100], "2.13.0+cpu", None, False, 0)
    assert ok and msg.startswith("ok:")


def test_check_refuses_the_cpu_build_when_cuda_was_asked_without_a_gpu():
    ok, msg = check("cuda", [], "2.13.0+cpu", None, False, 0)
    assert not ok and "make setup TORCH=cpu" in msg and "no NVIDIA GPU" in msg


def test_check_accepts_a_cuda_build_that_sees_its_gpu():
    assert check("auto", [H100], "2.13.0+cu128", "12.8", True, 1) == (
        True, "ok: torch 2.13.0+cu128, CUDA 12.8, 1 GPU: NVIDIA H100 80GB HBM3")
    ok, msg = check("cuda", [], "2.13.0", "12.8", True, 2, torch_gpus=["A", "B"])
    assert ok and msg.endswith("2 GPUs: A, B")


def test_check_refuses_a_cuda_build_whose_gpu_is_invisible_to_torch():
    ok, msg = check("auto", [H100], "2.13.0+cu130", "13.0", False, 0, driver="12.8")
    assert not ok
    assert "cannot see the NVIDIA GPU" in msg and H100 in msg and "driver" in msg
    assert "make setup TORCH=cu128" in msg and "make setup TORCH=cpu" in msg
    ok, msg = check("cuda", [H100], "2.13.0", "12.8", False, 0, driver="12.4")
    assert not ok and "update" in msg and "TORCH=cpu" in msg
    ok, msg = check("cuda", [H100], "2.13.0", "12.8", False, 0)
    assert not ok and "TORCH=cuXYZ" in msg


def test_check_refuses_a_cuda_build_without_a_gpu_when_cuda_was_asked():
    ok, msg = check("cuda", [], "2.13.0", "12.8", False, 0)
    assert not ok and "make setup TORCH=cpu" in msg
    ok, msg = check("cu128", [], "2.13.0+cu128", "12.8", False, 0)
    assert not ok and "make setup TORCH=cpu" in msg


def test_check_refuses_a_cuda_build_for_another_version_than_asked():
    ok, msg = check("cu126", [H100], "2.13.0+cu128", "12.8", True, 1)
    assert not ok
    assert "CUDA 12.8" in msg and "CUDA 12.6" in msg and "rm -rf .venv && make setup TORCH=cu126" in msg
    assert check("cu128", [H100], "2.13.0", "12.8", True, 1)[0]


@pytest.mark.parametrize("want", ["auto", "cpu"])
def test_check_accepts_a_cuda_build_without_a_gpu_with_a_note(want):
    ok, msg = check(want, [], "2.13.0+cu128", "12.8", False, 0)
    assert ok and msg.startswith("ok:") and "\n" not in msg
    assert "CPU wheel is smaller" in msg and "rm -rf .venv && make setup TORCH=cpu" in msg


def test_check_refuses_an_unknown_build_name():
    ok, msg = check("gpu", [], "2.13.0+cpu", None, False, 0)
    assert not ok and "auto, cpu, cuda or cuXYZ" in msg


# ---- GPU detection -----------------------------------------------------------------------------------------

def test_parse_nvidia_smi_list():
    text = (f"GPU 0: {H100} (UUID: GPU-5a7c)\nGPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-1)\n"
            "  MIG 1g.5gb     Device  0: (UUID: MIG-2)\nNo devices found\n")
    assert tb.parse_nvidia_smi_list(text) == [H100, "NVIDIA A100-SXM4-40GB"]
    assert tb.parse_nvidia_smi_list("No devices were found\n") == []


def _fake_smi(bin_dir: Path, body: str) -> Path:
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(0o755)
    return bin_dir


FAKE_SMI = textwrap.dedent(f"""\
    if [ "$1" = "-L" ]; then echo "GPU 0: {H100} (UUID: GPU-x)"; exit 0; fi
    echo "| NVIDIA-SMI 570.86.15   Driver Version: 570.86.15   CUDA Version: 12.8     |"
""")


def test_detect_gpus_reads_nvidia_smi_only(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(_fake_smi(tmp_path / "bin", FAKE_SMI)))
    assert tb.detect_gpus() == [H100]
    assert tb.driver_cuda() == "12.8"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi: no usable GPU, whatever /proc shows
    assert tb.detect_gpus() == []
    assert tb.driver_cuda() is None


def test_detect_gpus_gives_up_on_a_hung_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(_fake_smi(tmp_path / "bin", "sleep 5\n")))
    assert tb.detect_gpus(timeout=0.3) == []


# ---- the CLI as `make setup` runs it -------------------------------------------------------------------------

FAKE_TORCH = textwrap.dedent(f"""\
    import types
    __version__ = "2.13.0+cu128"
    version = types.SimpleNamespace(cuda="12.8")
    cuda = types.SimpleNamespace(is_available=lambda: AVAILABLE, device_count=lambda: 1,
                                 get_device_name=lambda i: "{H100}")
""")


def _cli(tmp_path: Path, *args: str, fake_torch: bool | None = None, **env: str) -> subprocess.CompletedProcess:
    """`python -m masgraph.torch_build ARGS` with a fake nvidia-smi (one H100) first on PATH and, if asked, a fake
    CUDA torch (is_available() = fake_torch) first on PYTHONPATH."""
    full = {k: v for k, v in os.environ.items() if k not in ("TORCH", "PYTHONPATH")}
    full["PATH"] = f"{_fake_smi(tmp_path / 'bin', FAKE_SMI)}{os.pathsep}{full.get('PATH', '')}"
    if fake_torch is not None:
        (tmp_path / "fake" / "torch").mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / "torch" / "__init__.py").write_text(f"AVAILABLE = {fake_torch}\n" + FAKE_TORCH)
        full["PYTHONPATH"] = str(tmp_path / "fake")
    full.update(env)
    return subprocess.run([sys.executable, "-m", "masgraph.torch_build", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(not CPU_BUILD, reason="needs the venv's torch to be the CPU build")
def test_cli_check_refuses_the_cpu_build_under_a_gpu_and_accepts_it_when_cpu_is_asked(tmp_path):
    out = _cli(tmp_path, "check")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("error: torch 2.13.0+cpu is the CPU build") and H100 in out.stderr
    assert "make setup TORCH=cpu" in out.stderr and "Traceback" not in out.stderr
    out = _cli(tmp_path, "check", "--want", "cpu")
    assert out.returncode == 0 and out.stdout.startswith("ok: torch 2.13.0+cpu"), out.stderr
    out = _cli(tmp_path, "check", TORCH="cpu")  # $TORCH is the default for --want
    assert out.returncode == 0, out.stderr


def test_cli_check_accepts_a_cuda_torch_that_sees_the_gpu(tmp_path):
    out = _cli(tmp_path, "check", fake_torch=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ok: torch 2.13.0+cu128, CUDA 12.8, 1 GPU: {H100}"


def test_cli_check_refuses_a_cuda_torch_that_cannot_see_the_gpu(tmp_path):
    out = _cli(tmp_path, "check", "--want", "cuda", fake_torch=False)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("error: torch 2.13.0+cu128 (CUDA 12.8) cannot see the NVIDIA GPU")
    assert "make setup TORCH=cu128" in out.stderr and "TORCH=cpu" in out.stderr  # the fake driver says CUDA 12.8


def test_cli_check_without_torch_is_one_error_line(tmp_path):
    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    out = _cli(tmp_path, "check", PYTHONPATH=str(tmp_path / "fake"))
    assert out.returncode == 1 and out.stderr.startswith("error: torch does not import")
    assert "make setup" in out.stderr and "Traceback" not in out.stderr


def test_module_imports_only_the_standard_library():
    code = ("import sys; import masgraph.torch_build; "
            "bad = [m for m in ('torch', 'pydantic', 'yaml') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(("torch_var", "want"), [(None, "auto"), ("cu128", "cu128")])
def test_makefile_setup_installs_and_checks_torch_through_torch_build(tmp_path, torch_var, want):
    env = {k: v for k, v in os.environ.items() if k != "TORCH"}
    args = ["make", "-n", "-B", "-C", str(ROOT), "setup", f"VENV={tmp_path}/v"]
    out = subprocess.run(args + ([f"TORCH={torch_var}"] if torch_var else []), env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    py = f"{tmp_path}/v/bin/python"
    lines = out.stdout.splitlines()
    install = lines.index(f"{py} -m masgraph.torch_build install --want {want}")
    check_at = lines.index(f"{py} -m masgraph.torch_build check --want {want}")
    assert install < next(i for i, line in enumerate(lines) if "-r requirements.txt" in line) < check_at
    assert not any("torch==" in line for line in lines)
