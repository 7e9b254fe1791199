"""Rank coordination on snapckpt's own channel (never the training process group) and node topology."""
