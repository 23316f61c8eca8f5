"""Small meters: a labelled usage bar, a sparkline of recent values, and the sidebar's system footer."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from PySide6.QtCore import QPointF, QSize, Qt, QTimer
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPalette, QPen
from PySide6.QtWidgets import QLabel, QProgressBar, QSizePolicy, QVBoxLayout, QWidget

from app import system_info

BAR_STEPS = 1000  # QProgressBar holds ints; per-mille keeps a 4 GiB card's bar smooth
FOOTER_REFRESH_MS = 2000


class UsageBar(QWidget):
    """A title, a thin bar and "used / total GiB" under it."""

    def __init__(self, title: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.title_label = QLabel(title)
        self.value_label = QLabel("unknown")
        self.value_label.setAlignment(Qt.AlignmentFlag.AlignRight)
        self.bar = QProgressBar()
        self.bar.setRange(0, BAR_STEPS)
        self.bar.setTextVisible(False)
        self.bar.setFixedHeight(6)
        header = QVBoxLayout(self)
        header.setContentsMargins(0, 0, 0, 0)
        header.setSpacing(2)
        header.addWidget(self.title_label)
        header.addWidget(self.bar)
        header.addWidget(self.value_label)

    def set_usage(self, used_bytes: int, total_bytes: int) -> None:
        if total_bytes <= 0:
            self.set_unavailable("unknown")
            return
        self.bar.setEnabled(True)
        self.bar.setValue(round(BAR_STEPS * min(used_bytes / total_bytes, 1.0)))
        self.value_label.setText(f"{used_bytes / system_info.GIB:.1f} / {total_bytes / system_info.GIB:.1f} GiB")
        self.setToolTip(
            f"{self.title_label.text()}: {system_info.format_bytes(used_bytes)} used of "
            f"{system_info.format_bytes(total_bytes)}"
        )

    def set_unavailable(self, text: str) -> None:
        self.bar.setValue(0)
        self.bar.setEnabled(False)
        self.value_label.setText(text)
        self.setToolTip(f"{self.title_label.text()}: {text}")


class Sparkline(QWidget):
    """A tiny line chart of the last `capacity` values, scaled from zero to the largest one shown."""

    def __init__(self, capacity: int = 60, parent: QWidget | None = None):
        super().__init__(parent)
        self._values: deque[float] = deque(maxlen=capacity)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(140, 28)

    def add_value(self, value: float) -> None:
        self._values.append(float(value))
        self.update()

    def values(self) -> list[float]:
        return list(self._values)

    def clear(self) -> None:
        self._values.clear()
        self.update()

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = self.rect().adjusted(1, 2, -1, -2)
        baseline = QPen(self.palette().color(QPalette.ColorRole.Mid))
        painter.setPen(baseline)
        painter.drawLine(rect.bottomLeft(), rect.bottomRight())
        if not self._values:
            return
        peak = max(max(self._values), 1e-9)
        accent = self.palette().color(QPalette.ColorRole.Highlight)
        if len(self._values) == 1:  # one reply so far: a dot at the right edge, where the line will grow from
            painter.setBrush(accent)
            painter.setPen(Qt.PenStyle.NoPen)
            painter.drawEllipse(QPointF(rect.right() - 2, rect.top() + 2), 2.0, 2.0)
            return
        step = rect.width() / (self._values.maxlen - 1)
        # Right-aligned so the newest value is always at the right edge, as in every system monitor.
        start_x = rect.right() - step * (len(self._values) - 1)
        path = QPainterPath()
        for i, value in enumerate(self._values):
            point = QPointF(start_x + i * step, rect.bottom() - value / peak * rect.height())
            if i:
                path.lineTo(point)
            else:
                path.moveTo(point)
        painter.setPen(QPen(accent, 1.5))
        painter.drawPath(path)


class SystemFooter(QWidget):
    """The sidebar footer: GPU name, System VRAM and System RAM bars, refreshed every two seconds.

    The readers are parameters so tests can show a GPU on a machine without one.
    """

    def __init__(
        self,
        parent: QWidget | None = None,
        *,
        read_gpu: Callable[[], dict | None] | None = None,
        read_ram: Callable[[], dict] | None = None,
        interval_ms: int = FOOTER_REFRESH_MS,
    ):
        super().__init__(parent)
        self._read_gpu = read_gpu or system_info.gpu_memory
        self._read_ram = read_ram or system_info.ram
        self.gpu_label = QLabel()
        self.gpu_label.setWordWrap(True)
        muted = self.gpu_label.palette()
        muted.setColor(QPalette.ColorRole.WindowText, QColor(muted.color(QPalette.ColorRole.PlaceholderText)))
        self.gpu_label.setPalette(muted)
        self.vram_bar = UsageBar("System VRAM")
        self.ram_bar = UsageBar("System RAM")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.setSpacing(6)
        layout.addWidget(self.vram_bar)
        layout.addWidget(self.ram_bar)
        layout.addWidget(self.gpu_label)
        self.timer = QTimer(self)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        self.refresh()

    def refresh(self) -> None:
        gpu = self._read_gpu()
        if gpu is None:
            self.vram_bar.set_unavailable("none")
            self.gpu_label.setText(system_info.NO_GPU_TEXT)
        else:
            self.vram_bar.set_usage(gpu["used_bytes"], gpu["total_bytes"])
            self.gpu_label.setText(gpu["name"])
        memory = self._read_ram()
        self.ram_bar.set_usage(memory["used_bytes"], memory["total_bytes"])
