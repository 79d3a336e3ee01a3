"""TensorHub consistency package."""
