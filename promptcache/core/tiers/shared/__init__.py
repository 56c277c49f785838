"""The shared tier: verified block bytes on a Valkey server."""
