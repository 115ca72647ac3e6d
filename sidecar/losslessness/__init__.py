"""`specrl verify`: an executable losslessness certificate for a running sidecar.

`certificate.verify_sidecar` runs the checks through the client; `exact_target` computes the
target's exact distributions on the verifier side; `statistics` holds the goodness-of-fit
tests (shared with the engine tests); `report` renders text and JSON; `cli` is the command.
"""
