"""The engine core, below every face (CLI, `Omni`, HTTP): options, request checks, the scheduler, one engine."""
