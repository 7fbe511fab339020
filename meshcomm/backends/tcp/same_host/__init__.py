"""The tcp backend's same-host machinery: shared-memory rings, futex doorbells, CMA copies."""
