"""Redis: queues, owner-checked locks and leases, cancel signals."""
