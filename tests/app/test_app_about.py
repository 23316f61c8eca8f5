"""The About box (version, PyTorch, GPU or CPU mode), the window icon, and the first-run CPU-mode notice."""

import re

import pytest
import torch
from locations import ROOT

from app import about
from app.main_window import MainWindow
from app.storage import ConversationStore
from engine.runtime import placement

NO_DRIVER = "no NVIDIA GPU or driver was found (install or update the NVIDIA driver to use the GPU)"


def fake_gpu(monkeypatch, usable: bool, reason: str) -> None:
    monkeypatch.setattr(placement, "gpu_status", lambda: (usable, reason))


@pytest.fixture
def model_folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_5_moe", "bf16")


def open_window(qtbot, tmp_path, settings, folder):
    window = MainWindow(ConversationStore(tmp_path / "c.sqlite3"), settings, folder)
    qtbot.addWidget(window)
    with qtbot.waitSignal(window.worker.loaded, timeout=60000):
        window.show()
    return window


def test_version_is_pyproject_version():
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert about.app_version() == declared


def test_icon_has_every_size(qtbot):
    icon = about.app_icon()
    assert not icon.isNull()
    sizes = {size.width() for size in icon.availableSizes()}
    assert {16, 32, 48, 64, 128, 256, 512} <= sizes


def test_about_box_says_version_torch_and_cpu_mode(qtbot, monkeypatch):
    fake_gpu(monkeypatch, False, NO_DRIVER)
    dialog = about.AboutDialog()
    qtbot.addWidget(dialog)
    text = dialog.text.text()
    assert "MoE Desk" in text and f"Version {about.app_version()}" in text
    assert f"PyTorch {torch.__version__}" in text
    assert "CPU mode: no NVIDIA GPU or driver was found" in text
    assert "Apache-2.0" in text


def test_about_box_names_a_usable_gpu(qtbot, monkeypatch):
    fake_gpu(monkeypatch, True, "NVIDIA GeForce RTX 3060")
    html = about.about_html({**about.runtime_facts(), "cuda_build": "12.8"})
    assert "CUDA 12.8 build" in html and "GPU: NVIDIA GeForce RTX 3060" in html and "CPU mode" not in html


def test_settings_page_and_f1_open_the_about_box(qtbot, tmp_path, settings, model_folder, monkeypatch):
    fake_gpu(monkeypatch, False, NO_DRIVER)  # the worker asks too: a "usable" fake GPU would fail the load
    window = open_window(qtbot, tmp_path, settings, model_folder)
    window.show_page("Settings")
    window.settings_page.about_button.click()
    qtbot.waitUntil(lambda: window.about_dialog is not None and window.about_dialog.isVisible(), timeout=5000)
    assert f"Version {about.app_version()}" in window.about_dialog.text.text()
    window.about_dialog.reject()
    assert not window.about_dialog.isVisible()
    assert window.show_about() is window.about_dialog and window.about_dialog.isVisible()  # what F1 calls
    window.about_dialog.reject()
    window.close()


def test_cpu_mode_notice_once_per_reason(qtbot, tmp_path, settings, model_folder, monkeypatch):
    fake_gpu(monkeypatch, False, NO_DRIVER)
    window = open_window(qtbot, tmp_path, settings, model_folder)
    assert window.cpu_notice.isVisible()
    assert "CPU mode" in window.cpu_notice_label.text() and "no NVIDIA GPU or driver" in window.cpu_notice_label.text()
    window.dismiss_cpu_notice()
    assert not window.cpu_notice.isVisible()
    window.close()

    again = open_window(qtbot, tmp_path, settings, model_folder)  # the same settings: acknowledged, not shown
    assert not again.cpu_notice.isVisible()
    again.close()

    # a different reason is news: shown again; a usable GPU shows nothing
    fake_gpu(monkeypatch, False, "this PyTorch build has no CUDA support (a CPU-only build)")
    assert "CPU-only build" in about.cpu_notice(settings)
    fake_gpu(monkeypatch, True, "NVIDIA GeForce RTX 3060")
    assert about.cpu_notice(settings) is None


def test_cpu_notice_acknowledgement_is_a_setting(settings, monkeypatch):
    """The acknowledged reason is an ordinary setting, so it survives a restart like the others."""
    fake_gpu(monkeypatch, False, NO_DRIVER)
    about.acknowledge_cpu_notice(settings)
    assert settings.get("cpu_notice_seen") == NO_DRIVER and about.cpu_notice(settings) is None
    assert settings.get("theme") == "light"
