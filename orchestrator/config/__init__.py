"""What the user writes: hosts, run specs, patch sets on disk, objectives, and their checks and field docs."""
