"""What a committed checkpoint looks like on storage: the manifest (commit record), the plain layout's
names, and the one-writer claim of a checkpoint directory."""
