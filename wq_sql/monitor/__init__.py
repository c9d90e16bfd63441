"""The read-only faces over the database: progress and audit reports (``report``), the read
model of metrics and the dashboard (``snapshot``), the Prometheus exporter (``metrics``) and the
web page (``dashboard``)."""
