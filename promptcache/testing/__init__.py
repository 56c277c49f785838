"""What tests and benchmarks share: tiny random-weight models built offline (``tiny_*``, the
mlx-vlm ones in ``mlx_tiny_*``) and the conformance conversation (``conformance``).

Never imported by production code (``tests/test_import_graph.py`` checks it)."""
