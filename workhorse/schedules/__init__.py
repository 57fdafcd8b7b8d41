"""Periodic tasks with no leader: schedules read from the config (or a Celery app's
``beat_schedule``), their due times (``timing``), and the fence that lets any number of
workers fire each due time exactly once (``fence``)."""
