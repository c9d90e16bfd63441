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
"""

PENDING = "pending"
CLAIMED = "claimed"
DONE = "done"
FAILED = "failed"

ITEM_STATES = (PENDING, CLAIMED, DONE, FAILED)

# Event kinds written to wq_events, one row per item transition.
EV_CLAIM = "claim"          # pending -> claimed
EV_DONE = "done"            # claimed -> done
EV_RELEASE = "release"      # claimed -> pending, attempts unchanged
EV_FAIL = "fail"            # claimed -> pending/failed by fail(), attempts + 1
EV_EXPIRE = "expire"        # claimed -> pending/failed, lease ran out, attempts + 1
EV_RECOVER = "recover"      # claimed -> claimed by a restarted worker of the same identity
EV_REQUEUE = "requeue"      # done/failed -> pending, operator action

EVENT_KINDS = (EV_CLAIM, EV_DONE, EV_RELEASE, EV_FAIL, EV_EXPIRE, EV_RECOVER, EV_REQUEUE)

# Rows of wq_checkpoints (checkpoint-consistent consumption, wq_sql.tf).
CK_SAVE = "save"            # a checkpoint covered the items handed out before it: done
CK_RESTORE = "restore"      # a restore re-opened the items later checkpoints had covered

CHECKPOINT_ACTIONS = (CK_SAVE, CK_RESTORE)
