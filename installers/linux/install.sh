#!/usr/bin/env bash
# Install MoE Desk for the current user, without root (Linux, and WSL through WSLg).
#
#   installers/linux/install.sh              # install, or upgrade in place (models, chats and settings stay)
#   installers/linux/install.sh --dry-run    # say what would be installed, change nothing
#
# What it installs (nothing outside the home folder):
#   ~/.local/share/moedesk/                   the program: a private Python environment with PyTorch, the app
#                                             and uninstall.sh
#   ~/.local/bin/moedesk                      the launcher
#   ~/.local/share/applications/moedesk.desktop and ~/.local/share/icons/hicolor/*/apps/moedesk.*
#                                             the menu entry and its icon
# PyTorch: the CUDA build when an NVIDIA driver answers (nvidia-smi) and the GPU can run MoE Desk's kernels,
# the CPU build otherwise. The user's data is never touched: chats in ~/.local/share/MoE Desk/, settings in
# ~/.config/MoE Desk/, models in the Hugging Face cache and the folders the user chose.
#
# Options:
#   --cpu | --cuda        force the CPU or the CUDA build of PyTorch
#   --source DIR          the MoE Desk source tree to install (default: the checkout this script is in)
#   --windows-shortcut    under WSL: also add a Windows Start-menu shortcut that starts the Linux app
#   --dry-run             print the plan and exit
# Environment (for packagers and tests):
#   MOEDESK_PYTHON             the Python to build the environment from (3.10-3.13; default: the first of
#                              python3.12, 3.11, 3.13, 3.10, python3 that runs)
#   MOEDESK_TORCH_SPEC         the PyTorch requirement (default: torch>=2.4)
#   MOEDESK_TORCH_INDEX_URL    where PyTorch comes from (default: download.pytorch.org's index for the chosen
#                              build; set but empty: pip's own configuration)
#   MOEDESK_INSTALL_DIR        the program folder (default: ${XDG_DATA_HOME:-~/.local/share}/moedesk)
#   MOEDESK_BIN_DIR            the launcher's folder (default: ~/.local/bin)
if [ -z "${BASH_VERSION:-}" ]; then exec bash "$0" "$@"; fi  # started as `sh install.sh`: this is a bash script
set -euo pipefail

APP_ID=moedesk
APP_NAME="MoE Desk"
MARKER=.moedesk-install  # in the program folder: uninstall.sh removes a folder only if this file is there
ICON_SIZES=(16 24 32 48 64 128 256 512)
MIN_COMPUTE_CAPABILITY=7.5  # engine/runtime/placement.py: the GPU kernels need Turing (RTX 20 series) or newer
TORCH_INDEX=https://download.pytorch.org/whl

say() { printf '%s\n' "$*"; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source_dir=$(cd "$script_dir/../.." && pwd)
force=""
dry_run=0
windows_shortcut=0
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) force=cpu ;;
        --cuda) force=cuda ;;
        --source) [ $# -ge 2 ] || die "--source needs a folder"; source_dir=$(cd "$2" && pwd); shift ;;
        --source=*) source_dir=$(cd "${1#--source=}" && pwd) ;;
        --windows-shortcut) windows_shortcut=1 ;;
        --dry-run) dry_run=1 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done

[ -f "$source_dir/pyproject.toml" ] && [ -d "$source_dir/app" ] && [ -d "$source_dir/engine" ] \
    || die "$source_dir is not a MoE Desk source tree (no pyproject.toml, app/ and engine/)"
[ -n "${HOME:-}" ] && [ -d "$HOME" ] || die "HOME is not set to a folder"

data_home=${XDG_DATA_HOME:-$HOME/.local/share}
install_dir=${MOEDESK_INSTALL_DIR:-$data_home/$APP_ID}
bin_dir=${MOEDESK_BIN_DIR:-$HOME/.local/bin}
venv="$install_dir/venv"
launcher="$bin_dir/$APP_ID"
desktop_file="$data_home/applications/$APP_ID.desktop"
icon_theme="$data_home/icons/hicolor"
manifest="$install_dir/installed-files.txt"

# --- Python -----------------------------------------------------------------------------------------------
python_ok() {  # a Python that MoE Desk supports (pyproject.toml: >=3.10,<3.14)
    "$1" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] < (3, 14) else 1)' >/dev/null 2>&1
}

find_python() {
    if [ -n "${MOEDESK_PYTHON:-}" ]; then
        python_ok "$MOEDESK_PYTHON" || die "MOEDESK_PYTHON=$MOEDESK_PYTHON is not Python 3.10-3.13"
        command -v "$MOEDESK_PYTHON"
        return
    fi
    local candidate
    for candidate in python3.12 python3.11 python3.13 python3.10 python3; do
        if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
            command -v "$candidate"
            return
        fi
    done
    die "no Python 3.10-3.13 found. Install one with your package manager (Debian/Ubuntu: sudo apt install python3 python3-venv; Fedora: sudo dnf install python3) and run this again"
}

# --- which PyTorch ----------------------------------------------------------------------------------------
nvidia_smi() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi "$@"
    elif [ -x /usr/lib/wsl/lib/nvidia-smi ]; then  # WSL: the Windows driver's tools
        /usr/lib/wsl/lib/nvidia-smi "$@"
    else
        return 127
    fi
}

version_at_least() {  # version_at_least 12.4 12.0: true when $1 >= $2 (dotted numbers)
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -t. -k1,1n -k2,2n | head -n 1)" = "$2" ]
}

# sets torch_variant (cpu | cu126 | cu128) and torch_why
choose_torch() {
    torch_variant=cpu
    local summary capability name driver_cuda
    if [ "$force" = cpu ]; then
        torch_why="the CPU build was asked for (--cpu)"
        return
    fi
    if ! summary=$(nvidia_smi 2>/dev/null); then
        if [ "$force" = cuda ]; then
            torch_variant=cu128
            torch_why="the CUDA build was asked for (--cuda), though nvidia-smi did not answer"
        else
            torch_why="no NVIDIA driver answered (nvidia-smi); install the NVIDIA driver and run this installer again to get the GPU build"
        fi
        return
    fi
    driver_cuda=$(printf '%s\n' "$summary" | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1)
    capability=$(nvidia_smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | sort -t. -k1,1n -k2,2n | tail -n 1 | tr -d ' \r')
    name=$(nvidia_smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '\r')
    name=${name:-an NVIDIA GPU}
    if [ "$force" != cuda ] && [[ "$capability" =~ ^[0-9]+\.[0-9]+$ ]] && ! version_at_least "$capability" "$MIN_COMPUTE_CAPABILITY"; then
        torch_why="$name is compute capability $capability; MoE Desk's GPU kernels need $MIN_COMPUTE_CAPABILITY (RTX 20 series) or newer"
        return
    fi
    if [ "$force" != cuda ] && [ -n "$driver_cuda" ] && ! version_at_least "$driver_cuda" 12.0; then
        torch_why="the NVIDIA driver supports CUDA $driver_cuda; PyTorch's GPU builds need CUDA 12 (driver 525 or newer): update the driver and run this installer again"
        return
    fi
    if [ -z "$driver_cuda" ] || version_at_least "$driver_cuda" 12.8; then
        torch_variant=cu128
    else
        torch_variant=cu126  # drivers older than CUDA 12.8 (570): the CUDA 12.6 build
    fi
    torch_why="$name${driver_cuda:+, driver for CUDA $driver_cuda}"
}

# --- helpers ----------------------------------------------------------------------------------------------
sh_quote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }

desktop_exec_arg() {  # a path as one argument of a desktop entry's Exec key (quoted when it needs to be)
    local path=$1
    if [[ "$path" =~ ^[A-Za-z0-9._/+-]+$ ]]; then
        printf '%s' "$path"
        return
    fi
    path=${path//\\/\\\\}; path=${path//\"/\\\"}; path=${path//\`/\\\`}; path=${path//\$/\\\$}
    path=${path//\\/\\\\}  # the value is itself a string whose backslashes are escaped
    path=${path//%/%%}
    printf '"%s"' "$path"
}

is_wsl() { grep -qi microsoft /proc/version 2>/dev/null; }

ensure_venv() {  # a private environment with pip; an existing healthy one is kept (upgrade in place)
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -m pip --version >/dev/null 2>&1 && python_ok "$venv/bin/python"; then
        say "Using the existing environment $venv"
        return
    fi
    rm -rf "$venv"
    say "Creating a private Python environment in $venv (from $python)"
    if "$python" -m venv "$venv" >/dev/null 2>&1; then
        return
    fi
    # Debian and Ubuntu ship Python without ensurepip unless python3-venv is installed: make the environment
    # without pip, then bring pip in from its wheel on PyPI
    rm -rf "$venv"
    "$python" -m venv --without-pip "$venv" \
        || die "$python cannot create a virtual environment (Debian/Ubuntu: sudo apt install python3-venv)"
    say "This Python has no ensurepip: fetching pip from PyPI"
    "$venv/bin/python" - <<'PY' || die "could not install pip into the environment (Debian/Ubuntu: sudo apt install python3-venv, then run this again)"
import json, os, subprocess, sys, tempfile, urllib.parse, urllib.request

API = "https://pypi.org/pypi/pip/json"
with urllib.request.urlopen(API, timeout=60) as answer:
    release = json.load(answer)
wheel = next(f for f in release["urls"] if f["packagetype"] == "bdist_wheel")
with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, wheel["filename"])
    urllib.request.urlretrieve(urllib.parse.urljoin(API, wheel["url"]), path)  # a mirror may answer relative URLs
    # a wheel is importable: pip installs itself from its own wheel
    sys.exit(subprocess.call([sys.executable, os.path.join(path, "pip"), "install", "--quiet", "--no-index", path]))
PY
}

torch_build_of_venv() {  # cpu | cuda | none, for the PyTorch already in the environment
    "$venv/bin/python" -I -c 'import torch; print("cuda" if torch.version.cuda else "cpu")' 2>/dev/null || echo none
}

pip_install() { "$venv/bin/python" -m pip install --disable-pip-version-check "$@"; }

check_free_space() {  # PyTorch's CUDA build takes about 5 GB in the environment, the CPU build under 1 GB
    local need_gb=2 free_kb
    [ "$torch_variant" = cpu ] || need_gb=7
    free_kb=$(df -Pk "$install_dir" 2>/dev/null | awk 'NR == 2 {print $4}')
    if [[ "$free_kb" =~ ^[0-9]+$ ]] && [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
        warn "only $((free_kb / 1024)) MiB free where $install_dir is; the installation needs about $need_gb GB"
    fi
}

install_torch() {
    local spec=${MOEDESK_TORCH_SPEC:-torch>=2.4} have want index_args=()
    if [ -n "${MOEDESK_TORCH_INDEX_URL+set}" ]; then
        [ -n "$MOEDESK_TORCH_INDEX_URL" ] && index_args=(--index-url "$MOEDESK_TORCH_INDEX_URL")
    else
        index_args=(--index-url "$TORCH_INDEX/$torch_variant")
    fi
    have=$(torch_build_of_venv)
    want=cuda; [ "$torch_variant" = cpu ] && want=cpu
    if [ "$have" != none ] && [ "$have" != "$want" ] && [ -z "${MOEDESK_TORCH_INDEX_URL+set}" ]; then
        say "Replacing the $have build of PyTorch with the $want build"
        "$venv/bin/python" -m pip uninstall --yes --quiet torch
    fi
    say "Installing PyTorch ($spec${index_args[1]:+ from ${index_args[1]}}); the CUDA build is a few GB and takes a while"
    pip_install ${index_args[@]+"${index_args[@]}"} "$spec"
}

install_app() {  # from a clean copy of the source tree, so the build leaves nothing in it
    local stage item
    stage=$(mktemp -d)
    # shellcheck disable=SC2064  # expand now: the folder is known now
    trap "rm -rf '$stage'" EXIT
    mkdir "$stage/src"
    for item in pyproject.toml README.md LICENSE app engine resources; do
        [ -e "$source_dir/$item" ] && cp -R "$source_dir/$item" "$stage/src/"
    done
    find "$stage/src" -name __pycache__ -type d -prune -exec rm -rf {} +
    say "Installing MoE Desk from $source_dir"
    pip_install --upgrade --upgrade-strategy only-if-needed "$stage/src[app]"
    rm -rf "$stage"
    trap - EXIT
}

check_qt_libraries() {  # the X11 platform plugin's system libraries, which pip cannot install
    local plugin missing
    plugin=$("$venv/bin/python" -I -c 'import os, PySide6; print(os.path.join(os.path.dirname(PySide6.__file__), "Qt", "plugins", "platforms", "libqxcb.so"))' 2>/dev/null) || return 0
    [ -f "$plugin" ] && command -v ldd >/dev/null 2>&1 || return 0
    missing=$(ldd "$plugin" 2>/dev/null | awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')
    [ -z "$missing" ] && return 0
    warn "the desktop (X11) needs system libraries that are missing: $missing"
    warn "on Debian/Ubuntu they come with: sudo apt install libxcb-cursor0 libxkbcommon-x11-0 libxcb-icccm4 libxcb-keysyms1 libxcb-shape0 libegl1 libgl1 libfontconfig1 libdbus-1-3"
}

write_launcher() {
    mkdir -p "$bin_dir"
    {
        printf '#!/bin/sh\n'
        printf '# %s launcher, written by installers/linux/install.sh; remove with %s\n' "$APP_NAME" "$install_dir/uninstall.sh"
        printf 'exec %s "$@"\n' "$(sh_quote "$venv/bin/$APP_ID")"  # the entry point: the folder it runs in plays no part
    } >"$launcher.tmp"
    chmod 755 "$launcher.tmp"
    mv -f "$launcher.tmp" "$launcher"
}

install_icons() {
    local size
    for size in "${ICON_SIZES[@]}"; do
        mkdir -p "$icon_theme/${size}x${size}/apps"
        cp "$source_dir/resources/icons/$APP_ID-$size.png" "$icon_theme/${size}x${size}/apps/$APP_ID.png"
        printf '%s\n' "$icon_theme/${size}x${size}/apps/$APP_ID.png" >>"$manifest"
    done
    mkdir -p "$icon_theme/scalable/apps"
    cp "$source_dir/resources/icons/$APP_ID.svg" "$icon_theme/scalable/apps/$APP_ID.svg"
    printf '%s\n' "$icon_theme/scalable/apps/$APP_ID.svg" >>"$manifest"
    touch "$icon_theme"  # desktops notice new icons by the theme folder's time
    if [ -f "$icon_theme/icon-theme.cache" ] && command -v gtk-update-icon-cache >/dev/null 2>&1; then
        gtk-update-icon-cache --quiet "$icon_theme" || true
    fi
}

write_desktop_entry() {
    local exec_arg
    exec_arg=$(desktop_exec_arg "$launcher")
    mkdir -p "$(dirname "$desktop_file")"
    cat >"$desktop_file.tmp" <<EOF
[Desktop Entry]
Type=Application
Version=1.4
Name=$APP_NAME
GenericName=AI chat
Comment=Chat with mixture-of-experts language models on your own computer
Exec=$exec_arg
TryExec=${launcher//\\/\\\\}
Icon=$APP_ID
Terminal=false
Categories=Utility;
Keywords=AI;LLM;chat;MoE;Qwen;
StartupNotify=true
StartupWMClass=$APP_ID
EOF
    mv -f "$desktop_file.tmp" "$desktop_file"
    printf '%s\n' "$desktop_file" >>"$manifest"
}

windows_shortcut_helper() {  # under WSL: the Windows side makes a Start-menu shortcut that runs the launcher
    local helper="$source_dir/installers/windows/wsl-shortcut.ps1"
    if ! command -v powershell.exe >/dev/null 2>&1 || ! command -v wslpath >/dev/null 2>&1; then
        warn "powershell.exe is not reachable from WSL: no Windows shortcut made"
        return 0
    fi
    local distro=()
    [ -n "${WSL_DISTRO_NAME:-}" ] && distro=(-Distro "$WSL_DISTRO_NAME")
    powershell.exe -NoProfile -ExecutionPolicy Bypass -File "$(wslpath -w "$helper")" \
        ${distro[@]+"${distro[@]}"} -LauncherPath "$launcher" \
        || warn "the Windows shortcut could not be made"
}

# --- the plan ---------------------------------------------------------------------------------------------
python=$(find_python)
choose_torch
if [ -n "${MOEDESK_TORCH_INDEX_URL+set}" ]; then
    torch_from=${MOEDESK_TORCH_INDEX_URL:-pip\'s configured index}
else
    torch_from="$TORCH_INDEX/$torch_variant"
fi
say "$APP_NAME installer"
say "  source:    $source_dir"
say "  python:    $python ($("$python" -c 'import platform; print(platform.python_version())'))"
say "  pytorch:   ${MOEDESK_TORCH_SPEC:-torch>=2.4}, $torch_variant build from $torch_from"
say "             ($torch_why)"
say "  program:   $install_dir"
say "  launcher:  $launcher"
say "  menu:      $desktop_file"
if [ "$dry_run" = 1 ]; then
    exit 0
fi

mkdir -p "$install_dir"
[ -z "$(ls -A "$install_dir")" ] || [ -f "$install_dir/$MARKER" ] \
    || die "$install_dir exists and was not made by this installer: set MOEDESK_INSTALL_DIR to another folder"
touch "$install_dir/$MARKER"
check_free_space
ensure_venv
install_torch
install_app
# -I: the installed app, never an app/ folder in the current directory (such as the checkout's)
"$venv/bin/python" -I -W ignore -c 'import app.about, engine, PySide6.QtWidgets' \
    || die "the installed app does not import; see the messages above"
check_qt_libraries

: >"$manifest"
write_launcher
printf '%s\n' "$launcher" >>"$manifest"
install_icons
write_desktop_entry
cp "$script_dir/uninstall.sh" "$install_dir/uninstall.sh"
chmod 755 "$install_dir/uninstall.sh"
if [ -f "$source_dir/installers/windows/wsl-shortcut.ps1" ]; then  # what uninstall.sh --windows-shortcut runs
    cp "$source_dir/installers/windows/wsl-shortcut.ps1" "$install_dir/"
fi
if [ "$windows_shortcut" = 1 ]; then
    if is_wsl; then windows_shortcut_helper; else warn "--windows-shortcut is for WSL; ignored"; fi
fi

version=$("$venv/bin/python" -I -W ignore -c 'from app.about import app_version; print(app_version())')
say ""
say "$APP_NAME $version is installed. Start it from the applications menu, or run: $launcher"
case ":$PATH:" in
    *":$bin_dir:"*) ;;
    *) say "($bin_dir is not on your PATH yet: it usually is after logging in again)" ;;
esac
if is_wsl && [ "$windows_shortcut" = 0 ]; then
    say "WSL: to start it from the Windows Start menu too, run this again with --windows-shortcut"
fi
say "Uninstall: $install_dir/uninstall.sh (your models, chats and settings stay)"
