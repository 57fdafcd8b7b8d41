"""A task module that fails to import: the worker must stop with exit status 3."""
from workhorse import App

app = App("broken")

raise RuntimeError("this module is broken on purpose")
