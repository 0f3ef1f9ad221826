"""Pure functions from a config to the command lines that start its workers."""
