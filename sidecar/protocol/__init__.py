"""The gRPC edge of specrl: generated specrl.v1 stubs and their conversion to domain types.

Only this package imports the generated code (`sidecar/protocol/specrl/v1/`, produced by
`tools/gen_proto.py` from `proto/`). Engines, the trainer, Muon and YaRN see the plain types
of `sidecar.types`.
"""
