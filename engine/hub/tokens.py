"""The Hub token and offline switch, where huggingface_hub keeps them."""

from __future__ import annotations

import os
from pathlib import Path


def save_token(token: str) -> Path:
    """Store a Hub token where huggingface_hub reads it (its token file under HF_HOME); returns that path.

    Written directly rather than through `huggingface_hub.login`, which first checks the token against
    huggingface.co itself: that fails behind a mirror and offline. The token is never logged."""
    from huggingface_hub import constants

    token = token.strip()
    if not token:
        raise ValueError("the token is empty")
    path = Path(constants.HF_TOKEN_PATH)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(token)
    return path


def has_saved_token() -> bool:
    """Whether huggingface_hub has a token to send (its token file or HF_TOKEN)."""
    from huggingface_hub import get_token

    try:
        return bool(get_token())
    except Exception:  # an unreadable token file counts as none
        return False


def client_offline() -> bool:
    """Whether huggingface_hub itself is in offline mode (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
