"""Data: sources (files -> documents), tokenize (documents -> ids, in workers), storage (shards and
other formats behind one reader), dataset (batches by global sample index, mixtures), prepare."""
