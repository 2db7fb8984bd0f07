"""Infrastructure every app may use and none is imported by: this process's boot, the pass leases that
run a periodic pass once at a time, and the on-commit outbox for messages to workers. It reads the
recovery app's two tables (server_boot, pass_state) and imports no domain app."""
