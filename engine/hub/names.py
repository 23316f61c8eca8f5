"""Refuse repo file names that cannot be written safely inside a model folder on Windows or POSIX."""

from __future__ import annotations

from pathlib import PurePosixPath, PureWindowsPath

from engine.hub.errors import HubError

# Windows gives these names (with any extension) to devices: a file called so cannot be written there.
WINDOWS_DEVICE_NAMES = frozenset(
    {"CON", "PRN", "AUX", "NUL", "CONIN$", "CONOUT$"}
    | {f"{port}{n}" for port in ("COM", "LPT") for n in (*"123456789", "¹", "²", "³")}
)
WINDOWS_FORBIDDEN_CHARS = frozenset('<>:"|?*\\')


def unsafe_name_reason(name: str) -> str | None:
    """Why a repo's file name cannot be written as a file inside the model folder on Windows or POSIX (it
    leaves the folder, names a drive, a device or a data stream, or the system would rename it); None if safe."""
    if not name:
        return "it is empty"
    if any(ord(c) < 32 for c in name):
        return "it contains a control character"
    bad = sorted(WINDOWS_FORBIDDEN_CHARS.intersection(name))
    if bad:
        return f"it contains {' '.join(bad)}, which Windows does not allow in a file name"
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or windows.root:
        return "it is an absolute path"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "it is not a plain relative path (an empty, '.' or '..' part)"
    for part in parts:
        if part[-1] in ". ":
            return f"{part!r} ends with a dot or a space, which Windows drops"
        if part.split(".")[0].rstrip(" ").upper() in WINDOWS_DEVICE_NAMES:
            return f"{part!r} is a device name on Windows"
        if len(part.encode("utf-8")) > 255:
            return "a part of it is longer than 255 bytes"
    return None


def check_file_names(repo_id: str, names) -> None:
    """Refuse the repo (HubError) when one of the file names it would write is unsafe on some system."""
    for name in names:
        reason = unsafe_name_reason(name)
        if reason is not None:
            raise HubError(
                "unsupported",
                f"{repo_id} lists a file MoE Desk will not write: {name!r} ({reason}). "
                f"A model's files have plain relative names, so this repo is broken or "
                f"hostile; nothing was downloaded. Choose another model.",
            )
