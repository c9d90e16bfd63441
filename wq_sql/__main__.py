"""``python -m wq_sql``: the ``wq-sql`` command (see :mod:`wq_sql.cli`)."""

import sys

from wq_sql.cli import main

if __name__ == "__main__":
    sys.exit(main())
