"""specrl rollout sidecar: gRPC service, engines and the client library."""
