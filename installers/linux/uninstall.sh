#!/usr/bin/env bash
# Remove MoE Desk as installers/linux/install.sh installed it: the program folder (its private Python
# environment), the launcher, the menu entry and the icons.
#
#   ~/.local/share/moedesk/uninstall.sh     (install.sh puts a copy there)
#
# Kept: the user's data, namely chats (~/.local/share/MoE Desk/), settings (~/.config/MoE Desk/), and models
# (the Hugging Face cache and any folder the user chose). Delete those by hand to remove them too.
# Options: --windows-shortcut (under WSL: also remove the Windows shortcut that install.sh made)
# Environment: MOEDESK_INSTALL_DIR and MOEDESK_BIN_DIR, as given to install.sh.
if [ -z "${BASH_VERSION:-}" ]; then exec bash "$0" "$@"; fi  # started as `sh uninstall.sh`: this is a bash script
set -euo pipefail

APP_ID=moedesk
MARKER=.moedesk-install

say() { printf '%s\n' "$*"; }
warn() { printf 'warning: %s\n' "$*" >&2; }

windows_shortcut=0
for arg in "$@"; do
    case "$arg" in
        --windows-shortcut) windows_shortcut=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) printf 'error: unknown option %s\n' "$arg" >&2; exit 2 ;;
    esac
done

[ -n "${HOME:-}" ] || { printf 'error: HOME is not set\n' >&2; exit 1; }
data_home=${XDG_DATA_HOME:-$HOME/.local/share}
install_dir=${MOEDESK_INSTALL_DIR:-$data_home/$APP_ID}
bin_dir=${MOEDESK_BIN_DIR:-$HOME/.local/bin}
icon_theme="$data_home/icons/hicolor"

remove_file() {
    if [ -e "$1" ] || [ -L "$1" ]; then
        rm -f "$1" && say "removed $1"
    fi
}

remove_empty_dirs() {  # the icon size folders and the like, when nothing else is in them
    local dir
    for dir in "$@"; do
        [ -d "$dir" ] && rmdir "$dir" 2>/dev/null || true
    done
}

# the files install.sh listed, then the usual places (an older or interrupted install may have no list)
files=()
if [ -f "$install_dir/installed-files.txt" ]; then
    while IFS= read -r line; do
        [ -n "$line" ] && files+=("$line")
    done <"$install_dir/installed-files.txt"
fi
files+=("$bin_dir/$APP_ID" "$data_home/applications/$APP_ID.desktop" "$icon_theme/scalable/apps/$APP_ID.svg")
for size in 16 24 32 48 64 128 256 512; do
    files+=("$icon_theme/${size}x${size}/apps/$APP_ID.png")
done
for file in "${files[@]}"; do
    case "$file" in
        */"$APP_ID"|*/"$APP_ID".desktop|*/"$APP_ID".png|*/"$APP_ID".svg) remove_file "$file" ;;
        *) warn "not removing $file: not one of MoE Desk's file names" ;;
    esac
done
for file in "${files[@]}"; do
    case "$file" in
        "$icon_theme"/*) remove_empty_dirs "$(dirname "$file")" "$(dirname "$(dirname "$file")")" ;;
    esac
done
if [ -d "$icon_theme" ]; then
    touch "$icon_theme"
    if [ -f "$icon_theme/icon-theme.cache" ] && command -v gtk-update-icon-cache >/dev/null 2>&1; then
        gtk-update-icon-cache --quiet "$icon_theme" || true
    fi
fi

if [ "$windows_shortcut" = 1 ]; then
    helper="$install_dir/wsl-shortcut.ps1"
    if [ -f "$helper" ] && command -v powershell.exe >/dev/null 2>&1 && command -v wslpath >/dev/null 2>&1; then
        powershell.exe -NoProfile -ExecutionPolicy Bypass -File "$(wslpath -w "$helper")" -Remove \
            || warn "the Windows shortcut could not be removed"
    else
        warn "powershell.exe or the helper is not reachable: remove the Windows shortcut 'MoE Desk (WSL)' by hand"
    fi
fi

if [ -d "$install_dir" ]; then
    if [ -f "$install_dir/$MARKER" ]; then
        rm -rf "$install_dir" && say "removed $install_dir"
    else
        warn "not removing $install_dir: it was not made by MoE Desk's installer"
    fi
fi
say "MoE Desk is uninstalled. Your chats ($data_home/MoE Desk), settings (${XDG_CONFIG_HOME:-$HOME/.config}/MoE Desk) and models are kept."
