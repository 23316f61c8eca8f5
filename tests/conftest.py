import gc
import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# downloads (engine.hub.default_models_dir, which the app's library scans) never touch the user's own folder
os.environ.setdefault("MOEDESK_MODELS_DIR", os.path.join(tempfile.mkdtemp(prefix="moedesk-models-"), "models"))
import torch  # noqa: E402  (importing torch does not import triton)

if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter; the switch is read when a kernel (including Triton's own
    # library) is decorated, so it must be set before any test imports triton, transformers included
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))

from engine.testing.tiny_checkpoints import write_tiny_checkpoint  # noqa: E402


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
