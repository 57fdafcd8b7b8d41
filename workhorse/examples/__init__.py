"""Example tasks that ship with workhorse, for the quick start."""
