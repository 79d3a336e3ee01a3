"""TensorHub bench package."""
