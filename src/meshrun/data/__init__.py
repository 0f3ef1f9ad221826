"""Byte-level token datasets: preparing text files into memmaps, and reading batches from them."""
