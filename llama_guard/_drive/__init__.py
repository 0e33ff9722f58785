"""The drive loops of a guarded request and of its new connections, shared by every stack (``async_drive.py``, and
``sync_drive.py`` generated from it)."""
