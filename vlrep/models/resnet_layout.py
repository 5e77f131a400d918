"""The ResNet depths vlrep builds, as blocks per stage: shared by the Flax ResNet (`vlrep.models.resnet`) and its
PyTorch twin (`vlrep.pytorch.resnet`) without either importing the other's framework."""

DEPTHS = {
  10: (1, 1, 1, 1),  # tests only: one block per stage
  18: (2, 2, 2, 2),
  26: (2, 2, 2, 2),
  50: (3, 4, 6, 3),
  101: (3, 4, 23, 3),
  152: (3, 8, 36, 3),
}

# Depths built from basic blocks (two 3x3 convolutions); the others use bottlenecks.
BASIC_BLOCK_DEPTHS = (10, 18)
