"""TensorHub transport package."""
