"""Scripts launched under torchrun by tests/train/test_distributed.py."""
