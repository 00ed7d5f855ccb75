"""The drafter and its training: the model, its config and checkpoints, vocab maps, the target as the drafter sees it, the TTT loss, drift, speculative decoding."""
