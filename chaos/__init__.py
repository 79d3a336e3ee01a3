"""TensorHub chaos package."""
