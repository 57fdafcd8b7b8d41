"""Everything that talks to a broker: the broker thread, its connection and drivers, the
loop thread's side of it (the link), delivery counting, and the journals of dead workers."""
