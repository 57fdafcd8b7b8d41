"""The prefork pool: child processes, their IPC and time limits."""
