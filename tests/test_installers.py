"""The installers: shellcheck on every shell script, the Linux installer's choice of PyTorch build, and a whole
install -> smoke test -> upgrade -> uninstall cycle of installers/linux/install.sh into a temporary home.

The cycle installs from a local wheelhouse, offline: .ci/run makes it up front with
`python3 tools/installer_wheelhouse.py` (.whl/installer). Without it the cycle is skipped on a developer's
machine and fails under CI (CI=true), like a missing shellcheck or desktop-file-validate.
The Windows scripts cannot run here (no Windows, no PowerShell): they get static checks of what they promise.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINUX = ROOT / "installers" / "linux"
WINDOWS = ROOT / "installers" / "windows"
WHEELHOUSE = Path(os.environ.get("MOEDESK_WHEELHOUSE", ROOT / ".whl" / "installer"))
TORCH_SPEC = "torch==2.13.0"  # the CPU wheel the development and CI machines hold (tools/installer_wheelhouse.py)
USER_DATA = (".local/share/MoE Desk", ".config/MoE Desk")  # chats, downloaded models; settings (QSettings)


def missing(what: str) -> None:
    """CI must have every tool (.ci/run installs them); a developer's machine may skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI=true: .ci/run should have provided it)")
    pytest.skip(what)


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        missing(f"{name} is not installed")
    return found


def shell_scripts() -> list[Path]:
    return sorted(ROOT.glob("installers/**/*.sh")) + [ROOT / ".ci" / "run"]


def test_shell_scripts_pass_shellcheck():
    shellcheck = tool("shellcheck")
    scripts = shell_scripts()
    assert LINUX / "install.sh" in scripts and LINUX / "uninstall.sh" in scripts
    result = subprocess.run([shellcheck, "--shell=bash", *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def base_python() -> str:
    """The interpreter this test's venv was made from: the one tools/installer_wheelhouse.py downloaded for."""
    for name in (f"python{sys.version_info[0]}.{sys.version_info[1]}", "python3"):
        candidate = Path(sys.base_prefix) / "bin" / name
        if candidate.exists():
            return str(candidate)
    return sys.executable


def clean_env(home: Path, **extra: str) -> dict:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("XDG_", "PIP_", "MOEDESK_", "PYTHON", "VIRTUAL_ENV", "QT_"))
    }
    real_home = Path(os.environ.get("HOME", "~")).expanduser()
    for key, folder in (("RUSTUP_HOME", ".rustup"), ("CARGO_HOME", ".cargo")):  # this machine's shims, not ours
        if key not in env and (real_home / folder).is_dir():
            env[key] = str(real_home / folder)
    return {**env, "HOME": str(home), "MOEDESK_PYTHON": base_python(), **extra}


FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=compute_cap) echo "{cap}" ;;
  --query-gpu=name) echo "{name}" ;;
  *) echo "| NVIDIA-SMI 999.99   Driver Version: 999.99   CUDA Version: {cuda}     |" ;;
esac
exit {code}
"""


@pytest.mark.parametrize(
    "cuda, cap, code, args, variant, why",
    [
        ("12.8", "8.6", 0, [], "cu128", "NVIDIA GeForce RTX 3060, driver for CUDA 12.8"),
        ("13.0", "12.0", 0, [], "cu128", "driver for CUDA 13.0"),
        ("12.4", "7.5", 0, [], "cu126", "driver for CUDA 12.4"),
        ("12.8", "6.1", 0, [], "cpu", "compute capability 6.1; MoE Desk's GPU kernels need 7.5"),
        ("11.8", "8.6", 0, [], "cpu", "supports CUDA 11.8; PyTorch's GPU builds need CUDA 12"),
        ("12.8", "8.6", 9, [], "cpu", "no NVIDIA driver answered"),
        ("12.8", "8.6", 0, ["--cpu"], "cpu", "asked for (--cpu)"),
    ],
)
def test_installer_picks_the_pytorch_build(tmp_path, cuda, cap, code, args, variant, why):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    smi = fake_bin / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI.format(cuda=cuda, cap=cap, code=code, name="NVIDIA GeForce RTX 3060"))
    smi.chmod(0o755)
    env = clean_env(tmp_path / "home")
    env["PATH"] = f"{fake_bin}{os.pathsep}{env['PATH']}"
    (tmp_path / "home").mkdir()
    result = subprocess.run(
        ["bash", str(LINUX / "install.sh"), "--dry-run", *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert f"{variant} build from https://download.pytorch.org/whl/{variant}" in result.stdout
    assert why in result.stdout
    assert not any((tmp_path / "home").iterdir()), "a dry run wrote into the home folder"


def test_installer_takes_the_torch_pin_from_the_environment(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(home, MOEDESK_TORCH_SPEC="torch==9.9.9", MOEDESK_TORCH_INDEX_URL="")
    result = subprocess.run(
        ["bash", str(LINUX / "install.sh"), "--dry-run"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "torch==9.9.9" in result.stdout and "pip's configured index" in result.stdout


def files_under(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file() or path.is_symlink()}


def run_logged(command: list[str], env: dict, cwd: Path, timeout: int) -> tuple[float, str]:
    """(seconds, stdout) of a command that must succeed; on failure the assertion shows the end of its output."""
    start = time.monotonic()
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    return time.monotonic() - start, result.stdout


def test_install_smoke_upgrade_uninstall(tmp_path):
    """install.sh into a temporary HOME, offline from the wheelhouse; the menu entry validates, the installed
    launcher passes the app's smoke test, a second run upgrades in place and keeps user data, uninstall.sh
    leaves nothing but user data."""
    validate = tool("desktop-file-validate")
    if not any(WHEELHOUSE.glob("torch-*.whl")):
        missing(f"no installer wheelhouse at {WHEELHOUSE}: run python3 tools/installer_wheelhouse.py")
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(
        home,
        MOEDESK_TORCH_SPEC=TORCH_SPEC,
        MOEDESK_TORCH_INDEX_URL="",
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(WHEELHOUSE),
        PIP_CACHE_DIR=str(tmp_path / "pip-cache"),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    work = tmp_path / "cwd"  # not the checkout: nothing may import the source tree's app/ by accident
    work.mkdir()
    install = ["bash", str(LINUX / "install.sh")]

    took, _ = run_logged(install, env, work, timeout=1200)
    launcher = home / ".local" / "bin" / "moedesk"
    desktop = home / ".local" / "share" / "applications" / "moedesk.desktop"
    program = home / ".local" / "share" / "moedesk"
    assert launcher.is_file() and os.access(launcher, os.X_OK)
    entry = desktop.read_text()
    assert f"Exec={launcher}" in entry and "Icon=moedesk" in entry
    result = subprocess.run([validate, str(desktop)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr
    for size in (16, 32, 48, 64, 128, 256, 512):
        assert (home / f".local/share/icons/hicolor/{size}x{size}/apps/moedesk.png").is_file()
    assert (home / ".local/share/icons/hicolor/scalable/apps/moedesk.svg").is_file()
    assert (program / "uninstall.sh").is_file()

    # the installed app, not the checkout: its own copy of the package and of the demo model
    site = subprocess.run(
        [
            str(program / "venv" / "bin" / "python"),
            "-I",
            "-W",
            "ignore",
            "-c",
            "import app, engine.resources as r; print(app.__file__); print(r.DEMO_MODEL)",
        ],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(str(program) in path for path in site), site

    shot = tmp_path / "smoke.png"
    smoke_env = {**env, "QT_QPA_PLATFORM": "offscreen"}
    took_smoke, _ = run_logged([str(launcher), "--smoke-test", str(shot)], smoke_env, work, timeout=600)
    assert shot.is_file() and shot.stat().st_size > 0

    # the smoke test chats on a scratch store: the user's history is never touched by it
    chats = home / ".local" / "share" / "MoE Desk" / "MoE Desk"
    assert not (chats / "conversations.sqlite3").exists(), "the smoke test wrote into the user's chat history"
    # user data made between the runs: kept by an upgrade and by the uninstaller
    chats.mkdir(parents=True, exist_ok=True)
    (chats / "keep-me.txt").write_text("user data")
    (home / ".local/share/MoE Desk/models/my-model").mkdir(parents=True)
    (home / ".local/share/MoE Desk/models/my-model/weights.bin").write_bytes(b"\0" * 16)
    user_files = files_under(home / ".local/share/MoE Desk") | files_under(home / ".config/MoE Desk")

    took_upgrade, said = run_logged(install, env, work, timeout=1200)
    assert "Using the existing environment" in said
    assert (chats / "keep-me.txt").read_text() == "user data"
    assert user_files <= files_under(home / ".local/share/MoE Desk") | files_under(home / ".config/MoE Desk")
    assert launcher.is_file()

    took_uninstall, _ = run_logged(["bash", str(program / "uninstall.sh")], env, work, timeout=300)
    left = files_under(home)
    kept = {path for path in left if path.startswith(USER_DATA)}
    assert left == kept, f"uninstall.sh left these behind: {sorted(left - kept)}"
    assert {".local/share/MoE Desk/MoE Desk/keep-me.txt", ".local/share/MoE Desk/models/my-model/weights.bin"} <= kept
    assert not program.exists() and not launcher.exists() and not desktop.exists()
    print(
        f"installer cycle: install {took:.0f} s, smoke test {took_smoke:.0f} s, upgrade {took_upgrade:.0f} s, "
        f"uninstall {took_uninstall:.0f} s"
    )


def test_icons_are_up_to_date():
    """resources/icons/*.png and moedesk.ico are what tools/make_icons.py renders from moedesk.svg."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_icons.py"), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "QT_QPA_PLATFORM": "offscreen"},
    )
    assert result.returncode == 0, result.stderr
    ico = (ROOT / "resources" / "icons" / "moedesk.ico").read_bytes()
    reserved, kind, count = struct.unpack_from("<HHH", ico)
    assert (reserved, kind) == (0, 1)
    sides = sorted(struct.unpack_from("<B", ico, 6 + 16 * i)[0] or 256 for i in range(count))
    assert sides == [16, 24, 32, 48, 64, 128, 256]
    for i in range(count):  # each entry points at a whole PNG inside the file
        size, offset = struct.unpack_from("<II", ico, 6 + 16 * i + 8)
        assert ico[offset : offset + 8] == b"\x89PNG\r\n\x1a\n" and offset + size <= len(ico)


def test_wheel_carries_the_resources():
    """engine/resources.py finds resources/ beside engine/: an installed wheel must carry it there."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '"resources"' in text and 'resources = ["**/*"]' in text


def syntax_errors(node, found: list) -> list:
    if node.type == "ERROR" or node.is_missing:
        found.append(f"line {node.start_point[0] + 1}: {node.text[:60]!r}")
    for child in node.children:
        syntax_errors(child, found)
    return found


@pytest.mark.parametrize("script", ["install.ps1", "uninstall.ps1", "wsl-shortcut.ps1"])
def test_powershell_scripts_parse(script):
    """A syntax check by tree-sitter's PowerShell grammar: not PowerShell itself, which nothing here runs."""
    try:
        import tree_sitter
        import tree_sitter_powershell
    except ImportError:
        missing("tree-sitter and tree-sitter-powershell are not installed (the test extra has them)")
    parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_powershell.language()))
    tree = parser.parse((WINDOWS / script).read_bytes())
    assert not tree.root_node.has_error, syntax_errors(tree.root_node, [])
    broken = parser.parse((WINDOWS / script).read_bytes().replace(b"}", b"", 1))
    assert broken.root_node.has_error  # the check can fail


def test_windows_scripts_promise_what_the_readme_says():
    """Static checks only: nothing here runs PowerShell or Inno Setup (installers/windows/README.md says so)."""
    install = (WINDOWS / "install.ps1").read_text(encoding="utf-8")
    uninstall = (WINDOWS / "uninstall.ps1").read_text(encoding="utf-8")
    wsl = (WINDOWS / "wsl-shortcut.ps1").read_text(encoding="utf-8")
    iss = (WINDOWS / "moedesk.iss").read_text(encoding="utf-8")
    readme = (WINDOWS / "README.md").read_text(encoding="utf-8")
    for needle in (
        "py.exe",
        "-3.12",
        "nvidia-smi",
        "download.pytorch.org/whl",
        "triton-windows",
        "pythonw.exe",
        "CreateShortcut",
        "Programs",
        "Desktop",
        "python-embed",
        "MOEDESK_TORCH_SPEC",
    ):
        assert needle in install, needle
    assert "CreateShortcut" in wsl and "wsl" in wsl.lower()
    assert "Remove-Item" in uninstall and "MoE Desk" in uninstall
    for needle in ("PrivilegesRequired=lowest", "install.ps1", "uninstall.ps1", "moedesk.ico"):
        assert needle in iss, needle
    assert "None of these scripts was run on a real Windows machine" in readme
    version = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith("version"))
    assert f'#define AppVersion "{version.split(chr(34))[1]}"' in iss
