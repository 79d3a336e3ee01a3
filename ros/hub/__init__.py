"""The hub: a stateless gRPC service over etcd (`tensorhub serve`)."""
