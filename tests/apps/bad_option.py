"""A task module whose task has an option of the wrong type: the worker must refuse to start
(exit status 3) with one line naming the task and the option."""
from workhorse import App

app = App("bad_option")


@app.task(max_deliveries="3")
def add(x: int, y: int) -> int:
    return x + y
