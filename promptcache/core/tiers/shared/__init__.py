"""The shared tier: verified block bytes on a Valkey server. Others import ``store``
(``ValkeyStore``), ``link`` (``ValkeyLink``), ``check`` (whole-store walks, the warm-up) and
``index`` (the key layout); ``context``, ``read``, ``write``, ``sessions``, ``scripts`` and
``stream`` are the store's own parts."""

__all__ = ["check", "entry", "index", "link", "store"]
