"""Weight transport: moving a trainer's new weights into the sidecars' engines.

Follow one tensor, in one direction:
1. `trainer.policy.policy.Policy.export_named_tensors` yields (name, tensor) in the naming contract.
2. `sender.iter_push_requests` turns the stream into a manifest, the bytes on one transport,
   and a commit; `negotiation.TransportSession` picked that plane for this sidecar
   (`shm` if same host is proven, `collective` if the run sets a group up, else `grpc`).
   (`sidecar.client.fleet.Fleet` places a push once in one region for all its `shm` sidecars:
   `sender.push_manifest` + `ShmSender.place` + `sender.framed_push`.)
3. The bytes travel: `grpc` as `WeightChunk` messages encoded by `sidecar.protocol.weight_wire`,
   `shm` through a region (`shm`), `collective` by broadcast (`collective`).
4. `receiver.WeightReceiver` (behind `WeightService.PushWeights`) checks the manifest, stages
   each tensor into a buffer of its final dtype and shape and verifies its CRC-32 (`checksum`).
5. `sidecar.server.scheduler.Scheduler.apply_weights` swaps the verified tensors into the engine at a
   step boundary (`Engine.adopt_weights`: the embedded engine serves the staged tensors
   themselves and hands back the displaced ones, the next push's staging).
`delta` holds sparse deltas (a tensor's changed served-dtype elements against the sidecar's
served version: `plan_push` on the sender, `apply_delta` in the receiver's staging).
`memory` holds the allocator tuning a receiving process uses; `tensors` the byte view of a tensor.
"""
