"""MoE Desk desktop app (PySide6)."""
