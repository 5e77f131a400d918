"""The border with other codebases' files: published checkpoints in (`import_run`), a run's weights out (`export`),
one module per format in `formats/` holding both directions' key maps, and `torch_files`, the safe reader of
torch.save and safetensors files. Runs under JAX; the PyTorch side of the border is `vlrep.pytorch`."""
