"""Cluster-scale flow simulator whose scheduling decisions come from `transport.planner`."""
