"""Pieces every stage shares: drafter checkpoints, vocab maps, the verifier's lm_head, atomic outputs."""
