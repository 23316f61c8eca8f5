"""The Settings page: sampling defaults, thinking, context size, restore points, CPU threads, pinned RAM, expert
backend, theme and the local API (app/pages/server_section.py).

Sampling fields are free text, blank meaning "the model's own default" (its generation_config.json),
so only what the user typed is stored and a model's recommended values win otherwise. They are
checked with the engine's own SamplingParams.validate() before anything is saved. The other
controls cannot hold an invalid value and are saved as they change.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app import system_info
from app.pages.server_section import ServerSection
from app.settings import MAX_CONTEXT_TOKENS, MAX_TURN_SNAPSHOTS, MIN_CONTEXT_TOKENS, max_cpu_threads
from app.widgets.scrolling import scroll_into
from engine.api import MAX_SEED, SamplingParams

# (settings key = SamplingParams field, label, type, placeholder)
SAMPLING_FIELDS = (
    ("temperature", "Temperature", float, "model default (0 = greedy)"),
    ("top_p", "Top-p", float, "model default"),
    ("top_k", "Top-k", int, "model default (0 = off)"),
    ("min_p", "Min-p", float, "model default (0 = off)"),
    ("repetition_penalty", "Repetition penalty", float, "model default (1 = off)"),
    ("max_new_tokens", "Max new tokens", int, "model default"),
    ("seed", "Seed", int, "random"),
)
THEMES = (("Light", "light"), ("Dark", "dark"))
# (label, engine.experts.backend name, when it helps)
EXPERT_BACKENDS = (
    (
        "Auto (measured)",
        "auto",
        "Measures this machine's PCIe and CPU memory speeds once; where the CPU may "
        "help, times the first tokens of a reply under each of CPU, Hybrid and Offload "
        "that can win and keeps the fastest, else uses Offload (All experts in VRAM when "
        "the cache holds every layer). Right for most machines.",
    ),
    (
        "All experts in VRAM",
        "gpu",
        "Keeps every expert on the card, so nothing is copied once warm: the fastest, "
        "but only when the preset's expert cache holds every layer (a big card or a "
        "small model); otherwise loading is refused.",
    ),
    (
        "Offload (PCIe)",
        "offload",
        "Copies each missing expert over PCIe into the card's cache. Best on a desktop with a full-width PCIe slot.",
    ),
    (
        "CPU computes misses",
        "cpu",
        "The CPU computes missing experts straight from RAM and nothing crosses PCIe. "
        "Helps on laptops, whose PCIe link is narrow and RAM fast. Its threads stay "
        "busy while a reply is written.",
    ),
    (
        "Hybrid (PCIe + CPU)",
        "hybrid",
        "Splits each step's missing experts between PCIe copies and the CPU, and keeps "
        "moving the split so both finish together. Helps when the two paths are about "
        "as fast. The CPU's threads stay busy while a reply is written.",
    ),
)


def snapshot_cost(count: int, model_info: dict | None) -> str:
    """Say what `count` restore points take in host RAM: for the loaded model when its size is known."""
    per = (model_info or {}).get("snapshot_bytes")
    if per is None:
        cost = (
            "Each holds a copy of the model's recurrent (Gated DeltaNet) state in host RAM: 61 MiB for "
            "Qwen3.6-35B-A3B, none for models without such layers."
        )
    elif per == 0:
        cost = f"{model_info['name']} has no recurrent layers, so its restore points take no host RAM."
    else:
        cost = (
            f"{count} × {system_info.format_bytes(per)} = {system_info.format_bytes(count * per)} of host RAM "
            f"for {model_info['name']}."
        )
    return cost + " Applies when a model is loaded; an edit further back prefills the chat again."


def context_note(asked: int, info: dict | None) -> str:
    """What context the loaded model runs at and what caps it: this setting, the model's maximum
    (max_position_embeddings) or the VRAM plan's KV cache."""
    if not info or "context_tokens" not in info:
        return (
            "Applies when a model is loaded, up to the model's own maximum and, on a GPU, what the VRAM plan's "
            "KV cache holds."
        )
    running, model_max, plan = info["context_tokens"], info["max_context_tokens"], info.get("context_plan_tokens")
    limits = f"the model allows {model_max:,} (max_position_embeddings)"
    if plan is not None:
        limits += f", the VRAM plan's KV cache holds {plan:,}"
    text = f"{info.get('name', 'The model')} runs at {running:,} tokens: {limits}."
    if asked > running:
        cap = (
            "the plan's KV cache (a larger VRAM preset holds more)"
            if plan == running and plan < model_max
            else "the model's maximum"
        )
        text += f" This setting asks {asked:,}, so {cap} decides."
    elif asked != info.get("context_asked_tokens", asked):
        text += " The new size applies when the model is loaded again."
    return text


def parse_sampling(texts: dict[str, str]) -> dict:
    """The sampling overrides typed in the fields (blank ones left out); ValueError with a readable message."""
    values = {}
    for key, label, kind, _ in SAMPLING_FIELDS:
        text = texts.get(key, "").strip()
        if not text:
            continue
        try:
            values[key] = kind(text)
        except ValueError:
            raise ValueError(
                f"{label} must be {'a whole number' if kind is int else 'a number'}, not {text!r}"
            ) from None
    seed = values.get("seed")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ValueError(f"Seed must be a whole number from 0 to {MAX_SEED}, or blank for a random seed")
    try:
        SamplingParams(**values).validate()
    except ValueError as exc:  # the engine names fields as the code does; say it with the page's labels
        key = str(exc).split(" ", 1)[0]
        label = next((label for k, label, _, _ in SAMPLING_FIELDS if k == key), key)
        raise ValueError(label + str(exc)[len(key) :]) from None
    return values


class SettingsPage(QWidget):
    themeChanged = Signal(str)  # "light" | "dark"
    aboutRequested = Signal()

    def __init__(self, settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings

        saved_sampling = settings.get("sampling")
        self.sampling_fields: dict[str, QLineEdit] = {}
        sampling_form = QFormLayout()
        for key, label, _, placeholder in SAMPLING_FIELDS:
            field = QLineEdit("" if saved_sampling.get(key) is None else str(saved_sampling[key]))
            field.setPlaceholderText(placeholder)
            field.returnPressed.connect(self.save_sampling)
            self.sampling_fields[key] = field
            sampling_form.addRow(label, field)
        self.save_sampling_button = QPushButton("Save sampling defaults")
        self.save_sampling_button.clicked.connect(self.save_sampling)
        self.reset_sampling_button = QPushButton("Use the model's defaults")
        self.reset_sampling_button.clicked.connect(self.reset_sampling)
        self.sampling_message = QLabel()
        self.sampling_message.setWordWrap(True)
        sampling_buttons = QHBoxLayout()
        sampling_buttons.addWidget(self.save_sampling_button)
        sampling_buttons.addWidget(self.reset_sampling_button)
        sampling_buttons.addStretch(1)
        sampling_box = QGroupBox("Sampling defaults (blank: the model's generation_config.json)")
        sampling_layout = QVBoxLayout(sampling_box)
        sampling_layout.addLayout(sampling_form)
        sampling_layout.addLayout(sampling_buttons)
        sampling_layout.addWidget(self.sampling_message)

        self.thinking_check = QCheckBox("Think before answering (can be changed per chat)")
        self.thinking_check.setChecked(bool(settings.get("enable_thinking")))
        self.thinking_check.toggled.connect(lambda on: settings.set("enable_thinking", on))
        self.context_spin = QSpinBox()
        self.context_spin.setRange(MIN_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS)
        self.context_spin.setSingleStep(1024)
        self.context_spin.setGroupSeparatorShown(True)
        self.context_spin.setSuffix(" tokens")
        self.context_spin.setValue(int(settings.get("context_tokens")))
        self.context_spin.setToolTip("Used when a model is loaded; capped at the model's own maximum.")
        self.context_spin.valueChanged.connect(self._on_context_changed)
        self.context_note = QLabel()
        self.context_note.setWordWrap(True)
        self.context_note.setProperty("role", "muted")
        self.context_note.setTextFormat(Qt.TextFormat.PlainText)  # the model's name is a folder's: data
        self.model_info: dict | None = None  # the loaded model's, for what restore points cost
        self.snapshots_spin = QSpinBox()
        self.snapshots_spin.setRange(1, MAX_TURN_SNAPSHOTS)
        self.snapshots_spin.setValue(int(settings.get("turn_snapshots")))
        self.snapshots_spin.valueChanged.connect(self._on_snapshots_changed)
        self.snapshots_cost = QLabel()
        self.snapshots_cost.setTextFormat(Qt.TextFormat.PlainText)  # the model folder's name is data
        self.snapshots_cost.setWordWrap(True)
        self.set_model(None)
        self.threads_spin = QSpinBox()
        self.threads_spin.setRange(0, max_cpu_threads())
        self.threads_spin.setSpecialValueText("physical cores")
        self.threads_spin.setToolTip(
            "Threads for the CPU's work: the whole model in CPU mode, the experts it "
            "computes on a GPU run. Applies when a model is loaded."
        )
        self.threads_spin.setValue(int(settings.get("cpu_threads")))
        self.threads_spin.valueChanged.connect(lambda n: settings.set("cpu_threads", n))
        self.pin_spin = _gib_spin(
            settings,
            "pin_budget_gib",
            system_info.ram()["total_bytes"] / system_info.GIB,
            "Host RAM locked for fast copies of experts to the GPU.",
        )
        self.pin_spin.setSpecialValueText("sized from free RAM")
        self.states_ram_spin = _gib_spin(
            settings,
            "chat_states_ram_gib",
            system_info.ram()["total_bytes"] / system_info.GIB,
            "Host RAM for the engine states of recent chats and API prompts: returning to one starts the "
            "next reply without reading its history again. Applies when a model is loaded.",
        )
        self.states_disk_spin = _gib_spin(
            settings,
            "chat_states_disk_gib",
            4096.0,
            "Disk for the chat states RAM cannot hold, kept across restarts (oldest dropped first); "
            "0 keeps none. Applies when a model is loaded.",
        )
        self.backend_combo = QComboBox()
        for label, key, when in EXPERT_BACKENDS:
            self.backend_combo.addItem(label, key)
            self.backend_combo.setItemData(self.backend_combo.count() - 1, when, Qt.ItemDataRole.ToolTipRole)
        self.backend_combo.setToolTip(
            "Where a GPU run computes the experts missing from its cache; applies when "
            "a model is loaded, and CPU mode ignores it. Each choice says when it helps."
        )
        self.backend_combo.setCurrentIndex(max(self.backend_combo.findData(settings.get("expert_backend")), 0))
        self.backend_combo.currentIndexChanged.connect(
            lambda: settings.set("expert_backend", self.backend_combo.currentData())
        )
        self.theme_combo = QComboBox()
        for label, key in THEMES:
            self.theme_combo.addItem(label, key)
        self.theme_combo.setCurrentIndex(max(self.theme_combo.findData(settings.get("theme")), 0))
        self.theme_combo.currentIndexChanged.connect(self._on_theme_changed)

        engine_box = QGroupBox("Engine")
        engine_form = QFormLayout(engine_box)
        engine_form.addRow("Context size", self.context_spin)
        engine_form.addRow(self.context_note)
        engine_form.addRow("Restore points kept for regenerate and edit", self.snapshots_spin)
        engine_form.addRow(self.snapshots_cost)
        engine_form.addRow("CPU threads", self.threads_spin)
        engine_form.addRow("Pinned-RAM budget", self.pin_spin)
        engine_form.addRow("Expert backend", self.backend_combo)
        engine_form.addRow("Chat states in RAM", self.states_ram_spin)
        engine_form.addRow("Chat states on disk", self.states_disk_spin)
        chat_box = QGroupBox("Chat and appearance")
        chat_form = QFormLayout(chat_box)
        chat_form.addRow(self.thinking_check)
        chat_form.addRow("Theme", self.theme_combo)

        self.server_section = ServerSection(settings)

        content = QWidget()
        layout = QVBoxLayout(content)
        layout.addWidget(QLabel("<h2>Settings</h2>"))
        layout.addWidget(sampling_box)
        layout.addWidget(engine_box)
        layout.addWidget(chat_box)
        layout.addWidget(self.server_section)
        self.about_button = QPushButton("About MoE Desk…")
        self.about_button.clicked.connect(self.aboutRequested)
        about_row = QHBoxLayout()
        about_row.addWidget(self.about_button)
        about_row.addStretch(1)
        layout.addLayout(about_row)
        layout.addStretch(1)
        scroll_into(self, content)  # the sections outgrow a small window: they scroll rather than squeeze

    def set_model(self, info: dict | None) -> None:
        """Show what restore points cost for the loaded model (`info` from the worker), or in general for None."""
        self.model_info = info
        self.snapshots_cost.setText(snapshot_cost(self.snapshots_spin.value(), info))
        self.context_note.setText(context_note(self.context_spin.value(), info))

    def _on_context_changed(self, tokens: int) -> None:
        self.settings.set("context_tokens", tokens)
        self.context_note.setText(context_note(tokens, self.model_info))

    def _on_snapshots_changed(self, count: int) -> None:
        self.settings.set("turn_snapshots", count)
        self.set_model(self.model_info)

    def save_sampling(self) -> bool:
        """Check and store the sampling fields; on a bad value say which and why, and store nothing."""
        try:
            values = parse_sampling({key: field.text() for key, field in self.sampling_fields.items()})
        except ValueError as exc:
            self._say(str(exc), error=True)
            return False
        self.settings.set("sampling", values)
        self._say("Saved. New replies use these values." if values else "Saved: every value is the model's default.")
        return True

    def reset_sampling(self) -> None:
        for field in self.sampling_fields.values():
            field.clear()
        self.save_sampling()

    def _say(self, text: str, error: bool = False) -> None:
        self.sampling_message.setText(text)
        self.sampling_message.setStyleSheet("color: #d14343;" if error else "")

    def _on_theme_changed(self) -> None:
        theme = self.theme_combo.currentData()
        self.settings.set("theme", theme)
        self.themeChanged.emit(theme)


def _gib_spin(settings, key: str, most: float, tip: str) -> QDoubleSpinBox:
    """A spin box of GiB from 0 to `most` that edits the setting `key`."""
    spin = QDoubleSpinBox()
    spin.setRange(0.0, max(most, 1.0))
    spin.setDecimals(1)
    spin.setSingleStep(0.5)
    spin.setSuffix(" GiB")
    spin.setToolTip(tip)
    spin.setValue(float(settings.get(key)))
    spin.valueChanged.connect(lambda gib: settings.set(key, gib))
    return spin
