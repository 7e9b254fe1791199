"""Training-process side of the data path: the Checkpointer facade, the save pipeline and the Stager that
copies a rank's state into its arena slot, the load agreement, hooks and the snapshot policy."""
