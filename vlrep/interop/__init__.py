"""The border with other codebases' files: published checkpoints in (`import_run`), a run's weights out (`export`),
one module per format in `formats/` holding both directions' key maps (files are read safely by the root leaf
`vlrep.torch_files`). Runs under JAX; the PyTorch side of the border is `vlrep.pytorch`."""
