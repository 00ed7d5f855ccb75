"""The local jobs' warm interpreter: a fork server that imported torch and the stages once (server.py), and the
`python` a warm job runs, which hands the job to it (client.py, run as a script).

May import: pipelines.core.
"""
