import gc
import gzip
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# downloads (engine.hub.default_models_dir, which the app's library scans) never touch the user's own folder
os.environ.setdefault("MOEDESK_MODELS_DIR", os.path.join(tempfile.mkdtemp(prefix="moedesk-models-"), "models"))
# nor the app's data folder (saved chat states, remote engines)
os.environ.setdefault("MOEDESK_DATA_DIR", tempfile.mkdtemp(prefix="moedesk-data-"))
import torch  # noqa: E402  (importing torch does not import triton)

if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter; the switch is read when a kernel (including Triton's own
    # library) is decorated, so it must be set before any test imports triton, transformers included
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

# fixtures shared across modules, registered here so the tests that use them need no import
from hub_fixtures import fake_hub, hf_home  # noqa: E402, F401

from engine.testing.tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

try:
    from remote_fixtures import fake_api, remote, server  # noqa: E402, F401
except ModuleNotFoundError as missing:  # the GPU machine lacks the server stack: its tests of the engine run without it
    if missing.name not in ("fastapi", "uvicorn"):
        raise


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch, fmt, fused=False, shards=1) -> folder, written once per session."""
    made = {}

    def make(arch: str, fmt: str, fused: bool = False, shards: int = 1) -> Path:
        key = (arch, fmt, fused, shards)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-{fmt}-{'fused' if fused else 'split'}-{shards}")
            made[key] = write_tiny_checkpoint(folder, arch, fmt, fused, shards)
        return made[key]

    return make


REAL_TOKENIZERS = Path(__file__).parent / "fixtures" / "real-tokenizers"


@pytest.fixture(scope="session")
def real_tokenizer_folder(tmp_path_factory):
    """real_tokenizer_folder("qwen3.6" | "qwen3") -> a model folder with that checkpoint's real tokenizer files.

    The fixture keeps tokenizer.json gzipped; a checkpoint folder has it plain, so each is unpacked once."""
    made = {}

    def make(name: str) -> Path:
        if name not in made:
            source = REAL_TOKENIZERS / name
            folder = tmp_path_factory.mktemp(f"real-tokenizer-{name}")
            for path in source.iterdir():
                if path.name == "tokenizer.json.gz":
                    with gzip.open(path, "rb") as packed, open(folder / "tokenizer.json", "wb") as plain:
                        shutil.copyfileobj(packed, plain)
                elif path.name != "golden-encodings.json":
                    shutil.copyfile(path, folder / path.name)
            made[name] = folder
        return made[name]

    return make


@pytest.fixture(autouse=True)
def unfrozen():
    """The engine worker freezes every live object when a model loads (app.engine_worker); each test ends with
    them back in the collector's reach, so one test's model is never kept alive through the rest."""
    yield
    gc.unfreeze()


@pytest.fixture
def settings(tmp_path):
    """App settings in a private INI file, never the user's own."""
    from PySide6.QtCore import QSettings

    from app.settings import AppSettings

    return AppSettings(QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))


@pytest.fixture
def store(tmp_path):
    """A chat store in a private SQLite file."""
    from app.storage import ConversationStore

    return ConversationStore(tmp_path / "c.sqlite3")


@pytest.fixture
def fake():
    """An engine worker that answers from a script (tests/app_fakes.py)."""
    from app_fakes import FakeWorker

    return FakeWorker()


@pytest.fixture
def page(qtbot, store, fake, settings):
    """A shown ChatPage over `store` and the fake worker."""
    from app.pages.chat import ChatPage

    chat = ChatPage(store, fake, settings)
    qtbot.addWidget(chat)
    chat.resize(1000, 700)
    chat.show()
    return chat
