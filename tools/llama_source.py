"""Extract from llama-cpp-python's sdist only the llama.cpp source a CPU + CUDA build of llama-bench,
llama-server and llama-cli needs, small enough for the device tool to carry (its limit is 64 MiB in all).

Kept: the top-level CMake files, cmake/, include/, src/, common/, vendor/ (the headers and small libraries
common and mtmd include), tools/ (every tool tools/CMakeLists.txt adds, but of tools/ui only its CMake files:
the build runs with the web UI off), scripts/ui-assets.cmake (tools/ui's CMake runs it), licenses/, and of
ggml its CMake files, headers, core sources and only the CPU and CUDA backends. Left out: docs, models,
tests, examples, benches, media, gguf-py, the other ggml backends and the web UI's sources. From
llama-cpp-python 0.3.36 that is 1,007 files, 23.6 MiB (the sdist unpacks to about 217 MiB).

The vendored llama.cpp commit, read from the sdist's CHANGELOG ("update llama.cpp to ggml-org/llama.cpp@..."
under the sdist's version), goes to VENDORED_COMMIT in the output folder; tools/gpu/build_llama_cpp.sh hands it
to CMake so the binaries report it.

How to run, from the repository root (the output folder is git-ignored):

    python tools/llama_source.py /tmp/llsdist/llama_cpp_python-0.3.36.tar.gz [--out .llama-src]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tarfile
from pathlib import Path, PurePosixPath

VENDOR_ROOT = PurePosixPath("vendor/llama.cpp")
KEEP_TREES = (
    "cmake",
    "include",
    "src",
    "common",
    "vendor",
    "tools",
    "licenses",
    "ggml/cmake",
    "ggml/include",
    "ggml/src/ggml-cpu",
    "ggml/src/ggml-cuda",
)
KEEP_FILES = ("CMakeLists.txt", "LICENSE", "scripts/ui-assets.cmake")
# Of these trees only files directly inside them are kept (the top level of ggml and its core sources).
KEEP_FLAT = ("", "ggml", "ggml/src")
FLAT_SUFFIXES = (".c", ".cpp", ".h", ".in", ".txt", ".cmake")
# tools/ui is added by the server's CMake, but with the UI off it needs only its CMake files and templates.
UI_DIR = PurePosixPath("tools/ui")
UI_FILES = ("CMakeLists.txt", "sources.cmake", "ui.cpp.in", "ui.h.in")
LIMIT_BYTES = 60 * 2**20


def keep(relative: PurePosixPath) -> bool:
    """Say whether a file of the vendored llama.cpp (path relative to its root) is needed by the build."""
    text = relative.as_posix()
    if relative.is_relative_to(UI_DIR):
        return relative.parent == UI_DIR and relative.name in UI_FILES
    if text in KEEP_FILES:
        return True
    if any(relative.is_relative_to(tree) for tree in KEEP_TREES):
        return True
    parent = relative.parent.as_posix()
    return (parent if parent != "." else "") in KEEP_FLAT and relative.suffix in FLAT_SUFFIXES


def vendored_commit(changelog: str, version: str) -> str:
    """Return the llama.cpp commit the CHANGELOG's section for this sdist version says it vendors."""
    section = re.search(rf"^## \[{re.escape(version)}\](.*?)(?=^## \[|\Z)", changelog, re.S | re.M)
    found = re.search(r"ggml-org/llama\.cpp@([0-9a-f]{7,40})", section.group(1)) if section else None
    return found.group(1) if found else "unknown"


def extract(sdist: Path, out: Path) -> tuple[int, int, str]:
    """Write the kept files of the sdist's llama.cpp to out (replacing it); return (files, bytes, commit)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    files = total = 0
    changelog = ""
    version = ""
    with tarfile.open(sdist) as archive:
        for member in archive:
            parts = PurePosixPath(member.name).parts
            if len(parts) < 2 or not member.isfile():
                continue
            inside = PurePosixPath(*parts[1:])
            if inside.as_posix() == "CHANGELOG.md":
                changelog = archive.extractfile(member).read().decode("utf-8", "replace")
                version = parts[0].rsplit("-", 1)[-1]
                continue
            if not inside.is_relative_to(VENDOR_ROOT):
                continue
            relative = inside.relative_to(VENDOR_ROOT)
            if not keep(relative):
                continue
            target = out.joinpath(*relative.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.extractfile(member) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)
            target.chmod(0o755 if member.mode & 0o111 else 0o644)
            files += 1
            total += member.size
    commit = vendored_commit(changelog, version)
    (out / "VENDORED_COMMIT").write_text(f"{commit}\nllama-cpp-python {version}\n", encoding="utf-8")
    return files, total, commit


def main(argv: list[str] | None = None) -> int:
    """Extract the trimmed llama.cpp source and print its size; exit 1 if it is missing or too large."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sdist", type=Path, help="llama-cpp-python's .tar.gz source distribution")
    parser.add_argument("--out", type=Path, default=Path(".llama-src"), help="output folder (default .llama-src)")
    args = parser.parse_args(argv)
    if not args.sdist.is_file():
        print(f"llama_source: {args.sdist} is not a file; give the path of llama-cpp-python's sdist (.tar.gz).")
        return 1
    try:
        files, total, commit = extract(args.sdist, args.out)
    except (tarfile.TarError, OSError) as error:
        print(f"llama_source: could not read {args.sdist} ({error}); download the sdist again.")
        return 1
    if files == 0:
        print(f"llama_source: {args.sdist} holds no vendor/llama.cpp; is it llama-cpp-python's sdist?")
        return 1
    print(f"llama_source: {files} files, {total / 2**20:.1f} MiB in {args.out} (llama.cpp {commit})")
    if total > LIMIT_BYTES:
        print(f"llama_source: that is over {LIMIT_BYTES / 2**20:.0f} MiB, too large for the device tool to carry.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
