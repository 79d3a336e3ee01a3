"""Protos of the hub service and their generated Python code (`make proto` regenerates)."""
