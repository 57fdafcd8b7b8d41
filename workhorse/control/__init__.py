"""Remote control: Celery's broadcast mailbox (``celery inspect``, ``workhorse inspect``).

``inspect`` builds the replies, in Celery's formats, from a snapshot of the worker that the
supervisor's loop thread takes (pure: tested without a broker); ``workhorse.daemon.control``
runs the mailbox on a thread of its own, so a slow client never holds up the loop.
"""
