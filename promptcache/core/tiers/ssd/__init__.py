"""The SSD tier: safetensors block files indexed in SQLite."""
