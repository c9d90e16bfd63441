"""The hot path's driver-level texts, both dialects side by side, each built once per queue
object: the claim round (``claim``; Postgres' live function is ``claim_round.sql``), a waiting
take's poll (``poll``), the heartbeat's renewal (``renew``) and a clean close's give-back
(``leave``)."""
