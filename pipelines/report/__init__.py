"""What a run reports when it ends: tables, plots and summary.json (summary.py), a sweep's too.

May import: pipelines.core, pipelines.tracking.
"""
