"""On-disk and in-arena layouts: the torch.save-compatible zip writer and the plain per-rank layout."""
