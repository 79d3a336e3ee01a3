"""The parts of the Ray weight-sync example (deploy/ray/weight_sync.py), one job a module.

`model`: the stand-in policy and its fingerprint. `reports`: what the actors and the driver
say about a run. `actors`: the trainer and rollout actors. `driver`: the run on the cluster.
`table`: the run's table on stdout.

Ray ships these modules to its workers by value (`weight_sync.py` registers the package with
Ray's cloudpickle), as it ships a script's own classes: only the `ros` SDK must be installed
on every node, not this directory.
"""
