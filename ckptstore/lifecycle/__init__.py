"""Training-loop lifecycle: the checkpoint manager, its save and keep policies, staging."""
