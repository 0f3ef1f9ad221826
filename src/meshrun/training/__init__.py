"""The training loop and the pieces it is made of (precision, optimizer)."""
