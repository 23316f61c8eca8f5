"""The engine's layers import one way: a module imports its own layer and those below it, never one above.

Every `import` and `from ... import` in engine/ and app/ counts, those inside functions too (the lazy ones are
arrows all the same). The layer order and the face are described in docs/ARCHITECTURE.md ("Layers")."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INIT = "__init__"

# bottom to top: a module may import its own layer and those below it, never one above. An entry names a module
# or a package (covering everything in it); a package's own __init__.py is `package.__init__`.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("engine.errors", "engine.paths", "engine.resources", "engine.step")),
    # checkpoint files: reading them (and config.json), their full-size layouts, and the tiny ones tests write
    ("checkpoint", ("engine.checkpoint", "engine.config", "engine.synthetic", "engine.testing")),
    ("kernels", ("engine.kernels",)),
    ("experts", ("engine.experts",)),
    ("layers", ("engine.layers",)),
    ("models", ("engine.models",)),
    ("runtime", ("engine.runtime", "engine.loader")),
    ("hub", ("engine.hub",)),
    ("server", ("engine.server",)),
    (
        "tools",
        (
            "engine.cli",
            "engine.__main__",
            "engine.bench",
            "engine.bench_agent",
            "engine.bench_cpu",
            "engine.bench_hf",
            "engine.bench_projection",
        ),
    ),
    # the package's __init__.py: load_model and the errors, for scripts
    ("face", ("engine.__init__",)),
    ("app", ("app",)),
)


@dataclass(frozen=True)
class Arrow:
    """One import: the module that imports, the module it names, the names taken, and where it is written."""

    source: str
    target: str
    names: tuple[str, ...]
    path: Path
    line: int


def module_names(root: Path, packages: tuple[str, ...] = ("engine", "app")) -> dict[str, Path]:
    """Map each dotted module name under `packages` of `root` to its file (a package as `package.__init__`)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[".".join(path.relative_to(root).with_suffix("").parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The module an imported dotted name loads: a package's is its __init__."""
    return f"{name}.{INIT}" if f"{name}.{INIT}" in modules else name


def arrows(root: Path, packages: tuple[str, ...] = ("engine", "app")) -> list[Arrow]:
    """Every import of one of `packages` written in a module of `packages`, wherever in the module it stands."""
    modules = module_names(root, packages)
    found = []
    for source, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in packages:
                        found.append(Arrow(source, _resolve(alias.name, modules), (), path, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    # a module's name ends in its own (a package's in __init__), so dropping `level` parts leaves
                    # the package the dots count up to
                    package = ".".join(source.split(".")[: -node.level])
                    base = f"{package}.{base}" if base else package
                if base.split(".")[0] not in packages:
                    continue
                for alias in node.names:
                    # `from package import submodule` loads the submodule; any other name comes from `base`
                    if f"{base}.{alias.name}" in modules or f"{base}.{alias.name}.{INIT}" in modules:
                        found.append(Arrow(source, _resolve(f"{base}.{alias.name}", modules), (), path, node.lineno))
                    else:
                        found.append(Arrow(source, _resolve(base, modules), (alias.name,), path, node.lineno))
    return found


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index in `layers` of the layer whose longest entry names `module` or a package holding it."""
    best, length = None, -1
    for rank, (_, entries) in enumerate(layers):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > length:
                best, length = rank, len(entry)
    return best


def _shown(module: str) -> str:
    return module.removesuffix("." + INIT)


def problems(root: Path, layers=LAYERS) -> list[str]:
    """Each module no layer holds and each arrow running up the layers."""
    found = []
    for module, path in module_names(root).items():
        if layer_of(module, layers) is None:
            found.append(f"{path.relative_to(root).as_posix()}: {_shown(module)} is in no layer of the table")
    for arrow in arrows(root):
        where = f"{arrow.path.relative_to(root).as_posix()}:{arrow.line}"
        source, target = layer_of(arrow.source, layers), layer_of(arrow.target, layers)
        if source is not None and target is not None and target > source:
            found.append(
                f"{where}: {_shown(arrow.source)} ({layers[source][0]}) imports "
                f"{_shown(arrow.target)} ({layers[target][0]}), a layer above it"
            )
    return list(dict.fromkeys(found))  # one line per import statement, however many names it takes


def test_the_engine_imports_down():
    found = problems(ROOT)
    assert not found, "imports against docs/ARCHITECTURE.md's layers:\n" + "\n".join(found)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_names_each_wrong_arrow(tmp_path):
    layers = (
        ("low", ("engine.low",)),
        ("high", ("engine.high",)),
        ("face", ("engine.__init__",)),
        ("app", ("app",)),
    )
    _write(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/low/__init__.py": "",
            # lazy, inside a function, and relative: still an arrow up
            "engine/low/a.py": "def f():\n    from ..high import b\n",
            "engine/low/c.py": "from engine.low import a\n",
            "engine/high/__init__.py": "",
            "engine/high/b.py": "import engine.low.a\nfrom engine import low\n",
            "engine/stray.py": "",
            "app/__init__.py": "",
            "app/x.py": "from engine.low import a\n",
        },
    )
    assert sorted(problems(tmp_path, layers)) == [
        "engine/low/a.py:2: engine.low.a (low) imports engine.high.b (high), a layer above it",
        "engine/stray.py: engine.stray is in no layer of the table",
    ]
