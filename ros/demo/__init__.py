"""`tensorhub demo`: a whole RL weight-update loop on one machine.

An embedded etcd, a hub, one trainer process and N rollout processes. The trainer trains a
small policy with REINFORCE, publishes every version, waits for one replica and steps on;
the rollouts fetch each version in place, serve it to each other, generate with it and send
rewards back. See docs/demo.md.
"""
