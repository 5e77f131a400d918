"""What runs under PyTorch: the torchvision detection worker, vlrep's ResNet in PyTorch and the Detectron2 driver.
Nothing here imports JAX or TensorFlow (tests/test_pytorch_wing.py): weights arrive as files `vlrep.interop`
wrote."""
