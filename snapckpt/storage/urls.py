"""What counts as an object store URL (no imports: the storage factory and the remote store both need it)."""
from __future__ import annotations

__all__ = ["is_remote_url"]


def is_remote_url(text: str) -> bool:
    """Whether ``text`` looks like ``scheme://...`` with a scheme of two or more characters."""
    head, sep, _ = text.partition("://")
    return bool(sep) and len(head) >= 2 and head.replace("+", "").replace("-", "").replace(".", "").isalnum()
