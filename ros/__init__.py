"""TensorHub ros package."""
