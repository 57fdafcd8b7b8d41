"""The worker daemon: supervisor loop, broker consumer, signals, CLI."""
