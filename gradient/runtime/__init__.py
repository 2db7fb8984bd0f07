"""Infrastructure every app may use and that imports no domain app: this process's boot (`boot`), which
server instances are live and whether the service drains (`instances`), the pass leases that run a
periodic pass once at a time (`passes`), and the on-commit outbox for messages to workers (`outbox`).
It reads and writes the recovery app's two tables, server_boot and pass_state."""
