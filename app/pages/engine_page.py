"""The Engine page: the VRAM preset and its memory plan, the custom plan's knobs, and live speed gauges.

Every number in the plan comes from engine.runtime.planner (the same code the runtime is held
to); the page only chooses the inputs: the model's footprint, the preset, the budget and the runtime
reserve. The reserve comes from the worker, which measures it on a usable GPU (engine/runtime/reserve.py);
until it answers, and without a GPU, the plan is the reference card's estimate and says so. Planner
calls read safetensors headers at most, so they run on the GUI thread, as does each use's expected decode speed
(engine.runtime.decode_estimate: some 10 ms for a cache size not seen before, remembered after).
"""

from __future__ import annotations

import html

from PySide6.QtCore import QSignalBlocker, Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app import system_info
from app.machine_fit import Machine, judge
from app.system_info import GIB, format_bytes
from app.widgets.gauges import Sparkline
from app.widgets.plan_bar import PlanBar
from app.widgets.scrolling import scroll_into
from engine.api import (
    DEFAULT_RESERVE_SOURCE,
    KV_TOKEN_GRANULE,
    OVERLAP_MIN_LAYERS,
    PREFILL_CHUNK_MAX,
    PREFILL_CHUNK_MIN,
    REPLY_RESERVE_TOKENS,
    USES,
    MemoryPlan,
    ModelFootprint,
    PlanError,
    estimate_decode,
    footprint_from_synthetic,
    plan_memory,
    prefill_workspace,
    preset_budget_bytes,
)

SYNTHETIC_MODEL = "qwen3.6-35b-a3b-nvfp4"  # the model the presets were designed for
PRESET_CHOICES = (("4 GB", "4gb"), ("8 GB", "8gb"), ("12 GB", "12gb"), ("Auto", "auto"), ("Custom", "custom"))
PRESET_NAMES = {key: label for label, key in PRESET_CHOICES}
USE_NAMES = {"chat": "Chat", "long-context": "Long context"}  # engine.api.USES, as the page names them
USE_TIP = (
    "What the memory beyond a 32K-token prompt is for: Chat gives it to the expert cache (faster replies), "
    "Long context to the KV cache (longer prompts)."
)
# what a loaded model's runtime took from its plan: a plan that differs in these takes a load (or a switch) to apply
RUNTIME_PLAN_KEYS = ("expert_slots", "prefill_overlap", "prefill_chunk_tokens", "kv_tokens", "kv_cache")
NEXT_LOAD = "The loaded model runs the plan it was loaded with ({loaded}); load it again to run this one."
APPLY_NOW = (
    "The loaded model runs the plan it was loaded with ({loaded}); this one applies now, without reloading the weights."
)
SWITCHING = "Switching the loaded model to this plan (after the reply or API request running, if any)…"
MAX_BUDGET_GIB = 1024.0
HISTORY_LENGTH = 60
NOT_MEASURED = "not measured in CPU mode"
NO_REPLY_YET = "No reply yet."
REPLYING_NOW = "The first reply is on its way…"
NO_GPU_BUDGET = (
    "{preset} plans for the card in this machine, and there is none: set a VRAM budget above to see "
    "the plan a card of that size would get."
)
CPU_MODE = "CPU mode: the plan is not used."
MEASURED = "measured on this GPU"
ESTIMATE = "estimate"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _speed_text(tokens_per_s: float) -> str:
    """Write a decode speed as the use labels show it: whole tokens a second, a decimal below ten."""
    return f"~{tokens_per_s:.1f} tok/s" if tokens_per_s < 10 else f"~{tokens_per_s:,.0f} tok/s"


def _overlap_text(overlap: bool, layers: int) -> str:
    if overlap:
        return "on: the next layer's experts stream in while this one computes"
    if layers < OVERLAP_MIN_LAYERS:
        return f"off (it needs {OVERLAP_MIN_LAYERS} or more cache layers)"
    return "off"


def _trial_text(trial: dict | None) -> str:
    """Auto's trial of the backends that can win here (engine/experts/policy.py BackendTrial), for the backend
    row: what it times, then the chosen one's step and the others' (by name: a signal's dict comes sorted)."""
    if not trial:
        return ""
    seconds = trial["step_seconds"]
    if trial["chosen"] is None:
        return f" · auto is timing {', '.join(sorted(seconds))}"
    others = ", ".join(
        f"{backend} {seconds[backend] * 1000:.1f}" for backend in sorted(seconds) if backend != trial["chosen"]
    )
    return f" · auto chose it: {seconds[trial['chosen']] * 1000:.1f} ms a token, {others}"


class CustomPlanEditor(QGroupBox):
    """The custom plan's four knobs, each beside the memory it costs for the current model."""

    changed = Signal(dict)  # expert_cache_layers, prefill_overlap, prefill_chunk_tokens, kv_tokens

    def __init__(self, parent: QWidget | None = None):
        super().__init__("Custom plan", parent)
        self.layers_spin = QSpinBox()
        self.layers_spin.setMinimum(1)
        self.overlap_check = QCheckBox("Prefill overlap")
        self.overlap_check.setToolTip(
            f"Streams layer i+1's experts into a second layer of slots while layer i "
            f"computes; needs {OVERLAP_MIN_LAYERS} or more expert-cache layers."
        )
        self.chunk_spin = QSpinBox()
        self.chunk_spin.setRange(PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX)
        self.chunk_spin.setSingleStep(PREFILL_CHUNK_MIN)
        self.chunk_spin.setSuffix(" tokens")
        self.kv_spin = QSpinBox()
        self.kv_spin.setMinimum(REPLY_RESERVE_TOKENS + KV_TOKEN_GRANULE)
        self.kv_spin.setSingleStep(1024)
        self.kv_spin.setSuffix(" tokens")
        self.kv_spin.setGroupSeparatorShown(True)
        self.layers_cost, self.overlap_cost = QLabel(), QLabel("no memory of its own")
        self.chunk_cost, self.kv_cost = QLabel(), QLabel()
        grid = QGridLayout(self)
        rows = (
            ("Expert-cache layers", self.layers_spin, self.layers_cost),
            ("", self.overlap_check, self.overlap_cost),
            ("Prefill chunk", self.chunk_spin, self.chunk_cost),
            ("KV cache", self.kv_spin, self.kv_cost),
        )
        for row, (label, editor, cost) in enumerate(rows):
            cost.setProperty("role", "muted")
            grid.addWidget(QLabel(label), row, 0)
            grid.addWidget(editor, row, 1)
            grid.addWidget(cost, row, 2)
        grid.setColumnStretch(2, 1)
        self._footprint: ModelFootprint | None = None
        for spin in (self.layers_spin, self.chunk_spin, self.kv_spin):
            spin.valueChanged.connect(self._on_edit)
        self.overlap_check.toggled.connect(self._on_edit)

    def set_footprint(self, footprint: ModelFootprint) -> None:
        """Bound the knobs by the model (its MoE layers and context) and price them for it."""
        self._footprint = footprint
        with QSignalBlocker(self.layers_spin), QSignalBlocker(self.kv_spin):  # one replan, not one per knob
            self.layers_spin.setMaximum(max(footprint.moe_layers, 1))
            self.kv_spin.setMaximum(footprint.max_context)
        self._show_costs()

    def set_values(self, custom: dict) -> None:
        with (
            QSignalBlocker(self.layers_spin),
            QSignalBlocker(self.overlap_check),
            QSignalBlocker(self.chunk_spin),
            QSignalBlocker(self.kv_spin),
        ):
            self.layers_spin.setValue(int(custom["expert_cache_layers"]))
            self.overlap_check.setChecked(bool(custom["prefill_overlap"]))
            self.chunk_spin.setValue(int(custom["prefill_chunk_tokens"]))
            self.kv_spin.setValue(int(custom["kv_tokens"]))
        self._show_costs()

    def values(self) -> dict:
        return {
            "expert_cache_layers": self.layers_spin.value(),
            "prefill_overlap": self.overlap_check.isChecked(),
            "prefill_chunk_tokens": self.chunk_spin.value(),
            "kv_tokens": self.kv_spin.value(),
        }

    def _on_edit(self) -> None:
        self._show_costs()
        self.changed.emit(self.values())

    def _show_costs(self) -> None:
        footprint = self._footprint
        if footprint is None:
            return
        layers = self.layers_spin.value()
        self.layers_cost.setText(
            f"{format_bytes(layers * footprint.expert_layer_bytes)} "
            f"({_plural(layers * footprint.experts_per_layer, 'slot')})"
        )
        workspace = prefill_workspace(footprint.config, self.chunk_spin.value())["total"]
        self.chunk_cost.setText(f"{format_bytes(workspace)} of workspace")
        self.kv_cost.setText(format_bytes(self.kv_spin.value() * footprint.kv_bytes_per_token))


class LiveGauges(QGroupBox):
    """Speed and context while generating, fed by the worker's progress and replyFinished dicts.

    Expert-cache hit rate and VRAM used are shown only when the worker reports them (the GPU
    runtime's `expert_cache_hit_rate` and `vram_used_bytes`); the CPU engine has neither. The
    expert backend's row likewise appears only with the GPU runtime's `expert_backend`.
    """

    def __init__(self, parent: QWidget | None = None):
        super().__init__("Live", parent)
        self.decode_label, self.prefill_label = QLabel("—"), QLabel("—")
        self.decode_history, self.prefill_history = Sparkline(HISTORY_LENGTH), Sparkline(HISTORY_LENGTH)
        self.context_bar = QProgressBar()
        self.context_bar.setTextVisible(False)
        self.context_bar.setFixedHeight(8)
        self.context_label = QLabel("—")
        self.hit_rate_label, self.vram_label = QLabel(NOT_MEASURED), QLabel(NOT_MEASURED)
        self.last_reply_label = QLabel(NO_REPLY_YET)
        self.backend_title, self.backend_label = QLabel("Expert backend"), QLabel()
        for label in (self.hit_rate_label, self.vram_label, self.backend_label, self.last_reply_label):
            label.setProperty("role", "muted")
        self.plan_total_bytes = 0
        grid = QGridLayout(self)
        grid.addWidget(QLabel("Decode"), 0, 0)
        grid.addWidget(self.decode_label, 0, 1)
        grid.addWidget(self.decode_history, 0, 2)
        grid.addWidget(QLabel("Prefill"), 1, 0)
        grid.addWidget(self.prefill_label, 1, 1)
        grid.addWidget(self.prefill_history, 1, 2)
        grid.addWidget(QLabel("Context used"), 2, 0)
        grid.addWidget(self.context_label, 2, 1)
        grid.addWidget(self.context_bar, 2, 2)
        grid.addWidget(QLabel("Expert-cache hit rate"), 3, 0)
        grid.addWidget(self.hit_rate_label, 3, 1, 1, 2)
        grid.addWidget(QLabel("VRAM used vs plan"), 4, 0)
        grid.addWidget(self.vram_label, 4, 1, 1, 2)
        grid.addWidget(self.backend_title, 5, 0)
        grid.addWidget(self.backend_label, 5, 1, 1, 2)
        grid.addWidget(self.last_reply_label, 6, 0, 1, 3)
        grid.setColumnStretch(2, 1)
        grid.setColumnMinimumWidth(1, 110)
        self._show_backend(None)

    def on_loaded(self, info: dict) -> None:
        """A new model: earlier speeds say nothing about it."""
        self.decode_history.clear()
        self.prefill_history.clear()
        self.decode_label.setText("—")
        self.prefill_label.setText("—")
        self._show_context(0, int(info.get("context_tokens") or 0))
        self._show_backend(None)

    def on_progress(self, progress: dict) -> None:
        if self.last_reply_label.text() == NO_REPLY_YET:  # the first reply is streaming: it is not "no reply"
            self.last_reply_label.setText(REPLYING_NOW)
        rate = progress.get("decode_tokens_per_s")
        if rate is not None:
            self.decode_label.setText(f"{rate:.1f} tok/s")
            self.decode_history.add_value(rate)
        if progress.get("context_tokens"):
            self._show_context(int(progress.get("context_used") or 0), int(progress["context_tokens"]))
        self._show_runtime_measures(progress)

    def on_reply_finished(self, reply: dict) -> None:
        stats = reply.get("stats") or {}
        if stats.get("error"):
            self.last_reply_label.setText(f"Last reply: {stats['error']}")
            return
        if stats.get("prefill_tokens_per_s"):
            self.prefill_label.setText(f"{stats['prefill_tokens_per_s']:.1f} tok/s")
            self.prefill_history.add_value(stats["prefill_tokens_per_s"])
        if stats.get("decode_tokens_per_s"):
            self.decode_label.setText(f"{stats['decode_tokens_per_s']:.1f} tok/s")
        if "new_tokens" in stats:
            self.last_reply_label.setText(
                f"Last reply: {_plural(stats['new_tokens'], 'token')}, prefill "
                f"{_plural(stats.get('prefill_tokens', 0), 'token')}, first token after "
                f"{stats.get('time_to_first_token_s', 0):.2f} s, stop: {stats.get('stop_reason', '?')}"
            )
        self._show_runtime_measures(stats)

    def _show_context(self, used: int, size: int) -> None:
        self.context_bar.setRange(0, max(size, 1))
        self.context_bar.setValue(min(used, size))
        self.context_label.setText(f"{used:,} / {size:,}" if size else "—")

    def _show_runtime_measures(self, numbers: dict) -> None:
        if numbers.get("expert_cache_hit_rate") is not None:
            self.hit_rate_label.setText(f"{numbers['expert_cache_hit_rate']:.1%}")
        if numbers.get("vram_used_bytes") is not None:
            planned = f" of {format_bytes(self.plan_total_bytes)} planned" if self.plan_total_bytes else ""
            self.vram_label.setText(f"{format_bytes(numbers['vram_used_bytes'])}{planned}")
        if numbers.get("expert_backend") is not None:
            self._show_backend(numbers)

    def _show_backend(self, numbers: dict | None) -> None:
        """E.g. "hybrid · CPU 38% of experts" (a share only where the CPU computes some), and auto's trial: "timing
        cpu, hybrid, offload", then "auto chose it: 7.6 ms a token, cpu 9.1, hybrid 8.4"; no row without stats."""
        self.backend_title.setVisible(numbers is not None)
        self.backend_label.setVisible(numbers is not None)
        if numbers is None:
            return
        backend = numbers["expert_backend"]
        share = numbers.get("cpu_expert_share")
        on_cpu = f" · CPU {share:.0%} of experts" if backend in ("cpu", "hybrid") and share is not None else ""
        self.backend_label.setText(f"{backend}{on_cpu}{_trial_text(numbers.get('expert_backend_trial'))}")


class EnginePage(QWidget):
    planChanged = Signal(dict)  # MemoryPlan.to_dict(), or {} when no plan fits
    switchRequested = Signal()  # Apply now: the loaded model is to take the plan shown, without a reload

    def __init__(self, worker, settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings
        self.footprint = footprint_from_synthetic(SYNTHETIC_MODEL)
        self._plan: dict = {}
        self._reserve: dict | None = None  # the worker's reserveMeasured; None until it answers
        self._loaded_plan: dict | None = None  # the loaded model's plan (its placement's); None: none, or the CPU
        self._loaded_reserved = 0  # GPU memory the loaded model's allocator holds, which the free memory lacks
        self._switching = False  # Apply now was pressed and the worker has not answered yet
        self._switch_failed: tuple[str, dict] | None = None  # (the worker's message, the plan it could not switch to)

        self.preset_combo = QComboBox()
        for label, key in PRESET_CHOICES:
            self.preset_combo.addItem(label, key)
        self.use_combo = QComboBox()
        for use in USES:
            self.use_combo.addItem(USE_NAMES[use], use)
        self.use_combo.setToolTip(USE_TIP)
        self.budget_spin = QDoubleSpinBox()
        self.budget_spin.setRange(0.0, MAX_BUDGET_GIB)
        self.budget_spin.setDecimals(2)
        self.budget_spin.setSingleStep(0.25)
        self.budget_spin.setSuffix(" GiB")
        self.budget_spin.setSpecialValueText("preset / free VRAM")
        self.budget_spin.setToolTip(
            "0 uses the preset's card size (4, 8 or 12 GB), or the GPU's free memory for Auto and Custom."
        )
        self.budget_note = QLabel()
        self.budget_note.setProperty("role", "muted")
        self.model_label = QLabel()
        self.model_label.setWordWrap(True)
        self.mode_label = QLabel()  # CPU mode is a normal state, said plainly: not an error
        self.mode_label.setWordWrap(True)
        self.mode_label.setStyleSheet("font-weight: 600;")
        self.machine_label = QLabel()
        self.machine_label.setWordWrap(True)
        self.machine_label.setTextFormat(Qt.TextFormat.PlainText)
        self.error_label = QLabel()
        self.error_label.setStyleSheet("color: #d14343;")  # the theme's error red, also where no theme is applied
        self.error_label.setWordWrap(True)
        self.error_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.error_label.hide()
        self.plan_bar = PlanBar()
        self.next_load_note = QLabel()
        self.next_load_note.setWordWrap(True)
        self.next_load_note.hide()
        self.apply_button = QPushButton("Apply now")
        self.apply_button.setToolTip("Give the loaded model this plan: its expert cache and KV cache change in place.")
        self.apply_button.hide()
        self.apply_button.clicked.connect(self._on_apply)
        self.reserve_note = QLabel()
        self.reserve_note.setProperty("role", "muted")
        self.reserve_note.setWordWrap(True)
        self.custom_editor = CustomPlanEditor()
        self.live = LiveGauges()

        self.detail_labels = {
            key: QLabel("—")
            for key in ("rules", "expert_cache", "prefill_overlap", "prefill_chunk", "kv_cache", "max_prompt", "total")
        }
        details = QFormLayout()
        details.setLabelAlignment(Qt.AlignmentFlag.AlignLeft)
        for title, key in (
            ("Rules", "rules"),
            ("Expert cache", "expert_cache"),
            ("Prefill overlap", "prefill_overlap"),
            ("Prefill chunk", "prefill_chunk"),
            ("KV cache", "kv_cache"),
            ("Largest prompt guaranteed", "max_prompt"),
            ("Total", "total"),
        ):
            details.addRow(title, self.detail_labels[key])
        self.detail_labels["max_prompt"].setStyleSheet("font-weight: bold;")

        controls = QHBoxLayout()
        controls.addWidget(QLabel("Preset"))
        controls.addWidget(self.preset_combo)
        controls.addSpacing(16)
        controls.addWidget(QLabel("Memory for"))
        controls.addWidget(self.use_combo)
        controls.addSpacing(16)
        controls.addWidget(QLabel("VRAM budget"))
        controls.addWidget(self.budget_spin)
        controls.addStretch(1)
        plan_row = QHBoxLayout()
        plan_row.addLayout(details, 1)
        plan_row.addWidget(self.custom_editor, 1)
        content = QWidget()
        layout = QVBoxLayout(content)
        layout.addWidget(QLabel("<h2>Engine</h2>"))
        layout.addLayout(controls)
        layout.addWidget(self.mode_label)
        layout.addWidget(self.budget_note)
        layout.addWidget(self.model_label)
        layout.addWidget(self.machine_label)
        layout.addWidget(self.plan_bar)
        note_row = QHBoxLayout()
        note_row.addWidget(self.next_load_note, 1)
        note_row.addWidget(self.apply_button, 0, Qt.AlignmentFlag.AlignTop)
        layout.addLayout(note_row)
        layout.addWidget(self.reserve_note)
        layout.addWidget(self.error_label)
        layout.addLayout(plan_row)
        layout.addWidget(self.live)
        layout.addStretch(1)
        scroll_into(self, content)  # the sections outgrow a small window: they scroll rather than squeeze

        self._show_model_label(synthetic=True)
        self.custom_editor.set_footprint(self.footprint)
        self.custom_editor.set_values(settings.get("custom_plan"))
        saved_preset = self.preset_combo.findData(settings.get("preset"))
        self.preset_combo.setCurrentIndex(max(saved_preset, 0))
        self.use_combo.setCurrentIndex(max(self.use_combo.findData(settings.get("plan_use")), 0))
        self.budget_spin.setValue(float(settings.get("vram_gib") or 0.0))
        self.preset_combo.currentIndexChanged.connect(self._on_preset_changed)
        self.use_combo.currentIndexChanged.connect(self._on_use_changed)
        self.budget_spin.valueChanged.connect(self._on_budget_changed)
        self.custom_editor.changed.connect(self._on_custom_changed)
        worker.progress.connect(self.live.on_progress)
        worker.replyFinished.connect(self.live.on_reply_finished)
        worker.replyFinished.connect(self._on_reply_finished)
        worker.loaded.connect(self.live.on_loaded)
        worker.loaded.connect(self._on_model_loaded)
        worker.unloaded.connect(lambda: self._on_model_loaded({}))
        worker.planSwitched.connect(self.live.on_loaded)
        worker.planSwitched.connect(self._on_plan_switched)
        worker.planSwitchFailed.connect(self._on_plan_switch_failed)
        worker.reserveMeasured.connect(self.set_reserve)
        self.replan()

    # ---- inputs ----------------------------------------------------------------------------------

    def preset(self) -> str:
        return self.preset_combo.currentData()

    def use(self) -> str:
        return self.use_combo.currentData()

    def set_use(self, use: str) -> None:
        self.use_combo.setCurrentIndex(self.use_combo.findData(use))

    def set_preset(self, preset: str) -> None:
        self.preset_combo.setCurrentIndex(self.preset_combo.findData(preset))

    def set_reserve(self, found: dict) -> None:
        """Plan with the runtime reserve the worker found (measured on this GPU, or which estimate, and why)."""
        self._reserve = dict(found)
        self.replan()

    def _on_model_loaded(self, info: dict) -> None:
        self._loaded_plan = (info.get("placement") or {}).get("plan")
        self._switching, self._switch_failed = False, None
        self._count_loaded_reserve(int(info.get("vram_reserved_bytes") or 0))
        self._show_next_load_note()

    def _on_reply_finished(self, reply: dict) -> None:
        held = (reply.get("stats") or {}).get("vram_reserved_bytes")
        if held is not None and self._loaded_plan is not None:
            self._count_loaded_reserve(int(held))

    def _count_loaded_reserve(self, held: int) -> None:
        """Count what the loaded model's allocator holds (prefill grows it) in a budget of free memory, which
        lacks it; replan when that budget changes."""
        if held == self._loaded_reserved:
            return
        self._loaded_reserved = held
        if not preset_budget_bytes(self.preset()) and self.budget_spin.value() <= 0:
            self.replan()

    def _on_plan_switched(self, info: dict) -> None:
        """The loaded model runs the plan it was switched to: the note goes once that is the plan shown."""
        self._on_model_loaded(info)

    def _on_plan_switch_failed(self, message: str) -> None:
        """Say why the plan shown could not be switched to; Apply now comes back once another plan is shown."""
        self._switching = False
        self._switch_failed = (message, dict(self._plan))
        self._show_next_load_note()

    def _on_apply(self) -> None:
        self._switching = True
        self._show_next_load_note()
        self.switchRequested.emit()

    def can_switch_in_place(self) -> bool:
        """Tell whether the loaded model can take the plan shown without a reload: the same model and KV cache format
        on a GPU, and a budget that is not the free VRAM (which lacks what the loaded model holds)."""
        loaded, shown = self._loaded_plan, self._plan
        if not (loaded and shown) or self.cpu_mode():
            return False
        fixed_budget = self.budget_spin.value() > 0 or preset_budget_bytes(self.preset()) is not None
        return fixed_budget and loaded["model"] == shown["model"] and loaded["kv_cache"] == shown["kv_cache"]

    def _show_next_load_note(self) -> None:
        """Say when the plan shown is not the one the loaded model runs, and whether Apply now or a load applies
        it."""
        loaded, shown = self._loaded_plan, self._plan
        differs = bool(loaded and shown) and any(loaded.get(k) != shown.get(k) for k in RUNTIME_PLAN_KEYS)
        failed = self._switch_failed is not None and self._switch_failed[1] == shown
        in_place = differs and not failed and self.can_switch_in_place()
        if differs:
            layers, prompts = _plural(loaded["expert_cache_layers"], "cache layer"), loaded["max_prompt_tokens"]
            running = f"{layers}, {prompts:,}-token prompts"
            if self._switching:
                self.next_load_note.setText(SWITCHING)
            elif failed:
                self.next_load_note.setText(self._switch_failed[0])
            else:
                self.next_load_note.setText((APPLY_NOW if in_place else NEXT_LOAD).format(loaded=running))
        self.next_load_note.setVisible(differs)
        self.apply_button.setVisible(in_place or (differs and self._switching))
        self.apply_button.setEnabled(not self._switching)

    def set_model_footprint(self, footprint: ModelFootprint) -> None:
        """Plan for the loaded model, whose footprint the worker read from its checkpoint."""
        self.footprint = footprint
        self._show_model_label(synthetic=False)
        self.custom_editor.set_footprint(self.footprint)
        self.replan()

    def _show_model_label(self, synthetic: bool) -> None:
        name = html.escape(self.footprint.name)  # a folder name is not markup
        if synthetic:
            self.model_label.setText(
                f"Planning for <b>{name}</b> (synthetic: the real model's shapes, no files) until a model is loaded."
            )
        else:
            self.model_label.setText(
                f"Planning for <b>{name}</b>, the loaded model "
                f"({_plural(self.footprint.moe_layers, 'MoE layer')}, "
                f"{format_bytes(self.footprint.expert_layer_bytes)} of experts per layer)."
            )

    def _on_preset_changed(self) -> None:
        self.settings.set("preset", self.preset())
        self.replan()

    def _on_use_changed(self) -> None:
        self.settings.set("plan_use", self.use())
        self.replan()

    def _on_budget_changed(self, gib: float) -> None:
        self.settings.set("vram_gib", gib)
        self.replan()

    def _on_custom_changed(self, custom: dict) -> None:
        self.settings.set("custom_plan", custom)
        self.replan()

    def budget(self) -> tuple[int | None, str]:
        """(budget in bytes or None, where it comes from, or why there is none)."""
        preset, override = self.preset(), self.budget_spin.value()
        if override > 0:
            return int(override * GIB), f"Budget {override:g} GiB, as set."
        size = preset_budget_bytes(preset)
        if size:
            return size, f"Budget {format_bytes(size)}: the {PRESET_NAMES[preset]} card's memory."
        gpu = system_info.gpu_memory()
        if gpu is None:
            return None, NO_GPU_BUDGET.format(preset=PRESET_NAMES[preset])
        held = self._loaded_reserved if self._loaded_plan is not None else 0
        text = f"Budget {format_bytes(gpu['free_bytes'] + held)}: the free memory of {gpu['name']}"
        return gpu["free_bytes"] + held, text + (
            f" and the {format_bytes(held)} the loaded model holds." if held else "."
        )

    # ---- the plan --------------------------------------------------------------------------------

    def plan(self) -> dict:
        """The plan shown (MemoryPlan.to_dict()), or {} when none fits."""
        return dict(self._plan)

    def cpu_mode(self) -> bool:
        """Whether models run on the CPU here: the worker found no usable GPU, or (until it answers) none is seen."""
        if self._reserve is not None:
            return not self._reserve["gpu_usable"]
        return system_info.gpu_memory() is None

    def replan(self) -> None:
        preset = self.preset()
        self.custom_editor.setVisible(preset == "custom")
        self.use_combo.setEnabled(preset != "custom")
        budget, budget_text = self.budget()
        self.budget_note.setText(budget_text)
        self._show_mode(budget is None)
        self._show_fit_here()
        if budget is None:  # Auto without a card: the normal CPU-mode state, said by the notes, not an error
            self._name_uses({})  # no plan: an earlier budget's figures would stand beside the uses
            self._show_plan(None, 0, "")
            return
        reserve = (
            {}
            if self._reserve is None
            else {"reserve_bytes": self._reserve["reserve_bytes"], "reserve_source": self._reserve["source"]}
        )
        custom = self.custom_editor.values() if preset == "custom" else None
        plans: dict[str, MemoryPlan | PlanError] = {}
        for use in USES if custom is None else (self.use(),):  # a custom plan has no use to choose
            try:
                plans[use] = plan_memory(self.footprint, budget, preset, custom, use=use, **reserve)
            except PlanError as exc:
                plans[use] = exc
        if custom is None:
            self._name_uses(plans)
        plan = plans[self.use()]
        if isinstance(plan, PlanError):
            self._show_plan(None, budget, f"No plan: {plan}")
            return
        self._show_plan(plan.to_dict(), budget, "")

    def _name_uses(self, plans: dict) -> None:
        """Label each use with what its plan gives on this budget, its prompts, cache layers and expected decode
        speed, so the choice is made knowing them all; each use's tooltip says what the speed assumes."""
        tips = {}
        for index in range(self.use_combo.count()):
            use = self.use_combo.itemData(index)
            plan, text = plans.get(use), USE_NAMES[use]
            if isinstance(plan, MemoryPlan):
                speed = estimate_decode(plan, self.footprint)
                text += (
                    f": {plan.max_prompt_tokens:,}-token prompts, {_plural(plan.expert_cache_layers, 'cache layer')}, "
                    f"{_speed_text(speed.tokens_per_s)} expected"
                )
                tips[use] = (
                    f"{USE_NAMES[use]}: {_speed_text(speed.tokens_per_s)} is an {ESTIMATE} of decode speed, not a "
                    f"measurement. It assumes {speed.assumes}."
                )
            self.use_combo.setItemText(index, text)
            self.use_combo.setItemData(index, tips.get(use), Qt.ItemDataRole.ToolTipRole)
        shown = tips.get(self.use())
        self.use_combo.setToolTip(f"{USE_TIP}\n\n{shown}" if shown else USE_TIP)

    def _show_mode(self, no_budget: bool) -> None:
        """In CPU mode, say first that the plan is not used, and what the one shown stands for."""
        if not self.cpu_mode():
            self.mode_label.hide()
            return
        why = self._reserve["gpu_status"] if self._reserve is not None else system_info.NO_GPU_TEXT
        shown = (
            ""
            if no_budget
            else " The plan below is what a card of this budget would get, for when the model runs on a GPU."
        )
        self.mode_label.setText(
            f"{CPU_MODE} No GPU is usable here ({why}), so the model runs on the CPU with every weight in RAM.{shown}"
        )
        self.mode_label.show()

    def _show_fit_here(self) -> None:
        """How the planned model fits this machine's RAM and GPU."""
        self.machine_label.setText("This machine: " + judge(self.footprint, Machine.read()).text)

    def _show_plan(self, plan: dict | None, budget: int, error: str) -> None:
        self._plan = plan or {}
        self.plan_bar.set_plan(plan, budget)
        self.error_label.setText(error)
        self.error_label.setVisible(bool(error))
        self.live.plan_total_bytes = plan["breakdown"]["total"] if plan else 0
        for key, text in self._detail_texts(plan).items():
            self.detail_labels[key].setText(text)
        self.reserve_note.setText(self._reserve_text())
        self._show_next_load_note()
        self.planChanged.emit(dict(self._plan))

    def _reserve_text(self) -> str:
        """Where the plan's runtime reserve, and so its guarantee, comes from, and whether the GPU runs this plan."""
        found = self._reserve
        if found is None:
            return (
                f"The runtime reserve is the {DEFAULT_RESERVE_SOURCE} until this machine's GPU is checked, "
                f"so the guarantee is an {ESTIMATE}."
            )
        size = format_bytes(found["reserve_bytes"])
        if not found["gpu_usable"]:
            return (
                f"The guarantee is an {ESTIMATE}: the runtime reserve ({size}) is the {found['source']}, as no "
                f"GPU is usable here to measure it."
            )
        if found["measured"]:
            return (
                f"The guarantee is {MEASURED}: its runtime reserve ({size}) was {found['source']}, so this is "
                f"the plan the GPU runtime holds to."
            )
        return f"The guarantee is an {ESTIMATE}: the runtime reserve ({size}) is the {found['source']}."

    def _detail_texts(self, plan: dict | None) -> dict[str, str]:
        if not plan:
            return dict.fromkeys(self.detail_labels, "—")
        layers, slots = plan["expert_cache_layers"], plan["expert_slots"]
        rules = PRESET_NAMES.get(plan["preset"], plan["preset"])
        if plan["policy"] != plan["preset"]:
            rules += f" (chose the {PRESET_NAMES[plan['policy']]} rules for this budget)"
        if plan["use"] in USE_NAMES:
            rules += f", memory for {USE_NAMES[plan['use']].lower()}"
        breakdown = plan["breakdown"]
        return {
            "rules": rules,
            "expert_cache": f"{_plural(layers, 'layer')} × {slots // layers} experts = {_plural(slots, 'slot')} "
            f"({format_bytes(breakdown['expert_cache'])})",
            "prefill_overlap": _overlap_text(plan["prefill_overlap"], layers),
            "prefill_chunk": f"{plan['prefill_chunk_tokens']:,} tokens "
            f"({format_bytes(breakdown['prefill_workspace'])} of workspace)",
            "kv_cache": f"{plan['kv_tokens']:,} tokens ({format_bytes(breakdown['kv_cache'])})",
            "max_prompt": f"{plan['max_prompt_tokens']:,} tokens "
            f"(+{plan['reply_reserve_tokens']:,} kept for the reply) · "
            f"{MEASURED if plan['reserve_measured'] else ESTIMATE}",
            "total": f"{format_bytes(breakdown['total'])} of {format_bytes(plan['budget_bytes'])} "
            f"({format_bytes(plan['headroom_bytes'])} headroom)",
        }
