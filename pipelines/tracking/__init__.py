"""MLflow tracking, from the store up: the store's side (store.py: every record applied, the store opened and
migrated once), links into the UI (links.py), the outbox that sends a process's records from one thread and keeps
what a store did not take (outbox.py, `python -m pipelines.tracking.outbox`), the store agent that keeps a store open
between commands (store_agent.py), the Tracker the runner reports to (tracker.py), and what a run is called
(run_names.py). Each module imports only those before it in this list.

May import: pipelines.core.
"""
