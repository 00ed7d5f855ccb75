"""Data: chat JSONL and its masks, prompts for engines, the features' shards, a data-parallel part."""
