"""Every SQL text and every connection: tables and views (``models``), migrations from code
(``migrate``), every SQLAlchemy Core statement (``statements``), the hot path's driver-level
texts (``hot``), transactions and retries (``db``), engines and driver-level connections
(``engine``, ``driver``), the doorbell (``notify``) and every SQLite/Postgres difference
(``dialects``). Nothing above this package holds a connection of its own."""
