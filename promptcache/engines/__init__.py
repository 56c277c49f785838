"""Engine adapters: each turns a model library's cache objects into core blocks and checkpoints."""
