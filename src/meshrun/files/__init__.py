"""Files in and out of a process: atomic writes, JSON from elsewhere read with bounds, paths kept
inside their folder, whether a folder takes a new file, and the console's progress lines."""
