"""What a run leaves behind: the adapter (gathered, checked, written atomically), checkpoints and their
pickle-free state files."""
