"""One queue object's runtime, with no SQL text of its own: the hand-out loop (``dispenser``)
and its book (``book``), how much is claimed ahead (``sizing``) and the refill thread
(``refill``), how deliveries end (``outcomes``), the heartbeat, the epoch maker, joining,
checkpoint coverage, this process's registry and the worker's identity."""
