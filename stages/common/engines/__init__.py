"""Engines: vLLM (offline engine, its worker and hidden-states connector), SGLang, any OpenAI server, their processes and keys. The vLLM side runs in the engine venv: stdlib imports only here."""
