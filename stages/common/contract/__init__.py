"""The stage contract: what a stage is, its errors, its atomic outputs, how it computes on a CPU."""
