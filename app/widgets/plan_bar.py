"""Where the VRAM goes: a stacked bar of a MemoryPlan's breakdown over its budget, with a legend.

It draws the planner's own numbers (MemoryPlan.to_dict()) and computes nothing but the free
part, so what the user sees is exactly what the GPU runtime will be held to.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPalette, QPen
from PySide6.QtWidgets import QGridLayout, QLabel, QSizePolicy, QToolTip, QVBoxLayout, QWidget

from app.system_info import format_bytes
from engine.api import BREAKDOWN_LABELS

FREE = "free"
PART_COLOURS = {
    "resident_weights": "#4c72b0",
    "expert_cache": "#dd8452",
    "kv_cache": "#55a868",
    "gdn_state": "#8172b3",
    "prefill_workspace": "#ccb974",
    "runtime_reserve": "#8c8c8c",
    FREE: "#dfe3e8",
}
LEGEND_GROUP_COLUMNS = 4  # swatch, name, size, spacer
PART_LABELS = dict(BREAKDOWN_LABELS, **{FREE: "free"})
PART_EXPLANATIONS = {
    "resident_weights": "Attention and Gated DeltaNet projections, shared experts, routers, norms and the "
    "LM head: on the GPU for the whole session.",
    "expert_cache": "Slots the routed experts are copied into from host RAM as the router picks them.",
    "kv_cache": "Keys and values of the full-attention layers, preallocated for the planned tokens.",
    "gdn_state": "The Gated DeltaNet layers' recurrent state: fixed size, whatever the context length.",
    "prefill_workspace": "Temporary memory of one prefill chunk; bounded by the chunk, never by the prompt.",
    "runtime_reserve": "CUDA context, kernel images, per-thread stacks and allocator slack.",
    FREE: "Budget the plan leaves unused, as headroom.",
}


def plan_parts(plan: dict | None, budget_bytes: int) -> list[tuple[str, int]]:
    """(part key, bytes) in bar order, the budget's unplanned rest last; empty without a plan."""
    if not plan:
        return []
    breakdown = plan["breakdown"]
    parts = [(key, int(breakdown[key])) for key in BREAKDOWN_LABELS if breakdown.get(key)]
    free = budget_bytes - int(breakdown["total"])
    if free > 0:
        parts.append((FREE, free))
    return parts


class StackedMemoryBar(QWidget):
    """The bar itself: one coloured segment per part, widths in proportion to bytes; hover names a segment."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._parts: list[tuple[str, int]] = []
        self.setMouseTracking(True)
        self.setMinimumHeight(28)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(480, 30)

    def set_parts(self, parts: list[tuple[str, int]]) -> None:
        self._parts = parts
        self.update()

    def _segments(self) -> list[tuple[str, int, QRectF]]:
        total = sum(n for _, n in self._parts)
        rect = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        segments, x = [], rect.left()
        for key, n in self._parts:
            width = rect.width() * n / total
            segments.append((key, n, QRectF(x, rect.top(), width, rect.height())))
            x += width
        return segments

    def part_at(self, x: float) -> str | None:
        for key, _, rect in self._segments():
            if rect.left() <= x < rect.right():
                return key
        return None

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        outline = QPen(self.palette().color(QPalette.ColorRole.Mid))
        if not self._parts:
            painter.setPen(QPen(outline.color(), 1, Qt.PenStyle.DashLine))
            painter.drawRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5))
            painter.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "no plan")
            return
        painter.setPen(Qt.PenStyle.NoPen)
        for key, _, rect in self._segments():
            painter.fillRect(rect, QColor(PART_COLOURS[key]))
        painter.setPen(outline)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        painter.drawRect(QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5))

    def event(self, event) -> bool:
        if event.type() == event.Type.ToolTip:
            key = self.part_at(event.pos().x())
            if key is None:
                QToolTip.hideText()
            else:
                n = dict(self._parts)[key]
                QToolTip.showText(
                    event.globalPos(), f"<b>{PART_LABELS[key]}</b>: {format_bytes(n)}<br>{PART_EXPLANATIONS[key]}", self
                )
            return True
        return super().event(event)


class PlanBar(QWidget):
    """The stacked bar, a one-line total, and a legend with each part's colour and size."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.bar = StackedMemoryBar()
        self.total_label = QLabel()
        self._legend = QGridLayout()
        self._legend.setHorizontalSpacing(10)
        self._legend.setVerticalSpacing(2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.bar)
        layout.addWidget(self.total_label)
        layout.addLayout(self._legend)
        self._parts: list[tuple[str, int]] = []
        self.set_plan(None, 0)

    def set_plan(self, plan: dict | None, budget_bytes: int) -> None:
        """Show `plan` (MemoryPlan.to_dict()) against `budget_bytes`; None or {} shows an empty bar."""
        self._parts = plan_parts(plan, budget_bytes)
        self.bar.set_parts(self._parts)
        self.total_label.setVisible(bool(self._parts))  # without a plan the bar says so; the page says why
        if self._parts:
            self.total_label.setText(
                f"{format_bytes(plan['breakdown']['total'])} planned of a {format_bytes(budget_bytes)} budget"
            )
        self._fill_legend()

    def parts(self) -> list[tuple[str, str, int]]:
        """(key, label, bytes) of each part shown, in bar order."""
        return [(key, PART_LABELS[key], n) for key, n in self._parts]

    def legend_texts(self) -> list[str]:
        """The legend rows as read on screen, e.g. "KV cache  660.0 MiB"."""
        return [f"{label}  {format_bytes(n)}" for _, label, n in self.parts()]

    def _fill_legend(self) -> None:
        while self._legend.count():
            old = self._legend.takeAt(0).widget()
            old.hide()  # hidden now, deleted later: a grab before the next event-loop turn must not show it
            old.deleteLater()
        columns = 2  # two columns keep the legend as wide as the bar and half as tall
        for i, (key, n) in enumerate(self._parts):
            row, column = divmod(i, columns)
            swatch = QLabel()
            swatch.setFixedSize(12, 12)
            swatch.setStyleSheet(f"background: {PART_COLOURS[key]}; border: 1px solid palette(mid);")
            name = QLabel(PART_LABELS[key])
            size = QLabel(format_bytes(n))
            size.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            for offset, widget in enumerate((swatch, name, size)):
                widget.setToolTip(PART_EXPLANATIONS[key])
                self._legend.addWidget(widget, row, column * LEGEND_GROUP_COLUMNS + offset)
        for column in range(columns):  # an empty stretching column after each group spreads them over the bar
            self._legend.setColumnStretch(column * LEGEND_GROUP_COLUMNS + 3, 1)
