"""The engine's layers import one way, and the app reaches the engine only through its face (engine/api.py).

Every `import` and `from ... import` in engine/ and app/ counts, those inside functions too (the lazy ones are
arrows all the same). The layer order and the face are described in docs/ARCHITECTURE.md ("Layers")."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INIT = "__init__"
FACE = "engine.api"

# bottom to top: a module may import its own layer and those below it, never one above. An entry names a module
# or a package (covering everything in it); a package's own __init__.py is `package.__init__`.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("engine.errors", "engine.paths", "engine.resources", "engine.step")),
    # checkpoint files: reading them (and config.json), their full-size layouts, and the tiny ones tests write
    (
        "checkpoint",
        ("engine.checkpoint", "engine.config", "engine.synthetic", "engine.synthetic_layout", "engine.testing"),
    ),
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
            "engine.bench_resume",
        ),
    ),
    # the face: engine/api.py for the app, the package's __init__.py (load_model, ModelConfig, errors) for scripts
    ("face", (FACE, "engine.__init__")),
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


def face_names(root: Path) -> set[str]:
    """The names the face exports: those of its table of homes (`_HOMES` in engine/api.py), read without importing."""
    path = root / "engine" / "api.py"
    if not path.exists():
        return set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "_HOMES":
            return {name for names in ast.literal_eval(node.value).values() for name in names}
    return set()


def _shown(module: str) -> str:
    """Name a module as it is imported (a package without its __init__)."""
    return module.removesuffix("." + INIT)


def problems(root: Path, layers=LAYERS) -> list[str]:
    """Each module no layer holds, each arrow running up the layers, and each app import besides the face's names."""
    found = []
    for module, path in module_names(root).items():
        if layer_of(module, layers) is None:
            found.append(f"{path.relative_to(root).as_posix()}: {_shown(module)} is in no layer of the table")
    exported = face_names(root)
    for arrow in arrows(root):
        where = f"{arrow.path.relative_to(root).as_posix()}:{arrow.line}"
        source, target = layer_of(arrow.source, layers), layer_of(arrow.target, layers)
        if arrow.source.startswith("app.") and arrow.target.startswith("engine"):
            if arrow.target != FACE:
                found.append(f"{where}: {_shown(arrow.source)} imports {_shown(arrow.target)}, not the face {FACE}")
            elif not arrow.names:
                found.append(f"{where}: {_shown(arrow.source)} imports {FACE} as a module, not names from it")
            elif not set(arrow.names) <= exported:
                taken = ", ".join(sorted(set(arrow.names) - exported))
                found.append(f"{where}: {_shown(arrow.source)} takes {taken} from {FACE}, which does not export it")
        elif source is not None and target is not None and target > source:
            found.append(
                f"{where}: {_shown(arrow.source)} ({layers[source][0]}) imports "
                f"{_shown(arrow.target)} ({layers[target][0]}), a layer above it"
            )
    return list(dict.fromkeys(found))  # one line per import statement, however many names it takes


def test_the_engine_imports_down_and_the_app_only_the_face():
    found = problems(ROOT)
    assert not found, "imports against docs/ARCHITECTURE.md's layers:\n" + "\n".join(found)


def _write(root: Path, files: dict[str, str]) -> None:
    """Write each file's text under `root`, making its folders."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_names_each_wrong_arrow(tmp_path):
    layers = (
        ("low", ("engine.low",)),
        ("high", ("engine.high",)),
        ("face", (FACE, "engine.__init__")),
        ("app", ("app",)),
    )
    _write(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/api.py": '_HOMES: dict = {"engine.low.a": ("helper",)}\n',
            "engine/low/__init__.py": "",
            # lazy, inside a function, and relative: still an arrow up
            "engine/low/a.py": "def f():\n    from ..high import b\n",
            "engine/low/c.py": "from engine.low import a\n",
            "engine/high/__init__.py": "",
            "engine/high/b.py": "import engine.low.a\nfrom engine import low\n",
            "engine/stray.py": "",
            "app/__init__.py": "",
            "app/x.py": "from engine.api import helper\nfrom engine import api\n",
            "app/y.py": "def g():\n    from engine.low.a import f\n    from engine.api import missing\n",
        },
    )
    assert sorted(problems(tmp_path, layers)) == [
        "app/x.py:2: app.x imports engine.api as a module, not names from it",
        "app/y.py:2: app.y imports engine.low.a, not the face engine.api",
        "app/y.py:3: app.y takes missing from engine.api, which does not export it",
        "engine/low/a.py:2: engine.low.a (low) imports engine.high.b (high), a layer above it",
        "engine/stray.py: engine.stray is in no layer of the table",
    ]


def _modules_after(*statements: str) -> list[set[str]]:
    """The modules one fresh interpreter holds after each of `statements`, run in turn."""
    code = "import sys\n" + "".join(f"{line}\nprint(' '.join(sorted(sys.modules)))\n" for line in statements)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    return [set(line.split()) for line in result.stdout.splitlines()]


def test_the_face_imports_a_name_s_home_only_when_the_name_is_taken():
    engine, face, planner = _modules_after("import engine", "import engine.api", "from engine.api import plan_memory")
    assert face - engine == {"engine.api"}
    assert "engine.runtime.planner" in planner
    # the server and the Hub client are among the app's late imports: taking a planner name leaves them unloaded
    assert not {"engine.server.serve", "engine.hub", "uvicorn", "huggingface_hub"} & planner


def test_every_name_of_the_face_is_its_home_s():
    import engine.api

    assert set(engine.api.__all__) == face_names(ROOT)
    for home, names in engine.api._HOMES.items():
        for name in names:
            assert getattr(engine.api, name) is getattr(importlib.import_module(home), name), name
    assert set(dir(engine.api)) >= set(engine.api.__all__)
    with pytest.raises(AttributeError):
        engine.api.not_exported
