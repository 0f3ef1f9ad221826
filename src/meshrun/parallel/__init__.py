"""The mesh and everything that splits a model over it: the layout of ranks (`mesh`), the pipeline
stage split (`stages`, torch-free), and `parallelize`, which applies each axis in one fixed order."""
