"""The closed vocabulary of item states and event kinds.

This module imports nothing from the package: the models (CHECK constraint), the
claim statements and the migrations all read it.

Item state machine (see docs/design.md)::

    pending --claim--> claimed --complete--> done
       ^                  |
       +----release-------+   (no attempt counted)
       +--fail / expire / recover (attempts < max)
                          |
                          +--fail / expire / recover (attempts >= max)--> failed
    done, failed --requeue--> pending   (operator action)
    pending, claimed, failed --quarantine--> quarantined --unquarantine--> pending
                                 (operator action; no claim selects a quarantined row)
"""

PENDING = "pending"
CLAIMED = "claimed"
DONE = "done"
FAILED = "failed"
QUARANTINED = "quarantined"  # its work is in wq_quarantine: never claimed until unquarantined

ITEM_STATES = (PENDING, CLAIMED, DONE, FAILED, QUARANTINED)

# Event kinds of wq_events. One row per delivery (one claim of one item by one worker), written
# when the delivery ends, with its claimed_at and attempt; plus the requeues of done and failed
# items, which end no delivery (claimed_at NULL). A claim writes no row: the wq_history view
# shows a 'claim' for each delivery, from the ending rows and the claimed item rows.
EV_CLAIM = "claim"          # never written since revision 0005, except for converted history: a
                            # delivery whose end was never recorded (see docs/design.md)
EV_DONE = "done"            # claimed -> done
EV_RELEASE = "release"      # claimed -> pending, attempts unchanged
EV_FAIL = "fail"            # claimed -> pending/failed by fail(), attempts + 1
EV_EXPIRE = "expire"        # claimed -> pending/failed, lease ran out, attempts + 1
EV_RECOVER = "recover"      # claimed -> claimed: a restarted worker of the same identity took it
                            # back; ends the dead process's delivery and begins the next one
EV_REQUEUE = "requeue"      # done/failed/claimed -> pending, operator action (or a restore);
                            # quarantined -> pending (unquarantine)
EV_QUARANTINE = "quarantine"  # pending/claimed/failed -> quarantined (ends a claimed one's delivery)

EVENT_KINDS = (EV_CLAIM, EV_DONE, EV_RELEASE, EV_FAIL, EV_EXPIRE, EV_RECOVER, EV_REQUEUE, EV_QUARANTINE)

# The wq_tallies row that counts an epoch's quarantined items (no worker has id 0).
QUARANTINE_TALLY = 0

# Rows of wq_checkpoints (checkpoint-consistent consumption, wq_sql.tf).
CK_SAVE = "save"            # a checkpoint covered the items handed out before it: done
CK_RESTORE = "restore"      # a restore re-opened the items later checkpoints had covered

CHECKPOINT_ACTIONS = (CK_SAVE, CK_RESTORE)
